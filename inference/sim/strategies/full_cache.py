"""Full cache: every expert resident, the model split layer-wise over several GPUs of one server.

This is Transformers with `device_map` across N GPUs: layers run one after the other, one GPU busy at
a time, the hidden state hops GPU to GPU over PCIe at each boundary (N - 1 hops per forward).
"""

from __future__ import annotations

from inference.sim.sources import value
from inference.sim.strategies.base import Setup, kv_cache_bytes, tokens_per_expert
from inference.sim.traces import Trace


class FullCache:
    name = "full-cache"

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.costs = setup.costs

    def _hops(self, tokens: int) -> float:
        gpus = self.setup.cluster.full_cache_gpus
        return (gpus - 1) * self.costs.device_hop(self.costs.model.hidden_bytes(tokens))

    def prefill(self, prompt_tokens: int) -> float:
        m = self.costs.model
        split = tokens_per_expert(prompt_tokens, m.experts, m.top_k)
        layer = self.costs.attention_layer(prompt_tokens, prompt_tokens) + self.costs.moe_block(split)
        return m.layers * layer + self._hops(prompt_tokens) + self.costs.head()

    def decode(self, trace: Trace, contexts: list[int]) -> list[float]:
        times = []
        for step, context in zip(trace, contexts, strict=False):
            total = self._hops(1) + self.costs.head()
            for experts in step:
                split = [1] * len(experts)
                total += self.costs.attention_layer(1, context) + self.costs.moe_block(split)
            times.append(total)
        return times

    def memory(self, context_tokens: int) -> dict[str, float]:
        m = self.costs.model
        gpus = self.setup.cluster.full_cache_gpus
        weights = m.total_params * 2 + kv_cache_bytes(self.costs, context_tokens)
        per_gpu = weights / gpus + value("cuda_context_memory")
        return {f"gpu{i}": per_gpu for i in range(gpus)}
