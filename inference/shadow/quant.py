"""Shrink the shadow's copy of the model: the quantized weight, linear and experts it runs on.

The shadow runs a whole model of the family (``MixtralForCausalLM``...) only to guess which
experts main will pick, so it can afford a lossy copy. This module holds the pieces:
``quantize_weight`` (in bounded pieces,
on the weight's own device), ``QuantizedLinear``, the quantized experts' forward, and the router
hook. The shadow role builds its model with them tensor by tensor, never holding the
full-precision model (``inference.shadow.shadow_model``). ``quantize_shadow_`` applies the same
conversion to a model already loaded in fp32 (experiments, and the tests that check the shadow
built tensor by tensor against it), turning it into one of ``SHADOW_DTYPES``:

* ``fp32``: left as is.
* ``bf16`` / ``fp16``: every parameter is cast, except the routers (``keep_routers_fp32``), whose
  input is cast up to their weight's dtype by a forward pre-hook; buffers (the rotary
  ``inv_freq``) stay fp32, as with ``from_pretrained(dtype=...)``.
* ``int8`` / ``nf4``: every ``nn.Linear`` (attention projections, LM head) becomes a
  ``QuantizedLinear``, and each experts module keeps its fused weights quantized per expert
  in stacked buffers (the fp32 parameters are replaced by empty ones, so the memory goes). The
  experts' forward is dispatched, through transformers' experts interface, to
  ``EXPERTS_IMPLEMENTATION``, which dequantizes only the experts the current tokens use.
  Embeddings, norms and routers stay fp32, and so does the compute.

``bitsandbytes.BitsAndBytesConfig`` would leave the fused 3-D expert tensors of transformers 5
untouched, hence the hand-rolled scheme: int8 is per-output-row absmax symmetric, nf4 is
bitsandbytes' ``quantize_4bit`` with blocks of ``NF4_BLOCKSIZE``.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

from inference.constants import NF4_BLOCKSIZE, SHADOW_DTYPES
from inference.modelio.model import experts_modules, routers

QUANT_SCHEMES = ("int8", "nf4")
EXPERTS_IMPLEMENTATION = "odmoe_quantized"


@functools.cache
def _bnb():
    """bitsandbytes, imported on first nf4 use: int8 and the cast dtypes run without it."""
    # Its CPU backend tries to fetch an optional kernel from a hub at import and warns when it
    # cannot; we never use that kernel, so the warning is only noise.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes
        import bitsandbytes.functional
    except ImportError as exc:
        raise RuntimeError(f"the nf4 shadow needs bitsandbytes, which does not import here: {exc}") from exc
    return bitsandbytes


_CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_EXPERT_TENSORS = ("gate_up", "down")


@dataclass
class QuantizedWeight:
    """A 2-D weight in quantized form.

    int8: ``data`` int8 [out, in], ``state`` fp32 per-row scale [out] (weight ≈ data * scale).
    nf4: ``data`` packed uint8 [out*in/2, 1], ``state`` fp32 per-block absmax [ceil(out*in/64)].
    """

    scheme: str
    data: torch.Tensor
    state: torch.Tensor
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.state.nbytes


def _check_scheme(scheme: str) -> None:
    if scheme not in QUANT_SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; allowed: {', '.join(QUANT_SCHEMES)}")


# Quantize at most this many elements at a time, so the fp32 temporaries of one call stay
# bounded (~64 MB) whatever the weight's size: a shadow quantizing as it reads must not hold
# several fp32 copies of an LM head. A multiple of NF4_BLOCKSIZE (and even), so nf4 blocks and
# packed nibble pairs never straddle two pieces and the result equals one whole-tensor call.
QUANT_CHUNK_ELEMENTS = 1 << 24


def quantize_weight(weight: torch.Tensor, scheme: str) -> QuantizedWeight:
    """Quantize a 2-D weight [out, in] of any float dtype with ``scheme`` ("int8" or "nf4").

    The work happens on ``weight``'s device (CUDA kernels for data CUDA kernels will read).
    """
    _check_scheme(scheme)
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.detach()
    if scheme == "int8":
        rows_per_piece = max(1, QUANT_CHUNK_ELEMENTS // max(1, w.shape[1]))
        pieces = [_int8_rows(w[i : i + rows_per_piece]) for i in range(0, w.shape[0], rows_per_piece)]
        data = torch.cat([d for d, _ in pieces]) if len(pieces) > 1 else pieces[0][0]
        scale = torch.cat([s for _, s in pieces]) if len(pieces) > 1 else pieces[0][1]
        return QuantizedWeight("int8", data, scale, w.shape)
    flat = w.reshape(-1)
    pieces = [
        _bnb().functional.quantize_4bit(
            flat[i : i + QUANT_CHUNK_ELEMENTS].float(), blocksize=NF4_BLOCKSIZE, quant_type="nf4"
        )
        for i in range(0, flat.numel(), QUANT_CHUNK_ELEMENTS)
    ]
    data = torch.cat([d.reshape(-1, 1) for d, _ in pieces]) if len(pieces) > 1 else pieces[0][0]
    absmax = torch.cat([q.absmax.float() for _, q in pieces]) if len(pieces) > 1 else pieces[0][1].absmax.float()
    return QuantizedWeight("nf4", data, absmax, w.shape)


def _int8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax symmetric int8 of ``rows`` [R, in]: (data int8 [R, in], scale fp32 [R])."""
    w = rows.to(torch.float32, copy=True)  # a copy: the in-place ops below must not touch the caller's
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    w.div_(scale[:, None]).round_().clamp_(-127, 127)
    return w.to(torch.int8), scale


