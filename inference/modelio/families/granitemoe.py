"""GraniteMoE (``model_type`` "granitemoe"): experts fused on disk, one tensor per layer and kind.

The release stores a layer's experts as ``block_sparse_moe.input_linear.weight`` [E, 2I, H]
(each expert's gate rows over its up rows) and ``block_sparse_moe.output_linear.weight``
[E, H, I]; the router is ``block_sparse_moe.router.layer.weight``. Sharding reads one expert's
rows of these by safetensors slices, never a whole fused tensor. The router takes the top-k
*logits* and softmaxes over them; embeddings, residuals, attention and logits carry the
config's multipliers (Transformers' own code applies them on main and the shadow).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inference.modelio.families.base import ExpertSource, Family, Shapes

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class GraniteMoe(Family):
    model_type: str = "granitemoe"
    causal_lm: str = "GraniteMoeForCausalLM"
    experts_fields: tuple[str, ...] = ("num_local_experts",)
    moe_attr: str = "block_sparse_moe"
    router_attr: str = "router"
    release_moe: str = "block_sparse_moe"
    release_router: str = "router.layer"

    def release_config(self, shape: Mapping[str, int]) -> dict[str, Any]:
        # Multipliers other than 1, so a test model exercises the code that applies them.
        return super().release_config(shape) | {
            "attention_bias": False,
            "attention_multiplier": 1.0 / shape["head_dim"],
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "logits_scaling": 2.0,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e4,
        }

    def expert_source(self, layer: int, expert: int, proj: str, config: Mapping[str, Any]) -> ExpertSource:
        prefix = f"model.layers.{layer}.block_sparse_moe"
        h, i, e = config["hidden_size"], self.expert_intermediate(config), self.n_experts(config)
        if proj == "w2":
            return ExpertSource(f"{prefix}.output_linear.weight", index=expert, fused=(e, h, i))
        rows = (0, i) if proj == "w1" else (i, 2 * i)
        return ExpertSource(f"{prefix}.input_linear.weight", index=expert, rows=rows, fused=(e, 2 * i, h))

    def is_release_expert(self, name: str) -> bool:
        return re.fullmatch(r"model\.layers\.\d+\.block_sparse_moe\.(input|output)_linear\.weight", name) is not None

    def is_router(self, name: str) -> bool:
        return re.fullmatch(r"model\.layers\.\d+\.block_sparse_moe\.router(\.layer)?\.weight", name) is not None

    def hf_name(self, name: str) -> str:
        return name.replace(".block_sparse_moe.router.layer.", ".block_sparse_moe.router.")

    def expert_shapes(self, config: Mapping[str, Any], layer: int) -> Shapes:
        h, i, e = config["hidden_size"], self.expert_intermediate(config), self.n_experts(config)
        prefix = f"model.layers.{layer}.block_sparse_moe"
        return [(f"{prefix}.input_linear.weight", (e, 2 * i, h)), (f"{prefix}.output_linear.weight", (e, h, i))]

    # GraniteMoeModel.forward: no sliding window, embeddings times embedding_multiplier;
    # GraniteMoeDecoderLayer: each sublayer's output times residual_multiplier;
    # GraniteMoeForCausalLM: logits divided by logits_scaling.

    def causal_masks(self, model: torch.nn.Module, **mask_kwargs: Any) -> list[Any]:
        from transformers.masking_utils import create_causal_mask

        return [create_causal_mask(config=model.config, **mask_kwargs)] * model.config.num_hidden_layers

    def scale_embeddings(self, config: Any, embeds: torch.Tensor) -> torch.Tensor:
        return embeds * config.embedding_multiplier

    def add_residual(self, decoder: torch.nn.Module, residual: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        return residual + output * decoder.residual_multiplier

    def scale_logits(self, config: Any, logits: torch.Tensor) -> torch.Tensor:
        return logits / config.logits_scaling
