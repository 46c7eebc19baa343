"""A hot set of experts in host memory over a worker's disk store (Edge0's SSD streaming).

``HotSetStore`` keeps at most ``capacity`` experts read from a ``DiskStore`` in RAM, least
recently used out first, and gives predicted experts a *pin bonus*: an expert named by a
prediction (``pin``) stays until it has been used (``unpin``), and is pushed out only when
every expert held is pinned. An expert in the hot set is served without a disk read; any
other is read from the shard, and kept. So a worker's host memory holds its overhead plus
``capacity`` experts, whatever it owns, and the experts that recur (the routers' favourites)
cost no read.

``hot_set_victims`` is the eviction rule as a pure function; the store applies it under a
lock (the loader's copy thread reads while the worker loop pins).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence

from inference.experts import ExpertWeights
from inference.store import DiskStore

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


class HotSetStore:
    """A ``DiskStore`` with the last ``capacity`` experts it read kept in RAM (``ExpertStore``)."""

    def __init__(self, disk: DiskStore, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a hot set holds at least 1 expert, got {capacity}")
        self.disk = disk
        self.capacity = capacity
        self._held: OrderedDict[LayerExpert, ExpertWeights] = OrderedDict()
        self._pins: Counter[LayerExpert] = Counter()
        self._lock = threading.Lock()
        self.reads = 0  # experts read from disk
        self.hits = 0  # experts served from the hot set

    def keys(self) -> frozenset[LayerExpert]:
        return self.disk.keys()

    def nbytes(self, layer: int, expert: int) -> int:
        return self.disk.nbytes(layer, expert)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        key = (layer, expert)
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                self._held.move_to_end(key)
                self.hits += 1
                return held
        weights = self.disk.get(layer, expert)  # outside the lock: a read takes a while
        with self._lock:
            self.reads += 1
            self._held[key] = weights
            self._held.move_to_end(key)
            for victim in hot_set_victims(list(self._held), set(self._pins), self.capacity):
                del self._held[victim]
        return weights

    def pin(self, layer: int, expert: int) -> None:
        """A prediction named this expert: keep it until it is used."""
        with self._lock:
            self._pins[(layer, expert)] += 1

    def unpin(self, layer: int, expert: int) -> None:
        with self._lock:
            key = (layer, expert)
            if self._pins[key] <= 1:
                self._pins.pop(key, None)
            else:
                self._pins[key] -= 1

    def clear_pins(self) -> None:
        with self._lock:
            self._pins.clear()

    def held(self) -> list[LayerExpert]:
        """The experts in RAM, least recently used first."""
        with self._lock:
            return list(self._held)

    def resident_bytes(self) -> int:
        with self._lock:
            return sum(w.nbytes for w in self._held.values())

    def close(self) -> None:
        self.disk.close()
