"""The shape of a prerouter file (``inference.runtime.prerouter``), kept free of torch.

The memory plan (``inference.building.memory``) sizes main's prerouter from this shape before any model
is at hand, and the control plane plans deployments with it; the prerouter's heads and
adapter themselves (torch modules) live in ``inference.runtime.prerouter``.
"""

from __future__ import annotations

from dataclasses import dataclass

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # main's attention projections


@dataclass(frozen=True)
class PrerouterShape:
    """The sizes a prerouter file is for, and its own."""

    layers: int
    experts: int
    top_k: int
    hidden: int
    head_width: int = 128
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = LORA_TARGETS

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank
