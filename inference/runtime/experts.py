"""The expert computation itself, kept bit-compatible with Transformers' experts (every family's is the same).

Shape legend: ``M`` rows routed to one expert, ``H`` hidden size, ``I`` intermediate size.
Transformers 5 fuses each expert's ``w1`` (gate) and ``w3`` (up) into ``gate_up`` rows
``[w1; w3]`` and keeps ``w2`` as ``down``; computing one expert's rows with the same
operations on the same rows gives the same bits as its grouped implementation, which is
what makes the distributed output token-identical to the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The expert activation named by a config's ``hidden_act`` (Mixtral: silu)."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported expert activation {name!r}; known: {', '.join(_ACTIVATIONS)}") from None


@dataclass
class ExpertWeights:
    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]

    @property
    def nbytes(self) -> int:
        return self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()


def fuse_expert(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> ExpertWeights:
    """Checkpoint layout (w1 gate, w2 down, w3 up) to the fused layout Transformers uses."""
    return ExpertWeights(gate_up=torch.cat([w1, w3], dim=0).contiguous(), down=w2.contiguous())


def expert_forward(
    rows: torch.Tensor,
    weights: torch.Tensor,
    expert: ExpertWeights,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Weighted output of one expert for its ``rows`` [M, H] and routing ``weights`` [M]."""
    proj = F.linear(rows.to(expert.gate_up.dtype), expert.gate_up)  # [M, 2I]
    gate, up = proj.chunk(2, dim=-1)  # [M, I] each
    out = F.linear(act_fn(gate) * up, expert.down)  # [M, H]
    return out * weights.unsqueeze(-1)
