"""How far each implementation falls short of the roofline: kernel efficiency and CPU-side time.

An `Implementation` says what fraction of the memory (`mbu`) and compute (`mfu`) roofline its GPU
kernels reach and how much CPU time eager PyTorch spends launching each piece of work. Eager PyTorch on
a GPU is launch-bound at batch 1, and Transformers' Mixtral block synchronises with the GPU to learn
which experts were hit, so CPU time and GPU time of one segment do not overlap across the segment
boundary: a segment costs max(cpu, gpu). Transformers' expert loop (`MixtralExperts.forward`,
eager) visits only the hit experts, each behind a `torch.where` host sync, so each hit expert is a
segment of its own: max(its launches' CPU time, its GPU time). The CPU figures are eager PyTorch's
time per aten op on a GPU server (the published eager gpt-fast figure over the ops of a dense
layer) times the ops we counted in Transformers' Mistral and Mixtral layers here (all in `sources`;
the op counts are exact, where this 2-core box's timings of the small top-1/top-2 difference are
within their own noise). `IDEAL` is the roofline: perfect kernels, no CPU time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from inference.sim.sources import value


@dataclass(frozen=True)
class Implementation:
    name: str
    mbu: float  # fraction of memory bandwidth reached by decode kernels
    mfu: float  # fraction of tensor FLOP/s reached by prefill GEMMs
    attention_cpu: float  # s per layer: norms, attention, router (eager launches)
    moe_fixed_cpu: float  # s per layer: a full model's MoE block beyond a dense layer (one_hot, nonzero)
    moe_cpu_per_hit_expert: float  # s per hit expert in a full model's MoE loop (its own segment)
    expert_cpu: float  # s per expert call on its own (a worker computing one expert)
    step_cpu: float  # s per forward: embedding, masks, final norm, LM head, sampling
    message_cpu: float  # s per network message on each side (serialise, send or receive)
    uses_effective_links: bool  # effective link rates (adjusted) or spec peaks (ideal)

    def as_dict(self) -> dict:
        return asdict(self)


def _server_scale() -> float:
    """CPU-time factor from our CI box (CPU tensors) to eager PyTorch on a GPU server (launches included)."""
    return value("eager_dense_layer_cpu") / value("hf_mistral_layer_cpu_here")


def _per_op() -> float:
    return value("eager_dense_layer_cpu") / value("hf_mistral_ops_per_layer")


IDEAL = Implementation("roofline", 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, uses_effective_links=False)


def _mixtral_op_split() -> tuple[float, float]:
    """(fixed ops beyond the dense layer, ops per hit expert) of Transformers' Mixtral layer, measured."""
    top1, top2 = value("hf_mixtral_ops_per_layer_top1"), value("hf_mixtral_ops_per_layer_top2")
    per_hit = top2 - top1
    return top1 - per_hit - value("hf_mistral_ops_per_layer"), per_hit


def transformers_eager() -> Implementation:
    """Hugging Face Transformers `MixtralForCausalLM` in eager mode (the paper's full-cache baseline)."""
    scale = _server_scale()
    return Implementation(
        "transformers-eager",
        mbu=value("gpt_fast_compiled_mbu"),
        mfu=value("assumed_prefill_mfu"),
        attention_cpu=value("eager_dense_layer_cpu"),
        moe_fixed_cpu=_mixtral_op_split()[0] * _per_op(),
        moe_cpu_per_hit_expert=_mixtral_op_split()[1] * _per_op(),
        expert_cpu=value("pytorch_ops_per_expert_call") * _per_op(),
        step_cpu=value("hf_mixtral_step_fixed_here") * scale,
        message_cpu=0.0,
        uses_effective_links=True,
    )


def odmoe_runtime() -> Implementation:
    """The OD-MoE runtime: eager attention + router on main, one expert call per worker, ZeroMQ messages."""
    base = transformers_eager()
    return Implementation(
        "odmoe-eager-zmq",
        mbu=base.mbu,
        mfu=base.mfu,
        attention_cpu=base.attention_cpu,
        moe_fixed_cpu=0.0,
        moe_cpu_per_hit_expert=0.0,
        expert_cpu=base.expert_cpu,
        step_cpu=base.step_cpu,
        message_cpu=value("message_cpu_overhead"),
        uses_effective_links=True,
    )


def mixtral_offloading() -> Implementation:
    """Mixtral-Offloading: Transformers' Mixtral modules with HQQ-quantised weights and an expert cache.

    Its MoE block (`SparseMoeWrapper`) loops over the hit experts with a `torch.where` and `.tolist()`
    each, as Transformers' does, so the same per-hit-expert CPU time applies."""
    return replace(transformers_eager(), name="mixtral-offloading")


def for_strategy(strategy: str, ideal: bool) -> Implementation:
    if ideal:
        return IDEAL
    if strategy == "full-cache":
        return transformers_eager()
    if strategy == "lru-offload":
        return mixtral_offloading()
    return odmoe_runtime()
