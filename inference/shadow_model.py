"""Build the shadow's model from its shard, converting tensor by tensor as they are read.

The shadow runs a lossy copy of the whole model (``inference.quant``), and the whole model in
full precision is what no shadow box can hold: Mixtral-8x7B is 93 GB in bf16, 26 GB in nf4.
So the full-precision model never exists here. Each tensor is read from the verified shard
(plain reads, ``inference.tensorfile``), moved to the shadow's device, converted there (cast,
or quantized by the device's own kernels, which are then the ones that read the data) and the
original dropped; an expert's ``w1`` waits only for its ``w3`` (they are quantized fused, as
the model computes them). Peak host memory is the converted model plus a tensor or two.

What each shadow dtype holds:

* ``fp32`` / ``bf16`` / ``fp16``: every tensor in that dtype, except the routers, which keep
  the checkpoint's (fp32 for an fp32 shadow): a forward pre-hook casts their input.
* ``int8`` / ``nf4``: attention projections, LM head and experts quantized (per expert, in
  stacked buffers read by ``quant.EXPERTS_IMPLEMENTATION``); embeddings, norms and routers in
  the checkpoint's dtype, which is also the compute dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralRotaryEmbedding, MixtralTopKRouter

from inference import quant
from inference.checkpoint import parse_expert_key
from inference.model import hf_name, load_config, load_generation_config
from inference.sharding import load_role_tensors

CAST_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHADOW_DTYPES = (*CAST_DTYPES, *quant.QUANT_SCHEMES)


@dataclass
class _Build:
    """What has been read and converted so far."""

    dtype: str
    device: torch.device
    plain: dict[str, torch.Tensor] = field(default_factory=dict)  # Transformers name -> tensor
    linears: dict[str, quant.QuantizedWeight] = field(default_factory=dict)  # module path -> weight
    # Quantized experts go straight into per-layer stacks [E, ...] of data and state, so each
    # expert's own result is freed at once and its memory reused by the next one.
    expert_q: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    expert_dense: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # [E, out, in] stacks
    pending: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)  # w1 awaiting w3
    converted: set[tuple[int, str, int]] = field(default_factory=set)  # (layer, gate_up|down, expert)
    source_bytes: int = 0
    largest_tensor_bytes: int = 0


def build_shadow_model(
    shard_dir: str | os.PathLike[str], dtype: str, device: torch.device, *, eager_experts: bool = False
) -> tuple[MixtralForCausalLM, dict]:
    """The shadow's model in ``dtype`` on ``device``, built from a shard holding every tensor.

    ``eager_experts`` selects Transformers' eager experts loop for cast dtypes (the grouped GEMM
    refuses some shapes; quantized experts always use their own loop). Returns the model and a
    report: ``dtype``, ``source_bytes`` (the shard's tensors), ``bytes`` (the converted model),
    ``experts_bytes`` and ``largest_tensor_bytes``.
    """
    if dtype not in (*CAST_DTYPES, *quant.QUANT_SCHEMES):
        raise ValueError(
            f"unsupported shadow dtype {dtype!r}; allowed: {', '.join((*CAST_DTYPES, *quant.QUANT_SCHEMES))}"
        )
    config = load_config(shard_dir)
    with torch.device("meta"):
        model = MixtralForCausalLM._from_config(config)
    quantized_paths = _quantizable_linears(model) if dtype in quant.QUANT_SCHEMES else set()
    build = _Build(dtype, device)
    for name, tensor in load_role_tensors(shard_dir):
        build.source_bytes += tensor.nbytes
        build.largest_tensor_bytes = max(build.largest_tensor_bytes, tensor.nbytes)
        _take(build, config.num_local_experts, name, tensor, quantized_paths)
    if build.pending:
        (layer, expert), parts = next(iter(build.pending.items()))
        unpaired = "w3" if "w1" in parts else "w1"
        raise ValueError(f"{shard_dir}: expert {expert} of layer {layer} lacks {unpaired}")
    _install(model, build, quantized_paths)
    model.model.rotary_emb = MixtralRotaryEmbedding(config=model.config).to(device)
    if dtype in quant.QUANT_SCHEMES:
        quant.register_experts_implementation()
        quant.detach_config_(model)
        model.config._experts_implementation = quant.EXPERTS_IMPLEMENTATION
    else:
        if eager_experts:
            model.set_experts_implementation("eager")
        for router in (m for m in model.modules() if isinstance(m, MixtralTopKRouter)):
            router.register_forward_pre_hook(quant.router_input_to_weight_dtype)
    generation_config = load_generation_config(shard_dir)
    if generation_config is not None:
        model.generation_config = generation_config
    model.eval()
    model.requires_grad_(False)
    model.odmoe_shadow_dtype = dtype
    report = {
        "dtype": dtype,
        "source_bytes": build.source_bytes,
        "bytes": quant.module_bytes(model),
        "experts_bytes": quant.experts_bytes(model),
        "largest_tensor_bytes": build.largest_tensor_bytes,
    }
    return model, report


def _quantizable_linears(model: nn.Module) -> set[str]:
    """Paths of the ``nn.Linear`` modules an int8/nf4 shadow quantizes: all but the routers'."""
    return {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def _plain_dtype(build: _Build, name: str, tensor: torch.Tensor) -> torch.dtype:
    if not tensor.is_floating_point() or build.dtype in quant.QUANT_SCHEMES:
        return tensor.dtype  # quantized shadows keep what they don't quantize as it is
    if name.endswith(".mlp.gate.weight") and build.dtype != "fp32":
        return tensor.dtype  # routers keep the checkpoint's precision: they decide the routing
    return CAST_DTYPES[build.dtype]


def _take(build: _Build, n_experts: int, name: str, tensor: torch.Tensor, quantized_paths: set[str]) -> None:
    key = parse_expert_key(name)
    if key is None:
        hf = hf_name(name)
        path = hf.removesuffix(".weight")
        if hf.endswith(".weight") and path in quantized_paths:
            build.linears[path] = quant.quantize_weight(tensor.to(build.device), build.dtype)
        else:
            build.plain[hf] = tensor.to(build.device, _plain_dtype(build, hf, tensor))
        return
    parts = build.pending.setdefault((key.layer, key.expert), {})
    parts[key.proj] = tensor
    if "w1" in parts and "w3" in parts:
        gate_up = torch.cat([parts.pop("w1").to(build.device), parts.pop("w3").to(build.device)])  # [2I, H]
        _expert(build, n_experts, key.layer, key.expert, "gate_up", gate_up)
    if "w2" in parts:
        _expert(build, n_experts, key.layer, key.expert, "down", parts.pop("w2").to(build.device))  # [H, I]
    if not parts:
        del build.pending[(key.layer, key.expert)]


def _expert(build: _Build, n_experts: int, layer: int, expert: int, which: str, weight: torch.Tensor) -> None:
    build.converted.add((layer, which, expert))
    if build.dtype in quant.QUANT_SCHEMES:
        q = quant.quantize_weight(weight, build.dtype)
        stacks = build.expert_q.get((layer, which))
        if stacks is None:
            stacks = tuple(
                torch.empty((n_experts, *t.shape), dtype=t.dtype, device=t.device) for t in (q.data, q.state)
            )
            build.expert_q[(layer, which)] = stacks
        stacks[0][expert].copy_(q.data)
        stacks[1][expert].copy_(q.state)
        return
    stack = build.expert_dense.get((layer, which))
    if stack is None:
        shape = (n_experts, *weight.shape)
        stack = torch.empty(shape, dtype=CAST_DTYPES[build.dtype], device=build.device)
        build.expert_dense[(layer, which)] = stack
    stack[expert].copy_(weight)


def _install(model: MixtralForCausalLM, build: _Build, quantized_paths: set[str]) -> None:
    """Put the converted tensors into the meta-built model; refuse a shard that lacks any."""
    state = dict(build.plain)
    for (layer, which), stack in build.expert_dense.items():
        state[f"model.layers.{layer}.mlp.experts.{which}_proj"] = stack
    for path, qweight in build.linears.items():
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        bias = state.pop(f"{path}.bias", None)
        setattr(parent, child, quant.QuantizedLinear(qweight, bias))
    missing_linears = quantized_paths - build.linears.keys()
    n_experts = model.config.num_local_experts
    for layer in range(model.config.num_hidden_layers):
        for which in ("gate_up", "down"):
            absent = [e for e in range(n_experts) if (layer, which, e) not in build.converted]
            if absent:
                raise ValueError(f"the shadow shard lacks expert {absent[0]} of layer {layer} ({which})")
    if build.dtype in quant.QUANT_SCHEMES:
        for layer, decoder in enumerate(model.model.layers):
            _install_quantized_experts(decoder.mlp.experts, build, layer)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"unexpected tensors in the shard: {sorted(unexpected)[:5]}")
    # Quantized modules hold buffers installed above, not loaded from ``state``.
    installed = {n for n in missing if n.rpartition(".")[0] in build.linears}
    if build.dtype in quant.QUANT_SCHEMES:
        installed |= {n for n in missing if ".mlp.experts." in n}
    lacking = sorted(set(missing) - installed) + sorted(f"{p}.weight" for p in missing_linears)
    if lacking:
        raise ValueError(f"the shadow shard lacks tensors: {lacking[:5]}")


def _install_quantized_experts(experts: MixtralExperts, build: _Build, layer: int) -> None:
    for which in ("gate_up", "down"):
        data, state = build.expert_q.pop((layer, which))
        experts.register_buffer(f"{which}_qdata", data)
        experts.register_buffer(f"{which}_qstate", state)
        setattr(experts, f"{which}_proj", nn.Parameter(torch.empty(0, device=build.device), requires_grad=False))
    experts.odmoe_scheme = build.dtype