@functools.cache
def _nf4_code(device: torch.device) -> torch.Tensor:
    return _bnb().functional.get_4bit_type("nf4", device=device)


def _nf4_quant_state(q: QuantizedWeight):
    return _bnb().functional.QuantState(
        absmax=q.state.float(),
        shape=q.shape,
        code=_nf4_code(q.data.device),
        blocksize=NF4_BLOCKSIZE,
        quant_type="nf4",
        dtype=torch.float32,
    )


# Dequantize at most this many elements at a time (a multiple of NF4_BLOCKSIZE, so an nf4 piece
# holds whole blocks and whole packed bytes). Each element passes through an int64 code index
# and fp32 values, about 20 bytes of temporaries where the result is 2: a CPU shadow that
# dequantized Mixtral-8x7B's LM head (131M elements) in one pass grew by 2.1 GB for it, above
# a 2.3 GB model. In pieces the temporaries are about 20 MB, and the result is the same.
DEQUANT_CHUNK_ELEMENTS = 1 << 20


def _dequantize_nf4_torch(q: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """nf4 dequantization in plain torch (flat blocks of ``NF4_BLOCKSIZE``, high nibble first).

    bitsandbytes' CPU kernel (0.50) assumes the blocks tile each row, which is wrong when the
    last dimension is not a multiple of the block size; this matches its quantizer and CUDA.
    Piece by piece into the result in ``dtype``: each value is the fp32 product rounded once
    to ``dtype``, as a whole-tensor pass would give, with bounded temporaries.
    """
    n = q.shape.numel()
    packed = q.data.reshape(-1)
    absmax = q.state.float()
    code = _nf4_code(q.data.device)
    out = torch.empty(n, dtype=dtype, device=q.data.device)
    for start in range(0, n, DEQUANT_CHUNK_ELEMENTS):
        size = min(DEQUANT_CHUNK_ELEMENTS, n - start)
        piece = packed[start // 2 : (start + size + 1) // 2]
        codes = torch.stack((piece >> 4, piece & 0x0F), dim=-1).reshape(-1)[:size].long()
        values = nn.functional.pad(code[codes], (0, -size % NF4_BLOCKSIZE)).view(-1, NF4_BLOCKSIZE)
        scales = absmax[start // NF4_BLOCKSIZE : start // NF4_BLOCKSIZE + values.shape[0], None]
        out[start : start + size] = (values * scales).reshape(-1)[:size]
    return out.reshape(q.shape)


def dequantize_weight(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``q`` stands for, as a dense [out, in] tensor of ``dtype``."""
    _check_scheme(q.scheme)
    if q.scheme == "int8":
        out = torch.empty(q.shape, dtype=dtype, device=q.data.device)
        rows = max(1, DEQUANT_CHUNK_ELEMENTS // max(1, q.shape[1]))
        scale = q.state.float()
        for i in range(0, q.shape[0], rows):
            out[i : i + rows] = q.data[i : i + rows].float() * scale[i : i + rows, None]
        return out
    if q.data.is_cuda:
        return _bnb().functional.dequantize_4bit(q.data, _nf4_quant_state(q)).to(dtype)
    return _dequantize_nf4_torch(q, dtype)


def _use_bnb_kernel(x: torch.Tensor, q: QuantizedWeight) -> bool:
    """Whether to run ``q`` through bitsandbytes' fused 4-bit matmul (CUDA only; elsewhere we dequantize)."""
    return q.scheme == "nf4" and x.is_cuda


def quantized_linear(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with ``W`` given quantized; computes in ``x.dtype``."""
    if _use_bnb_kernel(x, q):
        out = _bnb().matmul_4bit(x, q.data.t(), quant_state=_nf4_quant_state(q)).to(x.dtype)
        return out if bias is None else out + bias.to(x.dtype)
    weight = dequantize_weight(q, x.dtype)
    return nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is stored quantized (buffers, so ``.to(device)`` moves them)."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.scheme = qweight.scheme
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("weight_data", qweight.data)
        self.register_buffer("weight_state", qweight.state)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str) -> QuantizedLinear:
        return cls(quantize_weight(linear.weight, scheme), linear.bias)

    @property
    def qweight(self) -> QuantizedWeight:
        shape = torch.Size((self.out_features, self.in_features))
        return QuantizedWeight(self.scheme, self.weight_data, self.weight_state, shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.qweight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


# --- experts -----------------------------------------------------------------------------------


def _expert_shapes(experts: nn.Module) -> dict[str, torch.Size]:
    return {
        "gate_up": torch.Size((2 * experts.intermediate_dim, experts.hidden_dim)),
        "down": torch.Size((experts.hidden_dim, experts.intermediate_dim)),
    }


def is_quantized_experts(experts: nn.Module) -> bool:
    return getattr(experts, "odmoe_scheme", None) in QUANT_SCHEMES


def expert_qweight(experts: nn.Module, name: str, expert: int) -> QuantizedWeight:
    """Expert ``expert``'s quantized ``name`` ("gate_up" [2I, H] or "down" [H, I]) weight."""
    data = getattr(experts, f"{name}_qdata")[expert]
    state = getattr(experts, f"{name}_qstate")[expert]
    return QuantizedWeight(experts.odmoe_scheme, data, state, _expert_shapes(experts)[name])


def _empty_parameter(like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(0, dtype=like.dtype, device=like.device), requires_grad=False)


def quantize_experts_(experts: nn.Module, scheme: str) -> None:
    """Quantize ``experts``' fused weights per expert into stacked buffers and free the originals."""
    _check_scheme(scheme)
    for name in _EXPERT_TENSORS:
        fused = getattr(experts, f"{name}_proj")
        per_expert = [quantize_weight(fused[e], scheme) for e in range(experts.num_experts)]
        experts.register_buffer(f"{name}_qdata", torch.stack([q.data for q in per_expert]))
        experts.register_buffer(f"{name}_qstate", torch.stack([q.state for q in per_expert]))
        setattr(experts, f"{name}_proj", _empty_parameter(fused))
        del fused, per_expert
    experts.odmoe_scheme = scheme


def _expert_linear(experts: nn.Module, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
    if is_quantized_experts(experts):
        return quantized_linear(x, expert_qweight(experts, name, expert))
    return nn.functional.linear(x, getattr(experts, f"{name}_proj")[expert])


def quantized_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts' eager forward (the same for every family) on quantized storage: dequantizes only the experts hit.

    Falls back to the dense parameters for experts modules that were not quantized, so a model
    that happens to share the implementation name still computes correctly.
    """
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()

    for expert_idx in expert_hit:
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = _expert_linear(self, "gate_up", expert_idx, current_state).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = _expert_linear(self, "down", expert_idx, current_hidden_states)
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

    return final_hidden_states


def register_experts_implementation() -> None:
    """Make ``EXPERTS_IMPLEMENTATION`` a valid ``config._experts_implementation`` (idempotent).

    ``ExpertsInterface.register`` adds the name to the class-wide mapping, so every interface
    instance (``ALL_EXPERTS_FUNCTIONS`` included) accepts it; models whose config names another
    implementation are not affected.
    """
    if ALL_EXPERTS_FUNCTIONS.get(EXPERTS_IMPLEMENTATION) is not quantized_experts_forward:
        ExpertsInterface.register(EXPERTS_IMPLEMENTATION, quantized_experts_forward)


# --- whole model -------------------------------------------------------------------------------


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors)


def module_bytes(module: nn.Module) -> int:
    return _tensor_bytes(chain(module.parameters(), module.buffers()))


def experts_bytes(model: nn.Module) -> int:
    """Bytes held by all experts modules of ``model`` (parameters and buffers)."""
    return sum(module_bytes(m) for m in experts_modules(model))


def _routers(model: nn.Module) -> list[nn.Module]:
    return list(routers(model))


def router_input_to_weight_dtype(router: nn.Module, args: tuple) -> tuple:
    return (args[0].to(router.weight.dtype), *args[1:])


def _cast_parameters_(model: nn.Module, dtype: torch.dtype, keep_ids: set[int]) -> None:
    for param in model.parameters():
        if param.is_floating_point() and id(param) not in keep_ids:
            param.data = param.data.to(dtype)


def _cast_model_(model: nn.Module, dtype: torch.dtype, keep_routers_fp32: bool) -> None:
    routers = _routers(model)
    keep = {id(p) for r in routers for p in r.parameters()} if keep_routers_fp32 else set()
    _cast_parameters_(model, dtype, keep)
    for router in routers:
        router.register_forward_pre_hook(router_input_to_weight_dtype)


def _replace_linears_(model: nn.Module, scheme: str) -> None:
    router_ids = {id(m) for r in _routers(model) for m in r.modules()}
    targets = [
        (parent, child_name, child)
        for parent in model.modules()
        if id(parent) not in router_ids
        for child_name, child in parent.named_children()
        if isinstance(child, nn.Linear) and id(child) not in router_ids
    ]
    for parent, child_name, linear in targets:
        setattr(parent, child_name, QuantizedLinear.from_linear(linear, scheme))


def detach_config_(model: nn.Module) -> None:
    """Give ``model`` (and its submodules) a private copy of its config.

    The experts implementation is read from the config object, which models built from one
    config share; a private copy keeps our setting from leaking into such siblings.
    """
    old = model.config
    new = copy.deepcopy(old)
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new


def _quantize_model_(model: nn.Module, scheme: str) -> None:
    _replace_linears_(model, scheme)
    for module in experts_modules(model):
        quantize_experts_(module, scheme)
    register_experts_implementation()
    detach_config_(model)
    model.config._experts_implementation = EXPERTS_IMPLEMENTATION


def _check_fp32(model: nn.Module) -> None:
    bad = {p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32}
    if bad or getattr(model, "odmoe_shadow_dtype", "fp32") != "fp32":
        raise ValueError(f"quantize_shadow_ expects an unconverted fp32 model; found {bad or 'converted'}")


def quantize_shadow_(model: nn.Module, dtype: str, *, keep_routers_fp32: bool = True) -> dict:
    """Convert a loaded fp32 model (``MixtralForCausalLM``...) to ``dtype`` in place; return a small report.

    ``keep_routers_fp32`` matters for bf16/fp16 only: with int8/nf4 the routers always stay fp32.
    The report holds ``dtype``, ``bytes_before``/``bytes_after`` (all parameters and buffers) and
    ``experts_bytes_before``/``experts_bytes_after``.
    """
    if dtype not in SHADOW_DTYPES:
        raise ValueError(f"unsupported shadow dtype {dtype!r}; allowed: {', '.join(SHADOW_DTYPES)}")
    _check_fp32(model)
    bytes_before, experts_before = module_bytes(model), experts_bytes(model)
    if dtype in _CAST_DTYPES:
        _cast_model_(model, _CAST_DTYPES[dtype], keep_routers_fp32)
    elif dtype in QUANT_SCHEMES:
        _quantize_model_(model, dtype)
    model.odmoe_shadow_dtype = dtype
    return {
        "dtype": dtype,
        "bytes_before": bytes_before,
        "bytes_after": module_bytes(model),
        "experts_bytes_before": experts_before,
        "experts_bytes_after": experts_bytes(model),
    }
