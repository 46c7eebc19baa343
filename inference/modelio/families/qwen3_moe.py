"""Qwen3-MoE (``model_type`` "qwen3_moe"): fine-grained experts (128 of top-8 in Qwen3-30B-A3B).

No shared expert; the router renormalizes its top-k when ``norm_topk_prob`` (true in the
releases); attention normalizes queries and keys per head (``q_norm``/``k_norm`` [D]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inference.modelio.families.base import Shapes, _attention_dims
from inference.modelio.families.qwen2_moe import QwenMoeFamily


# Alike olmoe.py's adapter by domain, on purpose: each family declares its own adapter.
@dataclass(frozen=True)
class Qwen3Moe(QwenMoeFamily):
    model_type: str = "qwen3_moe"
    causal_lm: str = "Qwen3MoeForCausalLM"

    def release_config(self, shape: Mapping[str, int]) -> dict[str, Any]:
        return super().release_config(shape) | {
            "intermediate_size": 3 * shape["intermediate"],  # the dense MLP's width, unused here
            "norm_topk_prob": True,
            "attention_bias": False,
        }

    def attention_shapes(self, config: Mapping[str, Any], prefix: str) -> Shapes:
        *_, d = _attention_dims(config)
        return [
            *super().attention_shapes(config, prefix),
            (f"{prefix}.self_attn.q_norm.weight", (d,)),
            (f"{prefix}.self_attn.k_norm.weight", (d,)),
        ]
