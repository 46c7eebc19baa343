"""Build the shadow's model from its shard, converting tensor by tensor as they are read.

The shadow runs a lossy copy of the whole model (``inference.shadow.quant``), and the whole model in
full precision is what no shadow box can hold: Mixtral-8x7B is 93 GB in bf16, 26 GB in nf4.
So the full-precision model never exists here. Each tensor is read from the verified shard
(plain reads, ``inference.modelio.tensorfile``), moved to the shadow's device, converted there (cast,
or quantized by the device's own kernels, which are then the ones that read the data) and the
original dropped; an expert's ``w1`` waits only for its ``w3`` (they are quantized fused, as
the model computes them). Peak host memory is the converted model plus a tensor or two.
The same conversion, run once by the shard build (``build_shards(shadow_dtypes=...)``),
writes a pre-converted shadow shard, which is then installed as it is read: the shadow box
downloads the converted size and converts nothing.

What each shadow dtype holds:

* ``fp32`` / ``bf16`` / ``fp16``: every tensor in that dtype, except the routers, which keep
  the checkpoint's (fp32 for an fp32 shadow): a forward pre-hook casts their input.
* ``int8`` / ``nf4``: attention projections, LM head and experts quantized (per expert, in
  stacked buffers read by ``quant.EXPERTS_IMPLEMENTATION``); embeddings, norms and routers in
  the checkpoint's dtype, which is also the compute dtype.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from inference.constants import NF4_BLOCKSIZE, SHADOW_DTYPES
from inference.modelio.checkpoint import parse_expert_key
from inference.modelio.model import (
    expert_dims,
    family_of,
    load_config,
    load_generation_config,
    rebuild_rotary,
    routers,
    skeleton,
)
from inference.modelio.shards import RECORDS_FORMAT, load_role_tensors, read_manifest, verify_shard
from inference.shadow import quant

if TYPE_CHECKING:
    from inference.modelio.families.base import Family

CAST_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert (*CAST_DTYPES, *quant.QUANT_SCHEMES) == SHADOW_DTYPES  # one list of names: inference.constants
EXPERT_WEIGHTS = ("gate_up", "down")  # [2I, H] (w1 over w3) and [H, I] (w2), as Transformers fuses them

_EXPERT_RECORD = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)\.(\d+)(?:\.(qdata|qstate))?")
_LINEAR_RECORD = re.compile(r"(.+)\.weight_(data|state)")


def check_dtype(dtype: str) -> None:
    if dtype not in SHADOW_DTYPES:
        raise ValueError(f"unsupported shadow dtype {dtype!r}; allowed: {', '.join(SHADOW_DTYPES)}")


def quantizable_linears(model: PreTrainedModel) -> set[str]:
    """Paths of the ``nn.Linear`` modules an int8/nf4 shadow quantizes: all but the routers (not Linears)
    and a tied LM head (it is the embedding, which stays in the checkpoint's dtype)."""
    tied = {name.removesuffix(".weight") for name in model.all_tied_weights_keys}
    return {name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name not in tied}


# What a checkpoint tensor is to the conversion (``_weights``).
_KEPT, _ROUTER, _LINEAR, _EXPERT = "kept", "router", "linear", "expert"
# The records of a quantized weight, by what it is: its data, then its state.
_QUANTIZED_RECORDS = {_LINEAR: (".weight_data", ".weight_state"), _EXPERT: (".qdata", ".qstate")}


def convert_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], config: PretrainedConfig, dtype: str, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors (release names, any float dtype) as records of the shadow in ``dtype``.

    One tensor at a time, converted on ``device``: nothing is kept but an expert's ``w1`` or
    ``w3`` until its partner arrives.
    """
    check_dtype(dtype)
    family = family_of(config)
    quantized = quantizable_linears(skeleton(config)) if dtype in quant.QUANT_SCHEMES else set()
    for name, weight, kind in _weights(tensors, family, quantized, device):
        kept = _kept_dtype(dtype, kind, weight)
        if kept is not None:
            yield name, weight.to(device, kept)
            continue
        q = quant.quantize_weight(weight.to(device), dtype)
        data, state = _QUANTIZED_RECORDS[kind]
        yield f"{name}{data}", q.data
        yield f"{name}{state}", q.state


def _weights(
    tensors: Iterable[tuple[str, torch.Tensor]], family: Family, quantized: set[str], device: torch.device
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Each weight the shadow holds, in the order the tensors come, with what it is to the conversion:
    a tensor kept (``_KEPT``, ``_ROUTER``) under its Transformers name; a quantized linear's weight
    (``_LINEAR``) under its module's path; an expert's fused ``gate_up`` ([2I, H], ``w1`` over ``w3``,
    on ``device`` once both came) or ``down`` ([H, I]) under its record's name (``_EXPERT``)."""
    pending: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        key = parse_expert_key(name)
        if key is None:
            hf = family.hf_name(name)
            path = hf.removesuffix(".weight")
            if hf.endswith(".weight") and path in quantized:
                yield path, tensor, _LINEAR
            else:
                yield hf, tensor, _ROUTER if family.is_router(name) else _KEPT
            continue
        parts = pending.setdefault((key.layer, key.expert), {})
        parts[key.proj] = tensor
        base = f"model.layers.{key.layer}.mlp.experts"
        if "w1" in parts and "w3" in parts:
            gate_up = torch.cat([parts.pop("w1").to(device), parts.pop("w3").to(device)])  # [2I, H]
            yield f"{base}.gate_up.{key.expert}", gate_up, _EXPERT
        if "w2" in parts:
            yield f"{base}.down.{key.expert}", parts.pop("w2"), _EXPERT  # [H, I]
        if not parts:
            del pending[(key.layer, key.expert)]
    if pending:
        (layer, expert), parts = next(iter(pending.items()))
        raise ValueError(f"expert {expert} of layer {layer} lacks {'w3' if 'w1' in parts else 'w1'}")


