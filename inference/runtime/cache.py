"""Experts a worker keeps on its device between uses, for the strategies that cache.

``DeviceCache`` maps (layer, expert) to the resident copy, in least-recently-used order;
with a per-layer capacity it frees the least recently used expert of a layer when a new
one comes in (``lru-offload``), without one it keeps everything (``full-cache``). The
expert loader owns it and calls it under its lock; which entry goes is decided by
``strategies.lru_evictions``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from inference.policies.strategies import lru_evictions

LayerExpert = tuple[int, int]
R = TypeVar("R")


class DeviceCache(Generic[R]):
    def __init__(self, capacity_per_layer: int | None) -> None:
        if capacity_per_layer is not None and capacity_per_layer < 0:
            raise ValueError("capacity_per_layer must be >= 0 (or None for no limit)")
        self.capacity_per_layer = capacity_per_layer
        self._entries: OrderedDict[LayerExpert, tuple[R, int]] = OrderedDict()
        self._bytes = 0

    def __contains__(self, key: LayerExpert) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: LayerExpert) -> R | None:
        """The cached expert (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def admit(self, key: LayerExpert, resident: R, nbytes: int) -> list[R]:
        """Keep ``resident`` as the most recently used; returns the entries this pushed out.

        The caller owns what comes back: on CUDA it must tell the allocator which stream still
        reads those tensors before dropping them (``record_stream``).
        """
        old = self._entries.pop(key, None)
        freed = []
        if old is not None:
            self._bytes -= old[1]
            if old[0] is not resident:
                freed.append(old[0])  # a second copy of the same expert replaces the first
        if self.capacity_per_layer == 0:
            return [*freed, resident]
        self._entries[key] = (resident, nbytes)
        self._bytes += nbytes
        if self.capacity_per_layer is None:
            return freed
        victims = lru_evictions(list(self._entries), key[0], self.capacity_per_layer)
        for victim in victims:
            entry, size = self._entries.pop(victim)
            self._bytes -= size
            freed.append(entry)
        return freed

    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
