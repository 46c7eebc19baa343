"""LRU offload on one GPU (Mixtral-Offloading): quantised weights, a per-layer expert cache, prefetch.

Attention and experts are HQQ-quantised (bits from their published configuration, see `sources`). Each
layer keeps its C most recently used experts on the GPU. As their released code does
(`src/expert_cache.py`, `ExpertCache._swap`), a routed expert that is not cached is *swapped* in:
the least recently used one is copied out to pinned host memory and the needed one copied in, both
on the stream the kernels run on, so a miss costs two expert copies that neither overlap each other
nor the layer's compute; the cached experts are computed first. Their block loops over the hit
experts with a host sync each, as Transformers' does (the same per-hit CPU time).
With `lru_prefetch` (a what-if: their report describes it, their released code lists it as not yet
available), once a layer's router has run, the next layer's gate applied to the current hidden state
guesses that layer's experts (right with the published recall) and their copies start at once on a
copy stream of their own.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from inference.policies.strategies import lru_evictions, lru_resident
from inference.sim.sources import value
from inference.sim.strategies.base import Setup, kv_cache_bytes
from inference.sim.strategies.odmoe import shadow_prediction
from inference.sim.traces import Trace


class LruOffload:
    name = "lru-offload"

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.costs = setup.costs
        self.expert_bits = value("mixtral_offloading_expert_bits")
        self.attention_bits = value("mixtral_offloading_attention_bits")
        self.capacity = setup.cluster.lru_cache_per_layer
        self.hits = 0
        self.lookups = 0

    def _fresh_state(self) -> None:
        m = self.costs.model
        # After prefill every expert went through the cache, in order; what the LRU keeps stays.
        self.cache = [
            OrderedDict((e, 0.0) for _, e in lru_resident([(layer, e) for e in range(m.experts)], self.capacity))
            for layer in range(m.layers)
        ]
        self.pcie_free = 0.0

    def _admit(self, layer: int, expert: int, ready_at: float) -> None:
        """Cache ``expert`` of ``layer`` as the most recently used; the runtime's rule
        (`inference.policies.strategies.lru_evictions`) picks what leaves."""
        cache = self.cache[layer]
        cache[expert] = ready_at
        for _, victim in lru_evictions([(layer, e) for e in cache], layer, self.capacity):
            del cache[victim]

    def _fetch(self, layer: int, expert: int, earliest: float) -> float:
        """When `expert` of `layer` is on the GPU, copying it if needed; updates the LRU order."""
        cache = self.cache[layer]
        if expert in cache:
            cache.move_to_end(expert)
            return cache[expert]
        start = max(earliest, self.pcie_free)
        done = start + self.costs.expert_load(self.expert_bits)
        self.pcie_free = done
        self._admit(layer, expert, done)
        return done

    def _layer(self, layer: int, experts: list[int], tokens: int, context: int, start: float) -> float:
        c = self.costs
        now = start + c.attention_layer(tokens, context, self.attention_bits) + c.impl.moe_fixed_cpu
        cache = self.cache[layer]
        self.lookups += len(experts)
        self.hits += sum(e in cache for e in experts)
        compute = c.expert_gpu(tokens, self.expert_bits)
        swap = value("mixtral_offloading_copies_per_miss") * c.expert_load(self.expert_bits)
        for expert in sorted(experts, key=lambda e: e not in cache):  # cached ones first (unordered=True)
            if expert in cache:
                cache.move_to_end(expert)
                now = max(now, cache[expert])  # a prefetch still in flight (what-if)
                gpu = compute
            else:
                gpu = swap + compute  # the swap runs on the kernels' stream
                self._admit(layer, expert, 0.0)
            now += max(c.impl.moe_cpu_per_hit_expert, gpu)
        self.pcie_free = max(self.pcie_free, now)
        return now

    def prefill(self, prompt_tokens: int) -> float:
        m = self.costs.model
        self._fresh_state()
        self.cache = [OrderedDict() for _ in range(m.layers)]
        now = 0.0
        per_expert = max(1, round(prompt_tokens * m.top_k / m.experts))
        hit = min(m.experts, prompt_tokens * m.top_k)
        for layer in range(m.layers):
            now = self._layer(layer, list(range(hit)), per_expert, prompt_tokens, now)
        return now + self.costs.head()

    def decode(self, trace: Trace, contexts: list[int]) -> list[float]:
        c = self.costs
        m = c.model
        self._fresh_state()
        rng = random.Random(self.setup.cluster.seed)
        recall = value("speculative_prefetch_recall")
        now = 0.0
        times = []
        for step, context in zip(trace, contexts, strict=False):
            start = now
            for layer, experts in enumerate(step):
                routed = now + c.attention_layer(1, context, self.attention_bits)
                if self.setup.cluster.lru_prefetch and layer + 1 < m.layers:
                    # In the guess's order, not sorted as a runtime worker's prefetch is
                    # (`prefetch_on_prediction`): kept, since it moves this what-if's figures.
                    for guess in shadow_prediction(step[layer + 1], m.experts, recall, rng):
                        self._fetch(layer + 1, guess, routed)
                now = self._layer(layer, experts, 1, context, now)
            now += c.head()
            times.append(now - start)
        return times

    def memory(self, context_tokens: int) -> dict[str, float]:
        m = self.costs.model
        attention = m.layers * m.attention_params * self.attention_bits / 8
        other_fp16 = (m.non_expert_params - m.layers * m.attention_params) * 2
        cache = m.layers * self.capacity * m.expert_bytes(self.expert_bits)
        staging = 2 * m.expert_bytes(self.expert_bits)  # copy buffers
        total = attention + other_fp16 + cache + staging + kv_cache_bytes(self.costs, context_tokens)
        return {"gpu0": total + value("cuda_context_memory")}
