"""Expert stores: where a worker keeps the weights of the experts it owns, off the GPU.

A store hands out host-side expert weights by (layer, expert). ``HostMemoryStore`` keeps
them in RAM (pinned when a GPU will copy them); the interface is what an SSD-streaming
store would implement too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from inference.checkpoint import parse_expert_key
from inference.experts import ExpertWeights, fuse_expert
from inference.sharding import load_role_tensors

LayerExpert = tuple[int, int]


class ExpertStore(Protocol):
    def keys(self) -> frozenset[LayerExpert]: ...

    def get(self, layer: int, expert: int) -> ExpertWeights: ...

    def nbytes(self, layer: int, expert: int) -> int: ...


class HostMemoryStore:
    def __init__(self, experts: dict[LayerExpert, ExpertWeights]) -> None:
        self._experts = experts

    @classmethod
    def from_shard(cls, shard_dir: str | Path, *, pin: bool = False) -> HostMemoryStore:
        """Read a verified worker shard, one tensor at a time, into fused host tensors."""
        parts: dict[LayerExpert, dict[str, torch.Tensor]] = {}
        for name, tensor in load_role_tensors(shard_dir):
            key = parse_expert_key(name)
            if key is None:
                continue
            parts.setdefault((key.layer, key.expert), {})[key.proj] = tensor
        experts: dict[LayerExpert, ExpertWeights] = {}
        for pair, projs in parts.items():
            missing = {"w1", "w2", "w3"} - projs.keys()
            if missing:
                raise ValueError(f"{shard_dir}: expert {pair} lacks {sorted(missing)}")
            weights = fuse_expert(projs["w1"], projs["w2"], projs["w3"])
            if pin:
                weights = ExpertWeights(weights.gate_up.pin_memory(), weights.down.pin_memory())
            experts[pair] = weights
        return cls(experts)

    def keys(self) -> frozenset[LayerExpert]:
        return frozenset(self._experts)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        try:
            return self._experts[(layer, expert)]
        except KeyError:
            raise KeyError(f"expert {expert} of layer {layer} is not in this worker's store") from None

    def nbytes(self, layer: int, expert: int) -> int:
        return self.get(layer, expert).nbytes
