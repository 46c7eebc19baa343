"""OLMoE (``model_type`` "olmoe"): 64 experts of top-8, no shared expert.

Attention normalizes the whole query and key projections (``q_norm`` [H], ``k_norm``
[H / Q * KV], as Transformers sizes them whatever ``head_dim`` says);
the router renormalizes its top-k only when ``norm_topk_prob`` (false in OLMoE-1B-7B).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inference.modelio.families.base import PerExpertFamily, Shapes, _attention_dims

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Olmoe(PerExpertFamily):
    model_type: str = "olmoe"
    causal_lm: str = "OlmoeForCausalLM"

    def release_config(self, shape: Mapping[str, int]) -> dict[str, Any]:
        return super().release_config(shape) | {
            "norm_topk_prob": False,
            "attention_bias": False,
            "clip_qkv": None,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e4,
        }

    def attention_shapes(self, config: Mapping[str, Any], prefix: str) -> Shapes:
        h, q, kv, _ = _attention_dims(config)
        return [
            *super().attention_shapes(config, prefix),
            (f"{prefix}.self_attn.q_norm.weight", (h,)),
            (f"{prefix}.self_attn.k_norm.weight", (h // q * kv,)),
        ]

    # OlmoeModel.forward: no sliding window.
    def causal_masks(self, model: torch.nn.Module, **mask_kwargs: Any) -> list[Any]:
        from transformers.masking_utils import create_causal_mask

        return [create_causal_mask(config=model.config, **mask_kwargs)] * model.config.num_hidden_layers
