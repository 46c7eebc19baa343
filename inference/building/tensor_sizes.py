"""A checkpoint's tensors and their bytes, as each role keeps them: in the checkpoint's dtype, in the
shadow's (cast, or int8/nf4 quantized as ``inference.shadow.quant`` does), or coded in a worker's
shard (``expert_codec``). Read from a checkpoint's headers (``checkpoint_tensors``) or computed from
a config alone (``config_tensors``, ``family_tensors``), so a plan needs no download. The memory
planner (``memory``) adds them up per role.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from inference.constants import (
    EXPERT_CODECS,
    NF4_BLOCKSIZE,
    SHADOW_DTYPES,
)
from inference.modelio.checkpoint import Checkpoint, parse_expert_key
from inference.modelio.families import FAMILIES, family_for, is_router_name
from inference.modelio.shards import ShardSet, read_manifest, stored_tensors
from inference.sim.model_sizes import ModelSizes

QUANT_SCALE_BYTES = 4  # int8: one fp32 scale per output row; nf4: one fp32 absmax per block

# Bytes per element of the dtypes a checkpoint is released in (config ``dtype`` names).
CHECKPOINT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CAST_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# The nn.Linear weights a quantized shadow quantizes besides the experts and the LM head.
_ATTENTION_LINEARS = tuple(f".self_attn.{p}_proj.weight" for p in "qkvo")
_SHARED_LINEARS = (*(f".shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")), ".shared_expert_gate.weight")
_LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class TensorSize:
    """One tensor of a checkpoint: its name, shape and bytes on disk; ``stored``: its bytes in a worker
    shard that stores it coded (``expert_codec``), None as it is (``stored_nbytes`` is then ``nbytes``)."""

    name: str
    shape: tuple[int, ...]
    nbytes: int
    stored: int | None = None

    @property
    def stored_nbytes(self) -> int:
        return self.nbytes if self.stored is None else self.stored

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def checkpoint_tensors(ckpt: Checkpoint) -> list[TensorSize]:
    """Every tensor of ``ckpt`` with its real bytes (from the safetensors headers)."""
    return [TensorSize(key, ckpt.shape(key), ckpt.nbytes(key)) for key in ckpt]


def with_stored_experts(
    tensors: Sequence[TensorSize], shard_root: str | os.PathLike[str], expert_codec: str = "none"
) -> list[TensorSize]:
    """``tensors`` with each expert's bytes as the worker shards built at ``shard_root`` store it: a set
    built with an ``expert_codec`` holds fewer, and a worker's RAM, disk and fit check count those
    (its manifests' ``stored``; a tensor they do not list is stored as it is). An ``expert_codec``
    other than "none" that is not the set's is refused."""
    shard_set = ShardSet.load(shard_root)
    if expert_codec != "none" and expert_codec != shard_set.expert_codec:
        raise ValueError(
            f"the shard set at {shard_root} stores its experts with {shard_set.expert_codec!r}, not {expert_codec!r}"
        )
    stored: dict[str, int] = {}
    for worker in range(shard_set.placement.n_workers):
        entries = stored_tensors(read_manifest(shard_set.worker(worker)), f"shard {shard_set.worker(worker)}")
        stored |= {name: entry.stored_bytes for name, entry in entries.items()}
    return [replace(t, stored=stored[t.name]) if t.name in stored else t for t in tensors]


def with_coded_bound(ckpt: Checkpoint, tensors: Sequence[TensorSize], expert_codec: str) -> list[TensorSize]:
    """``tensors`` with each expert tensor ``expert_codec`` would code at the most its coded form can take,
    whatever the weights (``inference.modelio.expert_codec.stored_bound``): what a worker's RAM, disk and
    fit check count before a set with that code is built. The shard build codes every expert tensor of a
    dtype the code takes (``inference.building.sharding``); "none" leaves ``tensors`` as they are.

    Not the raw size: a code that saves nothing still costs its frame, so a coded tensor can be up to a
    byte per 256 of its exponent plane and a frame header larger than its raw one; and a coded worker
    holds its decoded experts in flight besides (``plan_memory``), which the raw count leaves out.
    """
    if expert_codec not in EXPERT_CODECS:
        raise ValueError(f"expert_codec must be one of {', '.join(EXPERT_CODECS)}, got {expert_codec!r}")
    if expert_codec == "none":
        return list(tensors)
    from inference.modelio.expert_codec import stored_bound, supports

    bounded = []
    for tensor in tensors:
        dtype = ckpt.dtype(tensor.name) if parse_expert_key(tensor.name) is not None else ""
        bounded.append(replace(tensor, stored=stored_bound(tensor.nbytes, dtype)) if supports(dtype) else tensor)
    return bounded


def config_tensors(sizes: ModelSizes, dtype: str, *, tied_embeddings: bool = False) -> list[TensorSize]:
    """The tensors a Mixtral checkpoint of bare ``sizes`` holds, in ``dtype`` (a config ``dtype`` name).

    A config of any family gives its own tensors: ``family_tensors``.
    """
    shape = {"layers": sizes.layers, "hidden": sizes.hidden, "intermediate": sizes.intermediate}
    shape |= {"experts": sizes.experts, "top_k": sizes.top_k, "heads": sizes.query_heads, "kv_heads": sizes.kv_heads}
    shape |= {"head_dim": sizes.head_dim, "vocab": sizes.vocab, "shared_intermediate": 0}
    config = FAMILIES["mixtral"].release_config(shape) | {"tie_word_embeddings": tied_embeddings}
    return family_tensors(config, dtype)


def family_tensors(config: Mapping[str, Any], dtype: str) -> list[TensorSize]:
    """The tensors a checkpoint of ``config`` shows (its family's, experts in the shard layout), in ``dtype``."""
    per = _dtype_bytes(dtype)
    shapes = family_for(config).shard_shapes(config)
    return [TensorSize(name, shape, math.prod(shape) * per) for name, shape in shapes]


def _dtype_bytes(dtype: str) -> int:
    try:
        return CHECKPOINT_DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(CHECKPOINT_DTYPE_BYTES)}, got {dtype!r}") from None


