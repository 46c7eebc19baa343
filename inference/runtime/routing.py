"""Split a layer's routed rows per expert, and sum the experts' answers back, bit-exactly.

Transformers computes an MoE layer (any family: they share one experts seam) in one of two
ways, and each sums the experts' weighted outputs in its own order: *grouped* (its default:
(token, expert) pairs sorted by expert, one GEMM per expert, then a sum over the top-k slots)
and *eager* (a loop over the hit experts in ascending order, each ``index_add_``-ed into zeros). Floating-point
sums depend on order, so main mirrors the reference's way: the same rows per expert, in
the same order, and the same summation. Workers compute each expert's rows with the same
operations, so the layer output is the reference's to the last bit.

Shape legend: ``T`` tokens, ``K`` top-k, ``H`` hidden, ``E`` experts, ``S = T*K`` pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference.constants import EXPERTS_ARITHMETICS as ARITHMETICS


@dataclass
class RoutedRows:
    """Per expert (ascending), the hidden rows routed to it and their routing weights."""

    experts: list[int]
    rows: dict[int, torch.Tensor]  # expert -> [M, H]
    weights: dict[int, torch.Tensor]  # expert -> [M]
    num_tokens: int
    top_k: int
    perm: torch.Tensor | None = None  # grouped: the sort permutation of the S pairs
    token_index: dict[int, torch.Tensor] | None = None  # eager: expert -> token of each row
    slots: list[int] | None = None  # one token (a decode step): the expert of each top-k slot

    def count(self, expert: int) -> int:
        return self.rows[expert].shape[0]


def split_grouped(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> RoutedRows:
    slots = _single_token_slots(hidden, top_k_index)
    if slots is not None:
        return _split_one_token(hidden, top_k_weights, slots, grouped=True)
    num_tokens, top_k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)  # [S]
    sorted_ids, perm = torch.sort(expert_ids)
    rows = hidden[perm // top_k]  # [S, H]
    weights = top_k_weights.reshape(-1)[perm]  # [S]
    experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    out = RoutedRows([], {}, {}, num_tokens, top_k, perm=perm)
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
        out.experts.append(expert)
        out.rows[expert] = rows[start : start + count]
        out.weights[expert] = weights[start : start + count]
        start += count
    return out


def split_eager(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> RoutedRows:
    slots = _single_token_slots(hidden, top_k_index)
    if slots is not None:
        return _split_one_token(hidden, top_k_weights, slots, grouped=False)
    num_tokens, top_k = top_k_index.shape
    out = RoutedRows([], {}, {}, num_tokens, top_k, token_index={})
    for expert in torch.unique(top_k_index).tolist():  # ascending
        # [K, T] mask -> rows in (slot, token) order, as the eager reference gathers them
        top_k_pos, token_idx = torch.where((top_k_index == expert).T)
        out.experts.append(expert)
        out.rows[expert] = hidden[token_idx]
        out.weights[expert] = top_k_weights[token_idx, top_k_pos]
        out.token_index[expert] = token_idx  # type: ignore[index]
    return out


def _single_token_slots(hidden: torch.Tensor, top_k_index: torch.Tensor) -> list[int] | None:
    """The expert of each top-k slot when a decode step routes one token to distinct experts.

    That is every decode step of one sequence, and there the general split is a dozen small
    tensor ops for what a Python list says as well: each expert gets the one row, once.
    """
    if top_k_index.shape[0] != 1 or not hidden.is_contiguous():
        return None
    slots = top_k_index.tolist()[0]
    return slots if len(set(slots)) == len(slots) else None


def _split_one_token(
    hidden: torch.Tensor, top_k_weights: torch.Tensor, slots: list[int], *, grouped: bool
) -> RoutedRows:
    """The split of one token: the same rows and weights the general paths give, without their ops.

    ``hidden`` [1, H] is every expert's only row (rows are only read, so it is shared, not copied).
    """
    weights = top_k_weights.unbind(1)  # K tensors [1]: each slot's weight
    out = RoutedRows(sorted(slots), {}, {}, 1, len(slots), slots=slots)
    if not grouped:
        out.token_index = {}
    for expert in out.experts:
        out.rows[expert] = hidden
        out.weights[expert] = weights[slots.index(expert)]
        if out.token_index is not None:
            out.token_index[expert] = _zero_index(hidden.device)
    return out


_ZERO_INDEX: dict[torch.device, torch.Tensor] = {}


def _zero_index(device: torch.device) -> torch.Tensor:
    """A shared ``tensor([0])`` on ``device``: the token index of every row of a one-token split."""
    index = _ZERO_INDEX.get(device)
    if index is None:
        index = _ZERO_INDEX[device] = torch.zeros(1, dtype=torch.long, device=device)
    return index


def combine_grouped(routed: RoutedRows, outputs: dict[int, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if routed.slots is not None:
        # One token: its outputs in slot order are what the inverse permutation below gives.
        in_slot_order = torch.cat([outputs[e] for e in routed.slots])  # [K, H]
        final = in_slot_order.view(1, routed.top_k, -1).sum(dim=1)  # [1, H]
        return final if final.dtype == dtype else final.to(dtype)
    assert routed.perm is not None
    out_sorted = torch.cat([outputs[e] for e in routed.experts])  # [S, H] in sorted order
    inv_perm = torch.empty_like(routed.perm)
    inv_perm[routed.perm] = torch.arange(routed.perm.numel(), device=routed.perm.device)
    return out_sorted[inv_perm].view(routed.num_tokens, routed.top_k, -1).sum(dim=1).to(dtype)  # [T, H]


def combine_eager(routed: RoutedRows, outputs: dict[int, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    assert routed.token_index is not None
    first = outputs[routed.experts[0]]
    final = torch.zeros(routed.num_tokens, first.shape[-1], dtype=dtype, device=first.device)  # [T, H]
    for expert in routed.experts:
        final.index_add_(0, routed.token_index[expert], outputs[expert].to(dtype))
    return final


class Routing:
    """The split/combine pair of one arithmetic."""

    def __init__(self, arithmetic: str) -> None:
        if arithmetic not in ("grouped", "eager"):
            raise ValueError(f"arithmetic must be grouped or eager, got {arithmetic!r}")
        self.arithmetic = arithmetic
        self.split = split_grouped if arithmetic == "grouped" else split_eager
        self.combine = combine_grouped if arithmetic == "grouped" else combine_eager


def grouped_mm_works(hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's grouped GEMM (Transformers' default experts path) runs these shapes.

    It needs 16-byte aligned strides, so e.g. an odd hidden size makes Transformers'
    default path fail; such a model's reference is the eager implementation.

    The probe's weights are one expert of the real shapes, left uninitialised: only whether
    the call runs matters, not what it computes. Zeros would write every page of them (352 MB
    at Mixtral-8x7B's sizes in bf16, 705 MB in fp32, a spike in main's and the shadow's memory
    at startup); the pages of a large fresh allocation that are only read are never made
    resident.
    """
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        x = torch.zeros(2, hidden, dtype=dtype, device=device)
        w = torch.empty(1, 2 * intermediate, hidden, dtype=dtype, device=device)
        offs = torch.tensor([2], dtype=torch.int32, device=device)
        h = F.grouped_mm(x, w.transpose(-2, -1), offs=offs)[:, :intermediate]
        d = torch.empty(1, hidden, intermediate, dtype=dtype, device=device)
        F.grouped_mm(h.contiguous(), d.transpose(-2, -1), offs=offs)
        return True
    except RuntimeError:
        return False


def resolve_arithmetic(setting: str, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> str:
    if setting not in ARITHMETICS:
        raise ValueError(f"experts arithmetic must be one of {', '.join(ARITHMETICS)}, got {setting!r}")
    if setting != "auto":
        return setting
    return "grouped" if grouped_mm_works(hidden, intermediate, dtype, device) else "eager"
