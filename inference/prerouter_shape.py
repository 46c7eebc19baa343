"""The sizes a prerouter file is for (``inference.prerouter``), torch-free.

Apart from the heads and adapter themselves so that the memory planner (``inference.memory``),
which the control plane's web and Celery processes import, can size a prerouter without torch.
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
