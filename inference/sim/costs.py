"""Time of each piece of work (a layer's attention, one expert, a copy, a message) on given hardware.

Pure arithmetic: a GPU segment takes max(bytes / (bandwidth * mbu), flops / (peak * mfu)); an eager
segment takes max(its CPU launch time, its GPU time) because Transformers synchronises at segment
ends; a full model's expert loop is one such segment per hit expert (a host sync before each);
a copy or message takes latency + bytes / link rate (+ per-message CPU on each side).
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.sim.efficiency import Implementation
from inference.sim.hardware import Profile
from inference.sim.model_sizes import ModelSizes


@dataclass(frozen=True)
class Costs:
    model: ModelSizes
    profile: Profile
    impl: Implementation

    @property
    def ideal(self) -> bool:
        return not self.impl.uses_effective_links

    def gpu_time(self, nbytes: float, flops: float) -> float:
        gpu = self.profile.gpu
        return max(nbytes / (gpu.memory_bandwidth * self.impl.mbu), flops / (gpu.fp16_flops * self.impl.mfu))

    def attention_layer(self, tokens: int, context: int, bits: float = 16) -> float:
        """Norms, attention and router of one layer for `tokens` new tokens at `context` positions."""
        m = self.model
        nbytes = m.layer_dense_params * bits / 8 + context * m.kv_bytes_per_token_layer()
        return max(self.impl.attention_cpu, self.gpu_time(nbytes, m.attention_flops(tokens, context)))

    def expert_gpu(self, tokens: int, bits: float = 16) -> float:
        return self.gpu_time(self.model.expert_bytes(bits), self.model.expert_flops(tokens))

    def expert_call(self, tokens: int, bits: float = 16) -> float:
        """One expert computed on its own (a worker's call)."""
        return max(self.impl.expert_cpu, self.expert_gpu(tokens, bits))

    def moe_block(self, tokens_per_expert: list[int], bits: float = 16) -> float:
        """A full model's expert loop (Transformers): the block's fixed CPU, then each hit expert as a
        segment of its own (a host sync before it): max(its launches, its GPU time)."""
        hit = [n for n in tokens_per_expert if n > 0]
        per_hit = self.impl.moe_cpu_per_hit_expert
        return self.impl.moe_fixed_cpu + sum(max(per_hit, self.expert_gpu(n, bits)) for n in hit)

    def head(self, bits: float = 16) -> float:
        """Final norm + LM head for one token + sampling, plus the per-forward fixed CPU time."""
        m = self.model
        return max(self.impl.step_cpu, self.gpu_time(m.head_params * bits / 8, 2 * m.head_params))

    def expert_load(self, bits: float = 16) -> float:
        link = self.profile.host_to_device
        return link.latency + self.model.expert_bytes(bits) / link.rate(self.ideal)

    def device_hop(self, nbytes: float) -> float:
        link = self.profile.host_to_device
        return link.latency + nbytes / link.rate(self.ideal)

    def message(self, nbytes: float, count: int = 1) -> float:
        """`count` messages of `nbytes` that share one node's network link (sent back to back)."""
        link = self.profile.network
        return link.latency + count * (nbytes / link.rate(self.ideal) + 2 * self.impl.message_cpu)