def _kept_dtype(dtype: str, kind: str, weight: torch.Tensor) -> torch.dtype | None:
    """The dtype a ``dtype`` shadow keeps ``weight`` in, or None where it quantizes it."""
    if kind in _QUANTIZED_RECORDS and dtype in quant.QUANT_SCHEMES:
        return None
    if not weight.is_floating_point() or dtype in quant.QUANT_SCHEMES:
        return weight.dtype  # quantized shadows keep what they don't quantize as it is
    if kind == _ROUTER and dtype != "fp32":
        return weight.dtype  # routers keep the checkpoint's precision: they decide the routing
    return CAST_DTYPES[dtype]


@dataclass
class _Build:
    """What has been installed so far, record by record."""

    dtype: str
    device: torch.device
    n_experts: int
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # Transformers name -> tensor
    linears: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # path -> data, state
    # Experts go straight into per-layer stacks [E, ...], so each expert's own tensor is freed
    # at once and its memory reused by the next one.
    stacks: dict[tuple[int, str, str], torch.Tensor] = field(default_factory=dict)  # (layer, which, part)
    filled: set[tuple[int, str, str, int]] = field(default_factory=set)
    record_bytes: int = 0
    largest_record_bytes: int = 0

    def take(self, name: str, tensor: torch.Tensor) -> None:
        self.record_bytes += tensor.nbytes
        self.largest_record_bytes = max(self.largest_record_bytes, tensor.nbytes)
        expert = _EXPERT_RECORD.fullmatch(name)
        linear = _LINEAR_RECORD.fullmatch(name)
        if expert is not None:
            layer, which, index, part = int(expert[1]), expert[2], int(expert[3]), expert[4] or "dense"
            stack = self.stacks.get((layer, which, part))
            if stack is None:
                shape = (self.n_experts, *tensor.shape)
                stack = torch.empty(shape, dtype=tensor.dtype, device=self.device)
                self.stacks[(layer, which, part)] = stack
            stack[index].copy_(tensor)
            self.filled.add((layer, which, part, index))
        elif linear is not None:
            self.linears.setdefault(linear[1], {})[linear[2]] = tensor.to(self.device)
        else:
            self.kept[name] = tensor.to(self.device)


