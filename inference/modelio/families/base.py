"""What one MoE model family looks like to odmoe: one adapter per family, one interface.

The runtime core (sharding, placement, strategies, workers) is family-agnostic. It sees a
checkpoint through ``inference.modelio.checkpoint.Checkpoint``, which shows every family's routed
experts in one *shard layout*: per expert three 2-D tensors named as in the Mixtral release,
``model.layers.{L}.block_sparse_moe.experts.{E}.{w1|w2|w3}.weight`` (``w1`` gate [I, H], ``w3``
up [I, H], ``w2`` down [H, I]). Mixtral's own shards are therefore unchanged; other families'
experts are read from wherever their release keeps them (other names, or one fused tensor per
layer read by slices) and land in shards under those names. Every other tensor (attention,
norms, routers, shared experts) keeps its release name; an adapter maps it to its Transformers
module path when a role builds its model.

An adapter says, from a config alone:

- how many routed experts, active experts and what expert width the config declares;
- where each routed expert's three projections live in the release (``ExpertSource``);
- every release tensor's name and shape (tiny checkpoints and memory plans are made from it);
- which Transformers model class runs the family, and where a decoder layer keeps its MoE
  router and its experts module (main hooks the experts, the shadow hooks the router).

The router function itself (softmax top-k with or without renormalization, Granite's top-k of
logits then softmax) and a shared expert with its sigmoid gate are Transformers' own code:
main and the shadow run the family's Transformers model, so both route exactly as the
reference does, and a shared expert is computed on main with the other always-active weights.

Shape legend: ``H`` hidden, ``I`` routed expert intermediate, ``E`` routed experts, ``K`` top-k,
``S`` shared expert intermediate, ``Q``/``KV`` query/key-value heads, ``D`` head dim, ``V`` vocab.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

# The shard layout of a routed expert: what every family's experts are called in shards.
SHARD_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
SHARD_PROJS = ("w1", "w2", "w3")  # gate, down, up


def shard_expert_name(layer: int, expert: int, proj: str) -> str:
    """The shard-layout name of ``proj`` (``w1`` gate, ``w2`` down, ``w3`` up) of an expert."""
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight"


class FamilyError(ValueError):
    """A config this family (or odmoe) cannot serve, with the reason."""


@dataclass(frozen=True)
class ExpertSource:
    """Where one projection of one routed expert lives in a release checkpoint.

    ``index`` is the expert's position along dim 0 of a fused ``[E, ...]`` tensor (None: the
    tensor is this projection alone); ``rows`` the projection's rows within that expert's
    slice (a fused gate-and-up tensor holds the gate rows first); ``fused`` the whole fused
    tensor's shape as the config says it must be (a file that disagrees is refused, not sliced).
    """

    name: str
    index: int | None = None
    rows: tuple[int, int] | None = None
    fused: tuple[int, ...] | None = None


Shapes = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class Family:
    """One model family's layout and routing. Subclasses fill in the family's facts."""

    model_type: str
    causal_lm: str  # the Transformers class that runs it
    # The config fields counting routed experts, first found wins (releases and Transformers'
    # own saved configs name it differently within one family: Qwen3 num_experts / num_local_experts).
    experts_fields: tuple[str, ...] = ("num_experts", "num_local_experts")
    intermediate_field: str = "intermediate_size"  # the config field of a routed expert's width
    moe_attr: str = "mlp"  # the decoder layer's attribute holding the MoE block
    router_attr: str = "gate"  # the MoE block's attribute holding the router
    release_moe: str = "mlp"  # the MoE block's name in release tensor names
    release_router: str = "gate"  # the router's name (under release_moe) in release tensor names

    # -- config ---------------------------------------------------------------------------

    def n_experts(self, config: Mapping[str, Any]) -> int:
        field = next((f for f in self.experts_fields if f in config), self.experts_fields[0])
        return _positive(config, field)

    def expert_intermediate(self, config: Mapping[str, Any]) -> int:
        return _positive(config, self.intermediate_field)

    def shared_intermediate(self, config: Mapping[str, Any]) -> int:
        """The width of the always-active shared expert (0: the family has none)."""
        return 0

    def check(self, config: Mapping[str, Any]) -> None:
        """Raise ``FamilyError`` for a config of this family that odmoe cannot serve."""
        for field in ("num_hidden_layers", "hidden_size", "num_experts_per_tok", "num_attention_heads", "vocab_size"):
            _positive(config, field)
        if config["num_experts_per_tok"] > self.n_experts(config):
            raise FamilyError(
                f"num_experts_per_tok ({config['num_experts_per_tok']}) exceeds the experts ({self.n_experts(config)})"
            )
        self.expert_intermediate(config)

    def release_config(self, shape: Mapping[str, int]) -> dict[str, Any]:
        """The family's ``config.json`` fields for a model of ``shape`` (``layers``, ``hidden``,
        ``intermediate``, ``experts``, ``top_k``, ``heads``, ``kv_heads``, ``head_dim``, ``vocab``,
        ``shared_intermediate``), as its releases spell them; tiny checkpoints are made from it."""
        return {
            "architectures": [self.causal_lm],
            "model_type": self.model_type,
            "attention_dropout": 0.0,
            "head_dim": shape["head_dim"],
            "hidden_act": "silu",
            "hidden_size": shape["hidden"],
            "num_attention_heads": shape["heads"],
            "num_experts_per_tok": shape["top_k"],
            "num_hidden_layers": shape["layers"],
            "num_key_value_heads": shape["kv_heads"],
            self.experts_fields[0]: shape["experts"],
            self.intermediate_field: shape["intermediate"],
            "output_router_logits": False,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": shape["vocab"],
        }

    def config_class(self) -> type:
        from transformers import AutoConfig

        return type(AutoConfig.for_model(self.model_type))

    def model_class(self) -> type:
        import transformers

        return getattr(transformers, self.causal_lm)

    # -- tensor names ---------------------------------------------------------------------

    def expert_source(self, layer: int, expert: int, proj: str, config: Mapping[str, Any]) -> ExpertSource:
        """Where ``proj`` (``w1`` gate, ``w2`` down, ``w3`` up) of an expert lives in the release."""
        raise NotImplementedError

    def is_release_expert(self, name: str) -> bool:
        """Whether a release tensor holds routed expert weights (read through ``expert_source``)."""
        raise NotImplementedError

    def router_name(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.release_moe}.{self.release_router}.weight"

    def is_router(self, name: str) -> bool:
        """Whether a release (or shard) tensor name is a router's weight."""
        return (
            re.fullmatch(
                rf"model\.layers\.\d+\.{re.escape(self.release_moe)}\.{re.escape(self.release_router)}\.weight", name
            )
            is not None
        )

    def hf_name(self, name: str) -> str:
        """A non-expert release tensor name to its Transformers module path (most are the same)."""
        return name

    def experts_path(self, layer: int) -> str:
        """The Transformers module path of layer ``layer``'s experts module."""
        return f"model.layers.{layer}.{self.moe_attr}.experts"

    def release_shapes(self, config: Mapping[str, Any]) -> Shapes:
        """Every tensor of a release checkpoint of ``config``: name and shape, in file order."""
        h, v = config["hidden_size"], config["vocab_size"]
        shapes: Shapes = [("model.embed_tokens.weight", (v, h))]
        for layer in range(config["num_hidden_layers"]):
            shapes += self.layer_shapes(config, layer)
        shapes.append(("model.norm.weight", (h,)))
        if not config.get("tie_word_embeddings", False):
            shapes.append(("lm_head.weight", (v, h)))
        return shapes

    def projection_shapes(self, config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
        """A routed expert's projections: ``w1`` gate [I, H], ``w2`` down [H, I], ``w3`` up [I, H]."""
        h, i = config["hidden_size"], self.expert_intermediate(config)
        return {"w1": (i, h), "w2": (h, i), "w3": (i, h)}

    def shard_shapes(self, config: Mapping[str, Any]) -> Shapes:
        """Every tensor as a checkpoint shows it (``inference.modelio.checkpoint``): routed experts in the
        shard layout, one [I, H] / [H, I] tensor per projection, the rest as in the release."""
        proj_shapes = self.projection_shapes(config)
        shapes: Shapes = [(n, s) for n, s in self.release_shapes(config) if not self.is_release_expert(n)]
        for layer in range(config["num_hidden_layers"]):
            for expert in range(self.n_experts(config)):
                shapes += [(shard_expert_name(layer, expert, p), proj_shapes[p]) for p in SHARD_PROJS]
        return shapes

    def layer_shapes(self, config: Mapping[str, Any], layer: int) -> Shapes:
        h = config["hidden_size"]
        prefix = f"model.layers.{layer}"
        return [
            (f"{prefix}.input_layernorm.weight", (h,)),
            *self.attention_shapes(config, prefix),
            (f"{prefix}.post_attention_layernorm.weight", (h,)),
            (self.router_name(layer), (self.n_experts(config), h)),
            *self.shared_shapes(config, prefix),
            *self.expert_shapes(config, layer),
        ]

    def attention_shapes(self, config: Mapping[str, Any], prefix: str) -> Shapes:
        h, q, kv, d = _attention_dims(config)
        weights = {"q": (q * d, h), "k": (kv * d, h), "v": (kv * d, h), "o": (h, q * d)}
        biased = bool(config.get("attention_bias"))  # every projection's bias (Qwen3, OLMoE, Granite configs)
        shapes: Shapes = []
        for proj, shape in weights.items():
            shapes.append((f"{prefix}.self_attn.{proj}_proj.weight", shape))
            if biased:
                shapes.append((f"{prefix}.self_attn.{proj}_proj.bias", (shape[0],)))
        return shapes

    def shared_shapes(self, config: Mapping[str, Any], prefix: str) -> Shapes:
        return []

    def expert_shapes(self, config: Mapping[str, Any], layer: int) -> Shapes:
        """The release tensors of layer ``layer``'s routed experts."""
        raise NotImplementedError

    # -- the model ------------------------------------------------------------------------

    def moe_block(self, decoder: torch.nn.Module) -> torch.nn.Module:
        return getattr(decoder, self.moe_attr)

    def router(self, decoder: torch.nn.Module) -> torch.nn.Module:
        """The router of a decoder layer: called on [T, H], it returns (logits, weights, indices)."""
        return getattr(self.moe_block(decoder), self.router_attr)

    def experts(self, decoder: torch.nn.Module) -> torch.nn.Module:
        """The experts module of a decoder layer (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])."""
        return self.moe_block(decoder).experts

    # -- the forward, piece by piece (main's engine runs it layer by layer: inference.runtime.engine.runner) --
    # Each mirrors the family's Transformers forward; a family that differs overrides its piece.

    def causal_masks(self, model: torch.nn.Module, **mask_kwargs: Any) -> list[Any]:
        """Each decoder layer's attention mask, made as the family's model forward makes it
        (``config``, ``inputs_embeds``, ``attention_mask``, ``cache``, ``position_ids``)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        config = model.config
        sliding = getattr(config, "sliding_window", None) is not None
        mask = (create_sliding_window_causal_mask if sliding else create_causal_mask)(config=config, **mask_kwargs)
        return [mask] * config.num_hidden_layers

    def scale_embeddings(self, config: Any, embeds: torch.Tensor) -> torch.Tensor:
        """The decoder's input from the token embeddings."""
        return embeds

    def add_residual(self, decoder: torch.nn.Module, residual: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """A sublayer's (attention's, the MoE block's) output added to the residual stream."""
        return residual + output

    def moe_output(self, decoder: torch.nn.Module, hidden: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The MoE block's output for its [T, H] input ``hidden``, given its routed experts' sum."""
        return routed

    def scale_logits(self, config: Any, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's output as the family's forward returns it."""
        return logits


class PerExpertFamily(Family):
    """A family whose release stores each routed expert's projections as their own tensors,
    ``{release_moe}.experts.{E}.{name}.weight`` (Mixtral's ``w1|w2|w3``, the Qwen and OLMoE
    releases' ``gate_proj|up_proj|down_proj``)."""

    # The release's name of each shard-layout projection, and their order within an expert.
    proj_names: ClassVar[dict[str, str]] = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
    release_order: ClassVar[tuple[str, ...]] = ("w2", "w1", "w3")  # down, gate, up: alphabetical

    def expert_source(self, layer: int, expert: int, proj: str, config: Mapping[str, Any]) -> ExpertSource:
        return ExpertSource(f"model.layers.{layer}.{self.release_moe}.experts.{expert}.{self.proj_names[proj]}.weight")

    def is_release_expert(self, name: str) -> bool:
        names = "|".join(re.escape(n) for n in self.proj_names.values())
        pattern = rf"model\.layers\.\d+\.{re.escape(self.release_moe)}\.experts\.\d+\.({names})\.weight"
        return re.fullmatch(pattern, name) is not None

    def expert_shapes(self, config: Mapping[str, Any], layer: int) -> Shapes:
        shapes = self.projection_shapes(config)
        return [
            (self.expert_source(layer, e, p, config).name, shapes[p])
            for e in range(self.n_experts(config))
            for p in self.release_order
        ]


def _attention_dims(config: Mapping[str, Any]) -> tuple[int, int, int, int]:
    h, q = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or q
    d = config.get("head_dim") or h // q
    return h, q, kv, d


def _positive(config: Mapping[str, Any], field: str) -> int:
    value = config.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise FamilyError(f"config field {field!r} must be a positive integer, got {value!r}")
    return value
