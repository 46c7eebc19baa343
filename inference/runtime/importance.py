"""The ``importance`` strategy's pure parts: expert similarity, the substitution rule, residency.

After Zhu et al., "Enabling MoE on the Edge via Importance-Driven Expert Scheduling" (arXiv
2508.18983): each worker keeps a per-layer device cache of experts (``cache_experts`` per
layer, least recently used out first, as ``lru-offload``). When a token routes to an expert
of *low importance* — its routing weight below ``importance_threshold`` — that is not on a
device, main computes instead the resident expert of the same layer whose outputs are most
alike (the highest mean cosine similarity on calibration text), keeping the routing weight.
Important experts are always the routed ones. Nothing is loaded for a substituted expert, so
fewer loads sit on the critical path, at the price of exactness: **the strategy is
approximate**, and its output depends on what earlier tokens left in the caches.

- ``similarity_from_outputs``: one layer's table from every expert's outputs on the same
  calibration rows.
- ``inference.tools.calibration.calibrate``: every layer's table for a checkpoint (a tool: it runs
  Transformers); ``write_similarity`` writes it beside the weights as ``SIMILARITY_FILE``
  (``python -m inference calibrate MODEL_DIR``), ``shard`` carries it into main's shard and
  ``load_similarity`` reads it back.
- ``substitute``: the rule, on one layer's routing of some tokens.
- ``ResidentExperts``: main's view of every worker's cache, kept by the rule the worker's
  ``DeviceCache`` follows (each expert used is the most recent; beyond the capacity the
  least recent of the layer goes). It decides what counts as resident; a worker whose cache
  has drifted from it (an eviction order that timing changed) loads the expert instead, so
  the drift costs time, never a different result.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from inference.constants import SIMILARITY_FILE

SIMILARITY_KEY = "similarity"  # [layers, experts, experts] float32


def similarity_from_outputs(outputs: torch.Tensor) -> torch.Tensor:
    """[E, E] mean cosine similarity of experts' outputs ``outputs`` [E, N, H] on the same N rows."""
    if outputs.dim() != 3 or outputs.shape[1] < 1:
        raise ValueError(f"outputs must be [experts, rows, hidden] with at least one row, got {tuple(outputs.shape)}")
    unit = F.normalize(outputs.float(), dim=-1)
    return torch.einsum("end,fnd->ef", unit, unit) / outputs.shape[1]


def substitute(
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    resident: Iterable[int],
    similarity: torch.Tensor,
    threshold: float,
) -> tuple[torch.Tensor, int]:
    """The experts to compute for each token ([T, K]), and how many were substituted.

    A routed expert stays when its weight is at least ``threshold`` or it is resident; else
    it becomes the resident expert most similar to it (``similarity`` [E, E]; the lowest id on
    a tie) that the token does not already compute; with no such expert it stays (and is
    loaded). The weights are unchanged.
    """
    if top_k_index.shape != top_k_weights.shape or top_k_index.dim() != 2:
        raise ValueError("top_k_index and top_k_weights must both be [tokens, k]")
    held = set(resident)
    on_device = sorted(held)  # candidates in id order: the lowest wins a tie
    chosen = top_k_index.clone()
    if not on_device or threshold <= 0:
        return chosen, 0
    rows = chosen.tolist()
    weights = top_k_weights.tolist()
    substituted = 0
    for t, (experts, token_weights) in enumerate(zip(rows, weights, strict=True)):
        for k, (expert, weight) in enumerate(zip(experts, token_weights, strict=True)):
            if weight >= threshold or expert in held:
                continue
            taken = set(experts)
            candidates = [f for f in on_device if f not in taken]
            if not candidates:
                continue
            alike = similarity[expert].tolist()
            best = max(candidates, key=lambda f: (alike[f], -f))
            experts[k] = best
            chosen[t, k] = best
            substituted += 1
    return chosen, substituted


class ResidentExperts:
    """Main's view of what each worker keeps on its device, per layer, under an LRU cache."""

    def __init__(self, capacity_per_layer: int) -> None:
        if capacity_per_layer < 0:
            raise ValueError(f"capacity_per_layer must be >= 0, got {capacity_per_layer}")
        self.capacity = capacity_per_layer
        self._lru: dict[tuple[int, int], OrderedDict[int, None]] = {}  # (worker, layer) -> experts, oldest first

    def resident(self, layer: int) -> set[int]:
        """Every expert of ``layer`` some worker holds."""
        return {e for (_, held_layer), lru in self._lru.items() if held_layer == layer for e in lru}

    def used(self, worker: int, layer: int, experts: Sequence[int]) -> None:
        """``worker`` computed ``experts`` of ``layer``, in this order."""
        lru = self._lru.setdefault((worker, layer), OrderedDict())
        for expert in experts:
            lru.pop(expert, None)
            lru[expert] = None
            while len(lru) > self.capacity:
                lru.popitem(last=False)

    def forget(self, worker: int) -> None:
        """A worker was lost (its device cache with it)."""
        for key in [k for k in self._lru if k[0] == worker]:
            del self._lru[key]


def load_similarity(
    directory: str | os.PathLike[str], *, layers: int | None = None, experts: int | None = None
) -> torch.Tensor:
    """The [L, E, E] table ``calibrate`` wrote to ``directory``; a clear error when it is missing
    or (given the model's ``layers`` and ``experts``) was calibrated for another model."""
    from safetensors.torch import load_file

    path = Path(directory) / SIMILARITY_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the importance strategy needs the experts' similarity table; "
            "run `python -m inference calibrate MODEL_DIR` and shard the model again"
        )
    table = load_file(str(path)).get(SIMILARITY_KEY)
    if table is None or table.dim() != 3 or table.shape[1] != table.shape[2]:
        raise ValueError(f"{path} does not hold a [layers, experts, experts] {SIMILARITY_KEY!r} tensor")
    expected = (layers or table.shape[0], experts or table.shape[1], experts or table.shape[2])
    if tuple(table.shape) != expected:
        raise ValueError(
            f"{path} is for {table.shape[0]} layers of {table.shape[1]} experts, the model has "
            f"{expected[0]} of {expected[1]}: calibrate this model again"
        )
    return table


def write_similarity(model_dir: str | os.PathLike[str], table: torch.Tensor, tokens: int) -> Path:
    """Write ``table`` beside the checkpoint's weights (what ``shard`` carries into main's shard)."""
    from safetensors.torch import save_file

    path = Path(model_dir) / SIMILARITY_FILE
    save_file({SIMILARITY_KEY: table.contiguous()}, str(path), metadata={"calibration_tokens": str(tokens)})
    return path