def build_shadow_model(
    shard_dir: str | os.PathLike[str],
    dtype: str,
    device: torch.device,
    *,
    eager_experts: bool = False,
    verify: bool = True,
) -> tuple[PreTrainedModel, dict]:
    """The shadow's model in ``dtype`` on ``device``, from a shadow shard.

    The shard is either the checkpoint's tensors (converted here as they are read) or a
    shard the shard build already converted to ``dtype`` (``sharding.build_shards`` with
    ``shadow_dtypes``; its manifest says which), installed as it is. ``eager_experts`` selects
    Transformers' eager experts loop for cast dtypes (the grouped GEMM refuses some shapes;
    quantized experts always use their own loop). Returns the model and a report: ``dtype``,
    ``pre_converted``, ``source_bytes`` (read from the shard), ``bytes`` (the model),
    ``experts_bytes`` and ``largest_tensor_bytes``.
    """
    check_dtype(dtype)
    manifest = verify_shard(shard_dir, expect_role="shadow") if verify else read_manifest(shard_dir)
    stored = manifest.get("shadow_dtype")
    if stored is not None and stored != dtype:
        raise ValueError(f"{shard_dir} holds a shadow converted to {stored}, but {dtype} was asked for")
    if stored is not None and manifest.get("records") != RECORDS_FORMAT:
        raise ValueError(
            f"{shard_dir} was converted as {manifest.get('records')!r}, this version reads {RECORDS_FORMAT!r}: "
            "build the shards again"
        )
    config = load_config(shard_dir)
    model = skeleton(config)
    check = _RecordCheck(model, dtype)
    build = _Build(dtype, device, expert_dims(config)[0])
    source_bytes = 0
    largest = 0

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal source_bytes, largest
        for name, tensor in load_role_tensors(shard_dir, verify=False):
            source_bytes += tensor.nbytes
            largest = max(largest, tensor.nbytes)
            yield name, tensor

    records = read() if stored is not None else convert_tensors(read(), config, dtype, device)
    for name, tensor in records:
        check(name, tensor)
        build.take(name, tensor)
    _install(model, build)
    rebuild_rotary(model, device)
    if dtype in quant.QUANT_SCHEMES:
        quant.register_experts_implementation()
        quant.detach_config_(model)
        model.config._experts_implementation = quant.EXPERTS_IMPLEMENTATION
    else:
        if eager_experts:
            model.set_experts_implementation("eager")
        for router in routers(model):
            router.register_forward_pre_hook(quant.router_input_to_weight_dtype)
    generation_config = load_generation_config(shard_dir)
    if generation_config is not None:
        model.generation_config = generation_config
    model.eval()
    model.requires_grad_(False)
    model.odmoe_shadow_dtype = dtype
    report = {
        "dtype": dtype,
        "pre_converted": stored is not None,
        "source_bytes": source_bytes,
        "bytes": quant.module_bytes(model),
        "experts_bytes": quant.experts_bytes(model),
        "largest_tensor_bytes": largest,
    }
    return model, report


