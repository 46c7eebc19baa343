"""A worker's expert loader on a clock: `inference.runtime.loader.ExpertLoader`'s decisions, each
taken by the runtime's own pure function (`inference.policies.loads`, `inference.policies.strategies`),
for the emulated cluster (`inference.sim.cluster`, whose docstring gives the rules).
"""

from __future__ import annotations

from collections import OrderedDict

from inference.policies.loads import Key, pick_victim, take_batch
from inference.policies.strategies import lru_evictions


class LoaderSim:
    """`inference.runtime.loader.ExpertLoader`'s decisions on a clock (see the module docstring)."""

    def __init__(self, copy_s: float, max_resident: int, cache: int | str | None = "none") -> None:
        self.copy_s = copy_s
        self.max_resident = max_resident
        self.cache_kind = cache  # "none", None (keep all), or a per-layer capacity
        self.cache: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.queue: list[Key] = []
        self.urgent: list[Key] = []
        self.loading: list[tuple[Key, float]] = []  # (key, copy done at), in copy order
        self.drop: set[Key] = set()
        self.ready: set[Key] = set()
        self.in_use: set[Key] = set()
        self.clock = 0.0
        self.engine_free = 0.0
        self.loads = 0
        self.wasted = 0

    # the copy engine
    def _slots_used(self) -> int:
        return len(self.ready) + len(self.loading)

    def _make_room(self) -> None:
        """A computation waits: push out the idle prefetch needed last (it is queued again)."""
        while self._slots_used() >= self.max_resident:
            victim = pick_victim(list(self.ready), self.in_use)
            if victim is None:
                return
            self.ready.discard(victim)
            self.wasted += 1
            self.queue.append(victim)
            self.queue.sort()

    def _try_start(self, t: float) -> None:
        if self.urgent and not self.loading:
            self._make_room()
        if self.loading or not (self.urgent or self.queue) or self._slots_used() >= self.max_resident:
            return
        start = max(t, self.engine_free)
        room = self.max_resident - self._slots_used() - 1
        batch, self.urgent, self.queue = take_batch(self.urgent, self.queue, room)
        self.loading = [(key, start + self.copy_s * (i + 1)) for i, key in enumerate(batch)]
        self.engine_free = self.loading[-1][1]

    def advance(self, t: float) -> None:
        """Run the copy engine up to time ``t``."""
        t = max(t, self.clock)
        while self.loading and self.loading[0][1] <= t:
            key, done = self.loading.pop(0)
            self.clock = done
            self.loads += 1
            if key in self.drop:
                self.drop.discard(key)
                self.wasted += 1
            else:
                self.ready.add(key)
            if not self.loading:
                self._try_start(done)
        self.clock = t
        self._try_start(t)

    def cached(self, key: Key) -> bool:
        return self.cache_kind != "none" and key[1:] in self.cache

    def state(self, key: Key) -> str:
        if key in self.ready or self.cached(key):
            return "ready"
        if any(k == key for k, _ in self.loading):
            return "loading"
        if key in self.urgent or key in self.queue:
            return "queued"
        return "absent"

    def copy_eta(self, key: Key) -> float:
        """When ``key`` would be on the device if copied (the runtime's estimate,
        `inference.policies.hybrid.copy_eta`)."""
        if self.state(key) == "ready":
            return self.clock
        for k, done in self.loading:
            if k == key:
                return done
        pass_done = self.loading[-1][1] if self.loading else self.clock
        pending = self.urgent + self.queue
        ahead = pending.index(key) if key in pending else 0
        return pass_done + self.copy_s * (ahead + 1)

    # what the worker calls
    def prefetch(self, key: Key, t: float) -> None:
        self.advance(t)
        self.drop.discard(key)
        if key in self.ready or self.state(key) in ("loading", "queued") or self.cached(key):
            return
        self.queue.append(key)
        self.queue.sort()
        self._try_start(self.clock)

    def discard(self, keep, t: float) -> None:
        self.advance(t)
        self.queue = [k for k in self.queue if keep(k)]
        for key in [k for k in self.ready if not keep(k) and k not in self.in_use]:
            self.ready.discard(key)
            self.wasted += 1
        self.drop |= {k for k, _ in self.loading if not keep(k)}
        self._try_start(self.clock)

    def forget(self, key: Key, t: float) -> None:
        """Drop a copy not yet started (hybrid: the expert went to the CPU)."""
        self.advance(t)
        if key in self.queue:
            self.queue.remove(key)
        if key in self.urgent:
            self.urgent.remove(key)

    def acquire(self, key: Key, t: float) -> float:
        """The time ``key`` is usable, from a request at ``t`` (blocks the worker until then)."""
        self.advance(t)
        if self.cached(key):
            self.cache.move_to_end(key[1:])
            self.in_use.add(key)
            return self.clock
        self.drop.discard(key)
        if key not in self.ready and self.state(key) != "loading" and key not in self.urgent:
            if key in self.queue:
                self.queue.remove(key)
            self.urgent.append(key)
            self._make_room()
            self._try_start(self.clock)
        while key not in self.ready:
            if not self.loading:
                raise RuntimeError(f"loader model stalled waiting for {key}")
            self.advance(self.loading[0][1])
        self.in_use.add(key)
        return self.clock

    def release(self, key: Key, t: float) -> None:
        self.advance(t)
        self.in_use.discard(key)
        if key in self.ready:
            self.ready.discard(key)
            if self.cache_kind != "none":
                self.cache[key[1:]] = None
                self.cache.move_to_end(key[1:])
                if isinstance(self.cache_kind, int):
                    for victim in lru_evictions(list(self.cache), key[1], self.cache_kind):
                        del self.cache[victim]
        self._try_start(self.clock)
