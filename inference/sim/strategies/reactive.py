"""Cacheless, no prediction: a worker loads an expert only once the router has named it.

Layer l belongs to worker group l mod G; the group's workers share the layer's routed experts. Each
worker copies its expert over PCIe after main's message (hidden state + expert ids) arrives, computes,
answers and frees the expert. The load is on the critical path of every layer.
"""

from __future__ import annotations

from inference.sim.strategies.base import Setup
from inference.sim.strategies.workers import WorkerPool, prefill_on_workers, worker_memory
from inference.sim.traces import Trace


# Alike full_cache.py's FullCache by domain, on purpose: each strategy simulates its own workers.
class Reactive:
    name = "reactive"

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.costs = setup.costs

    def prefill(self, prompt_tokens: int) -> float:
        return prefill_on_workers(self.setup, prompt_tokens, preload=False)

    def decode(self, trace: Trace, contexts: list[int]) -> list[float]:
        pool = WorkerPool(self.setup)
        c = self.costs
        now = 0.0
        times = []
        for step, context in zip(trace, contexts, strict=False):
            start = now
            for layer, experts in enumerate(step):
                routed = now + c.attention_layer(1, context)
                now = pool.serve_layer(layer, experts, routed, predicted=None, predicted_at=None)
            now += c.head()
            times.append(now - start)
        return times

    def memory(self, context_tokens: int) -> dict[str, float]:
        # Its loads hold the same slots as odmoe's prefetches (WorkerPool: prefetch_depth a worker).
        return worker_memory(self.setup, context_tokens, experts_resident=self.setup.prefetch_depth)