class _RecordCheck:
    """Refuse a record whose name, shape or dtype is not what the model and the shadow dtype need.

    A pre-converted shard is sha256-checked against its manifest, which proves it arrived as
    built, not that it was built right; a quantized record of the wrong size would have CUDA
    kernels read past its end.
    """

    def __init__(self, model: PreTrainedModel, dtype: str) -> None:
        config = model.config
        self.dtype = dtype
        self.experts, inter = expert_dims(config)
        self.layers, hidden = config.num_hidden_layers, config.hidden_size
        self.expert_shapes = {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
        self.linears = {
            path: (m.out_features, m.in_features) for path, m in model.named_modules() if isinstance(m, nn.Linear)
        }
        self.params = {name: tuple(p.shape) for name, p in model.named_parameters()}

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        expert = _EXPERT_RECORD.fullmatch(name)
        linear = _LINEAR_RECORD.fullmatch(name)
        if expert is not None:
            layer, index = int(expert[1]), int(expert[3])
            if not (layer < self.layers and index < self.experts):
                raise ValueError(f"shadow record {name!r}: no such layer or expert in this model")
            want = self._want(self.expert_shapes[expert[2]], expert[4])
        elif linear is not None and linear[1] in self.linears and self.dtype in quant.QUANT_SCHEMES:
            want = self._want(self.linears[linear[1]], "qdata" if linear[2] == "data" else "qstate")
        elif name in self.params:
            want = (self.params[name], None)
        else:
            raise ValueError(f"shadow record {name!r} is not part of this model")
        shape, dtype = want
        if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype):
            raise ValueError(
                f"shadow record {name!r} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype or ''} {shape}"
            )

    def _want(self, shape: tuple[int, int], part: str | None) -> tuple[tuple[int, ...], torch.dtype | None]:
        out, inn = shape
        n = out * inn
        if part is None:  # a dense (cast) expert
            if self.dtype in quant.QUANT_SCHEMES:
                raise ValueError(f"a dense expert record in a {self.dtype} shadow")
            return shape, CAST_DTYPES[self.dtype]
        if self.dtype == "nf4":
            blocks = -(-n // NF4_BLOCKSIZE)
            return (((n + 1) // 2, 1), torch.uint8) if part == "qdata" else ((blocks,), torch.float32)
        if self.dtype == "int8":
            return (shape, torch.int8) if part == "qdata" else ((out,), torch.float32)
        raise ValueError(f"a quantized record in a {self.dtype} shadow")


def _install(model: PreTrainedModel, build: _Build) -> None:
    """Put the records into the meta-built model; refuse a shard that lacks any."""
    quantized = build.dtype in quant.QUANT_SCHEMES
    expected_linears = quantizable_linears(model) if quantized else set()
    if build.linears.keys() != expected_linears:
        missing = sorted(expected_linears - build.linears.keys()) or sorted(build.linears.keys() - expected_linears)
        raise ValueError(f"the shadow shard's quantized linears do not match the model: {missing[:5]}")
    parts = ("qdata", "qstate") if quantized else ("dense",)
    for layer in range(model.config.num_hidden_layers):
        for which in EXPERT_WEIGHTS:
            for part in parts:
                absent = [e for e in range(build.n_experts) if (layer, which, part, e) not in build.filled]
                if absent:
                    raise ValueError(f"the shadow shard lacks expert {absent[0]} of layer {layer} ({which})")
    state = dict(build.kept)
    for path, buffers in build.linears.items():
        module = model.get_submodule(path)
        shape = torch.Size((module.out_features, module.in_features))
        qweight = quant.QuantizedWeight(build.dtype, buffers["data"], buffers["state"], shape)
        parent_path, _, child = path.rpartition(".")
        linear = quant.QuantizedLinear(qweight, state.pop(f"{path}.bias", None))
        setattr(model.get_submodule(parent_path), child, linear)
    family = family_of(model.config)
    for layer, decoder in enumerate(model.model.layers):
        experts = family.experts(decoder)
        for which in EXPERT_WEIGHTS:
            if quantized:
                experts.register_buffer(f"{which}_qdata", build.stacks.pop((layer, which, "qdata")))
                experts.register_buffer(f"{which}_qstate", build.stacks.pop((layer, which, "qstate")))
                empty = nn.Parameter(torch.empty(0, device=build.device), requires_grad=False)
                setattr(experts, f"{which}_proj", empty)  # the dense weights never existed here
            else:
                state[f"{family.experts_path(layer)}.{which}_proj"] = build.stacks.pop((layer, which, "dense"))
        if quantized:
            experts.odmoe_scheme = build.dtype
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"unexpected tensors in the shadow shard: {sorted(unexpected)[:5]}")
    # Quantized modules hold the buffers installed above, not loaded from ``state``.
    installed = {n for n in missing if n.rpartition(".")[0] in build.linears}
    if quantized:
        installed |= {n for n in missing if n.rpartition(".")[0].endswith(".experts")}
    tied = set(model.all_tied_weights_keys)  # a tied LM head is the embedding: no record of its own
    lacking = sorted(set(missing) - installed - tied)
    if lacking:
        raise ValueError(f"the shadow shard lacks tensors: {lacking[:5]}")
    if tied:
        model.tie_weights(recompute_mapping=False)
