"""The eviction rule of a hot set of experts in host memory over a worker's disk store (Edge0's SSD streaming).

``inference.runtime.disk_store.HotSetStore`` keeps at most ``capacity`` experts read from a ``DiskStore`` in RAM, least
recently used out first, and gives predicted experts a *pin bonus*: an expert named by a
prediction (``pin``) stays until it has been used (``unpin``), and is pushed out only when
every expert held is pinned. An expert in the hot set is served without a disk read; any
other is read from the shard, and kept. So a worker's host memory holds its overhead plus
``capacity`` experts, whatever it owns, and the experts that recur (the routers' favourites)
cost no read.

``hot_set_victims`` is the eviction rule as a pure function (no torch, no store: the simulator
may use it too); the store applies it under a lock (the loader's copy thread reads while the
worker loop pins).
"""

from __future__ import annotations

from collections.abc import Sequence

LayerExpert = tuple[int, int]


def hot_set_victims(order: Sequence[LayerExpert], pinned: set[LayerExpert], capacity: int) -> list[LayerExpert]:
    """What to push out of a hot set in ``order`` (least recently used first) to hold ``capacity``.

    Unpinned experts go first, oldest first; pinned ones only when nothing else is left.
    """
    excess = len(order) - max(0, capacity)
    if excess <= 0:
        return []
    unpinned = [key for key in order if key not in pinned]
    victims = unpinned[:excess]
    if len(victims) < excess:
        victims += [key for key in order if key in pinned][: excess - len(victims)]
    return victims
