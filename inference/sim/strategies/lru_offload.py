"""LRU offload on one GPU (Mixtral-Offloading): quantised weights, a per-layer expert cache, prefetch.

Attention and experts are HQQ-quantised (bits from their published configuration, see `sources`). Each
layer keeps its C most recently used experts on the GPU; a routed expert that is not cached is copied
from pinned host memory over PCIe (one copy stream) and enters the cache, evicting the least recently
used. With `lru_prefetch`, once a layer's router has run, the next layer's gate applied to the current
hidden state guesses that layer's experts (right with the published recall) and their copies start at
once. Their released code lists that prefetch as not yet implemented; set `lru_prefetch=False` to
model the released code.
"""

from __future__ import annotations

import random
from collections import OrderedDict

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
        # After prefill every expert went through the cache; the last C of each layer stay.
        self.cache = [
            OrderedDict((e, 0.0) for e in range(m.experts - self.capacity, m.experts)) for _ in range(m.layers)
        ]
        self.pcie_free = 0.0

    def _fetch(self, layer: int, expert: int, earliest: float) -> float:
        """When `expert` of `layer` is on the GPU, copying it if needed; updates the LRU order."""
        cache = self.cache[layer]
        if expert in cache:
            cache.move_to_end(expert)
            return cache[expert]
        start = max(earliest, self.pcie_free)
        done = start + self.costs.expert_load(self.expert_bits)
        self.pcie_free = done
        if self.capacity:
            cache[expert] = done
            while len(cache) > self.capacity:
                cache.popitem(last=False)
        return done

    def _layer(self, layer: int, experts: list[int], tokens: int, context: int, start: float) -> float:
        c = self.costs
        routed = start + c.attention_layer(tokens, context, self.attention_bits)
        self.lookups += len(experts)
        self.hits += sum(e in self.cache[layer] for e in experts)
        ready = [self._fetch(layer, e, routed) for e in experts]
        compute = c.expert_gpu(tokens, self.expert_bits)
        finish = routed
        for loaded in sorted(ready):
            finish = max(finish, loaded) + compute
        return max(finish, routed + c.impl.moe_loop_cpu_per_expert * len(experts))

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
