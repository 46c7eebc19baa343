"""A hot store's pins and counts at a worker, and the stats the worker sends at a session's end."""

from __future__ import annotations

from inference.runtime.disk_store import HotSetStore
from inference.runtime.loader import LoaderStats
from inference.wire.runtime import WorkerStats


class HotPins:
    """A hot store's pins (inference.policies.hotset): per (session step, layer), the predicted
    experts it keeps in RAM until main has served that layer; and its disk reads and RAM hits.
    With another store it does nothing and counts (0, 0)."""

    def __init__(self, store: object) -> None:
        # A hot store keeps predicted experts in RAM (pins) and counts its disk reads.
        self.hot = store if isinstance(store, HotSetStore) else None
        self.pins: dict[tuple[int, int], set[int]] = {}
        self.counts_at_begin = (0, 0)  # (reads, hits) when the session began

    def counts(self) -> tuple[int, int]:
        """A hot store's experts read from disk and served from RAM so far ((0, 0) for another store)."""
        return (self.hot.reads, self.hot.hits) if self.hot is not None else (0, 0)

    def mark_begin(self) -> None:
        self.counts_at_begin = self.counts()

    def since_begin(self) -> tuple[int, int]:
        reads, hits = (now - then for now, then in zip(self.counts(), self.counts_at_begin, strict=True))
        return reads, hits

    def pin(self, step: int, layer: int, experts: set[int]) -> None:
        """Keep a hot store's predicted experts in RAM until the layer is served (the pin bonus)."""
        if self.hot is None:
            return
        pinned = self.pins.setdefault((step, layer), set())
        for expert in sorted(experts - pinned):
            self.hot.pin(layer, expert)
        pinned |= experts

    def unpin_through(self, here: tuple[int, int]) -> None:
        for key in [k for k in self.pins if k <= here]:
            assert self.hot is not None  # only a hot store has pins
            for expert in self.pins.pop(key):
                self.hot.unpin(key[1], expert)

    def clear(self) -> None:
        self.pins.clear()
        if self.hot is not None:
            self.hot.clear_pins()


def session_stats(
    request_id: str, worker: int, expert_bytes: int, stats: LoaderStats, pins: HotPins, cpu_experts: int
) -> WorkerStats:
    """What one worker did in a session, for main's metrics."""
    reads, hits = pins.since_begin()
    return WorkerStats(
        request_id=request_id,
        worker=worker,
        expert_bytes=expert_bytes,
        peak_decode_bytes=stats.peak_bytes["decode"],
        peak_prefill_bytes=stats.peak_bytes["prefill"],
        loads=stats.loads,
        hits=stats.hits,
        misses=stats.misses,
        wasted_loads=stats.wasted_loads,
        load_ms=stats.load_ms,
        disk_reads=reads,
        hot_hits=hits,
        cpu_experts=cpu_experts,
    )
