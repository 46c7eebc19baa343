"""Mixtral (``model_type`` "mixtral"): 8 experts of top-2, softmax top-k renormalized.

The release keeps each expert's projections as ``block_sparse_moe.experts.{E}.{w1|w2|w3}.weight``,
which is the shard layout itself; Transformers 5 calls the block ``mlp``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from inference.modelio.families.base import PerExpertFamily


@dataclass(frozen=True)
class Mixtral(PerExpertFamily):
    proj_names: ClassVar[dict[str, str]] = {"w1": "w1", "w2": "w2", "w3": "w3"}  # the shard layout itself
    release_order: ClassVar[tuple[str, ...]] = ("w1", "w2", "w3")

    model_type: str = "mixtral"
    causal_lm: str = "MixtralForCausalLM"
    experts_fields: tuple[str, ...] = ("num_local_experts",)
    release_moe: str = "block_sparse_moe"

    def release_config(self, shape: Mapping[str, int]) -> dict[str, Any]:
        return super().release_config(shape) | {
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
            "router_aux_loss_coef": 0.02,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }

    def hf_name(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")

    def is_router(self, name: str) -> bool:
        return re.fullmatch(r"model\.layers\.\d+\.(block_sparse_moe|mlp)\.gate\.weight", name) is not None