def shadow_tensor_bytes(tensor: TensorSize, shadow_dtype: str) -> int:
    """What ``tensor`` costs in the shadow's copy of the model (an expert's w1/w3 as half of their fused pair)."""
    is_router = is_router_name(tensor.name)
    if shadow_dtype in CAST_BYTES:
        if is_router and shadow_dtype != "fp32":
            return tensor.nbytes  # routers keep the checkpoint dtype, so routing matches main's
        return tensor.numel * CAST_BYTES[shadow_dtype]
    if not _is_linear(tensor):
        return tensor.nbytes  # embeddings, norms, routers stay in the checkpoint dtype
    out = tensor.shape[0]
    if shadow_dtype == "int8":
        return tensor.numel + out * QUANT_SCALE_BYTES
    if shadow_dtype == "nf4":
        return _nf4_bytes(tensor.numel)
    raise ValueError(f"shadow dtype must be one of {', '.join(SHADOW_DTYPES)}, got {shadow_dtype!r}")


def _is_linear(tensor: TensorSize) -> bool:
    name = tensor.name
    return len(tensor.shape) == 2 and (
        name == _LM_HEAD
        or name.endswith(_ATTENTION_LINEARS)
        or name.endswith(_SHARED_LINEARS)
        or parse_expert_key(name) is not None
    )


def _nf4_bytes(numel: int) -> int:
    return math.ceil(numel / 2) + math.ceil(numel / NF4_BLOCKSIZE) * QUANT_SCALE_BYTES


def shadow_weight_bytes(tensors: Iterable[TensorSize], shadow_dtype: str) -> int:
    """The shadow's whole model in ``shadow_dtype``, in bytes."""
    if shadow_dtype not in SHADOW_DTYPES:
        raise ValueError(f"shadow dtype must be one of {', '.join(SHADOW_DTYPES)}, got {shadow_dtype!r}")
    total = 0
    fused: dict[tuple[int, int], int] = {}  # nf4: (layer, expert) -> elements of w1 + w3
    for tensor in tensors:
        key = parse_expert_key(tensor.name)
        if shadow_dtype == "nf4" and key is not None and key.proj in ("w1", "w3"):
            fused[(key.layer, key.expert)] = fused.get((key.layer, key.expert), 0) + tensor.numel
        else:
            total += shadow_tensor_bytes(tensor, shadow_dtype)
    return total + sum(_nf4_bytes(n) for n in fused.values())
