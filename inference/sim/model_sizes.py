"""Sizes of an MoE model of any supported family: parameter counts, bytes and FLOPs per token and layer.

Shape legend: H hidden, I expert intermediate, E experts, K active experts (top-k), Q query heads,
KV key/value heads, D head dim, V vocabulary, L layers, S shared expert intermediate (0: none).
Bytes depend on the storage precision (bits per weight) and are computed here, never stored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from inference.modelio.families import family_for
from inference.modelio.families.releases import RELEASES


@dataclass(frozen=True)
class ModelSizes:
    name: str
    layers: int  # L
    hidden: int  # H
    intermediate: int  # I
    experts: int  # E
    top_k: int  # K
    query_heads: int  # Q
    kv_heads: int  # KV
    head_dim: int  # D
    vocab: int  # V
    shared_intermediate: int = 0  # S: an always-active shared expert's width (Qwen2-MoE), 0 = none

    def __post_init__(self) -> None:
        for field, val in asdict(self).items():
            if field == "shared_intermediate" and isinstance(val, int) and val >= 0:
                continue
            if field != "name" and (not isinstance(val, int) or val <= 0):
                raise ValueError(f"model size {field} must be a positive integer, got {val!r}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k ({self.top_k}) cannot exceed the number of experts ({self.experts})")

    # parameters ------------------------------------------------------------------------------------
    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.intermediate  # w1, w3: [I, H]; w2: [H, I]

    @property
    def attention_params(self) -> int:
        q_out = self.query_heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        return self.hidden * (2 * q_out + 2 * kv_out)  # q, o: H x QD; k, v: H x KVD

    @property
    def shared_params(self) -> int:
        """A layer's shared expert (gate, up, down) and its sigmoid gate; 0 without one."""
        return 3 * self.hidden * self.shared_intermediate + self.hidden if self.shared_intermediate else 0

    @property
    def layer_dense_params(self) -> int:
        """Per-layer parameters that are not routed experts: attention, router, two norms, a shared expert."""
        return self.attention_params + self.experts * self.hidden + 2 * self.hidden + self.shared_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden + self.hidden  # LM head + final norm

    @property
    def total_params(self) -> int:
        per_layer = self.layer_dense_params + self.experts * self.expert_params
        return self.layers * per_layer + self.embedding_params + self.head_params

    @property
    def non_expert_params(self) -> int:
        return self.layers * self.layer_dense_params + self.embedding_params + self.head_params

    # bytes ---------------------------------------------------------------------------------------------
    def expert_bytes(self, bits: float = 16) -> float:
        return self.expert_params * bits / 8

    def kv_bytes_per_token_layer(self, bits: float = 16) -> float:
        return 2 * self.kv_heads * self.head_dim * bits / 8

    def hidden_bytes(self, tokens: int = 1, bits: float = 16) -> float:
        return tokens * self.hidden * bits / 8

    def decode_bytes_per_token(self, context: int, bits: float = 16) -> float:
        """Bytes a full-cache decode step must read: K experts and attention per layer, KV cache, LM head."""
        per_layer = (
            self.top_k * self.expert_bytes(bits)
            + self.layer_dense_params * bits / 8
            + context * self.kv_bytes_per_token_layer()
        )
        return self.layers * per_layer + self.head_params * bits / 8 + self.hidden * bits / 8

    # FLOPs ---------------------------------------------------------------------------------------------
    def attention_flops(self, tokens: int, context: int) -> float:
        """Projections plus scores and weighted sum for `tokens` new tokens over `context` positions."""
        projections = 2 * tokens * self.attention_params
        scores = 4 * tokens * context * self.query_heads * self.head_dim
        return projections + scores

    def expert_flops(self, tokens: int) -> float:
        return 2 * tokens * self.expert_params

    def as_dict(self) -> dict:
        return asdict(self)


def from_hf_config(config: dict) -> ModelSizes:
    """Sizes from a Hugging Face ``config.json`` of any supported family (``inference.modelio.families``)."""
    family = family_for(config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return ModelSizes(
        name=str(config.get("_name_or_path") or config.get("model_type") or "custom"),
        layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        intermediate=family.expert_intermediate(config),
        experts=family.n_experts(config),
        top_k=config["num_experts_per_tok"],
        query_heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        vocab=config["vocab_size"],
        shared_intermediate=family.shared_intermediate(config),
    )


def release_sizes(name: str) -> ModelSizes:
    """The sizes of a known release (``inference.modelio.families.releases``)."""
    return from_hf_config({**RELEASES[name], "_name_or_path": name})


def mixtral_8x7b() -> ModelSizes:
    return release_sizes("mixtral-8x7b")


def mixtral_8x22b() -> ModelSizes:
    return release_sizes("mixtral-8x22b")


KNOWN_MODELS = {name: (lambda name=name: release_sizes(name)) for name in RELEASES}


def resolve_model(model: str | dict | ModelSizes) -> ModelSizes:
    if isinstance(model, ModelSizes):
        return model
    if isinstance(model, dict):
        return from_hf_config(model)
    if isinstance(model, str) and model in KNOWN_MODELS:
        return KNOWN_MODELS[model]()
    raise ValueError(f"unknown model {model!r}; use one of {sorted(KNOWN_MODELS)} or a config.json dict")
