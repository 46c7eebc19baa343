"""Qwen1.5-MoE / Qwen2-MoE (``model_type`` "qwen2_moe"): routed experts plus one shared expert.

Each MoE block adds a shared expert (``mlp.shared_expert.{gate|up|down}_proj``, width
``shared_expert_intermediate_size``) scaled by ``sigmoid(mlp.shared_expert_gate(x))``; it runs
for every token, so it stays on main with attention. The router's softmax top-k is not
renormalized unless ``norm_topk_prob`` (false in the releases). Attention has q/k/v biases.
Configs with dense layers (``mlp_only_layers``, ``decoder_sparse_step`` > 1) are refused: every
layer of the runtime has routed experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inference.modelio.families.base import FamilyError, PerExpertFamily, Shapes, _attention_dims, _positive

if TYPE_CHECKING:
    import torch


def check_all_layers_sparse(config: Mapping[str, Any]) -> None:
    """Refuse Qwen-style configs with dense (MLP-only) layers, which odmoe does not serve yet."""
    if config.get("mlp_only_layers"):
        raise FamilyError(f"layers {config['mlp_only_layers']} are dense (mlp_only_layers): not supported yet")
    step = config.get("decoder_sparse_step", 1)
    if step != 1:
        raise FamilyError(f"decoder_sparse_step is {step!r}: only every layer sparse (1) is supported yet")


@dataclass(frozen=True)
class QwenMoeFamily(PerExpertFamily):
    """What the Qwen MoE releases share: experts of ``moe_intermediate_size``, every layer sparse
    (``check_all_layers_sparse``), and the release config's layer, norm and rope fields."""

    intermediate_field: str = "moe_intermediate_size"

    def check(self, config: Mapping[str, Any]) -> None:
        super().check(config)
        check_all_layers_sparse(config)

    def release_config(self, shape: Mapping[str, int]) -> dict[str, Any]:
        return super().release_config(shape) | {
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "use_sliding_window": False,
            "sliding_window": None,
        }


@dataclass(frozen=True)
class Qwen2Moe(QwenMoeFamily):
    model_type: str = "qwen2_moe"
    causal_lm: str = "Qwen2MoeForCausalLM"

    def check(self, config: Mapping[str, Any]) -> None:
        super().check(config)
        self.shared_intermediate(config)

    def release_config(self, shape: Mapping[str, int]) -> dict[str, Any]:
        return super().release_config(shape) | {
            "intermediate_size": shape["shared_intermediate"],  # the dense MLP's width, unused here
            "shared_expert_intermediate_size": shape["shared_intermediate"],
            "norm_topk_prob": False,
        }

    def shared_intermediate(self, config: Mapping[str, Any]) -> int:
        return _positive(config, "shared_expert_intermediate_size")

    def attention_shapes(self, config: Mapping[str, Any], prefix: str) -> Shapes:
        h, q, kv, d = _attention_dims(config)
        if not config.get("qkv_bias", True):
            return super().attention_shapes(config, prefix)
        return [
            (f"{prefix}.self_attn.q_proj.weight", (q * d, h)),
            (f"{prefix}.self_attn.q_proj.bias", (q * d,)),
            (f"{prefix}.self_attn.k_proj.weight", (kv * d, h)),
            (f"{prefix}.self_attn.k_proj.bias", (kv * d,)),
            (f"{prefix}.self_attn.v_proj.weight", (kv * d, h)),
            (f"{prefix}.self_attn.v_proj.bias", (kv * d,)),
            (f"{prefix}.self_attn.o_proj.weight", (h, q * d)),
        ]

    def shared_shapes(self, config: Mapping[str, Any], prefix: str) -> Shapes:
        h, s = config["hidden_size"], self.shared_intermediate(config)
        return [
            (f"{prefix}.mlp.shared_expert.gate_proj.weight", (s, h)),
            (f"{prefix}.mlp.shared_expert.up_proj.weight", (s, h)),
            (f"{prefix}.mlp.shared_expert.down_proj.weight", (h, s)),
            (f"{prefix}.mlp.shared_expert_gate.weight", (1, h)),
        ]

    # Qwen2MoeModel.forward: a full and a sliding-window mask, each layer taking its type's.
    def causal_masks(self, model: torch.nn.Module, **mask_kwargs: Any) -> list[Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        config = model.config
        masks = {
            "full_attention": create_causal_mask(config=config, **mask_kwargs),
            "sliding_attention": create_sliding_window_causal_mask(config=config, **mask_kwargs),
        }
        return [masks[config.layer_types[i]] for i in range(config.num_hidden_layers)]

    # Qwen2MoeSparseMoeBlock.forward: the routed sum plus the shared expert under its sigmoid gate.
    def moe_output(self, decoder: torch.nn.Module, hidden: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        block = self.moe_block(decoder)
        shared = block.shared_expert(hidden)
        shared = F.sigmoid(block.shared_expert_gate(hidden)) * shared
        return routed + shared
