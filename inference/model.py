"""Build the Transformers Mixtral model that a role runs, from its shard.

Transformers is the reference implementation, so main and the shadow reuse its model code
for everything but the experts: main's experts are computed remotely (the
``odmoe_remote`` experts implementation hands each layer's routed rows to the runtime),
the shadow's are local and quantized. Weights come from the role's verified shard one
tensor at a time and are assigned into a model first built on the meta device, so main
never allocates the expert weights it does not hold.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from transformers import GenerationConfig, MixtralConfig, MixtralForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralRotaryEmbedding

from inference.checkpoint import parse_expert_key
from inference.sharding import load_role_tensors

REMOTE_EXPERTS = "odmoe_remote"


class ExpertDispatcher(Protocol):
    """What main's experts call per layer: returns the layer's summed expert output."""

    def moe(
        self, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor: ...


def _remote_experts_forward(
    self: MixtralExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    return self._odmoe_dispatcher.moe(self._odmoe_layer, hidden_states, top_k_index, top_k_weights)


ALL_EXPERTS_FUNCTIONS.register(REMOTE_EXPERTS, _remote_experts_forward)


def load_config(shard_dir: str | Path) -> MixtralConfig:
    with open(Path(shard_dir) / "config.json") as f:
        return MixtralConfig(**json.load(f))


def load_generation_config(shard_dir: str | Path) -> GenerationConfig | None:
    path = Path(shard_dir) / "generation_config.json"
    return GenerationConfig.from_pretrained(shard_dir) if path.exists() else None


def hf_name(name: str) -> str:
    """Checkpoint tensor name (the real release's layout) to the Transformers 5 module path."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def build_model(
    config: MixtralConfig, tensors: Iterable[tuple[str, torch.Tensor]], *, with_experts: bool
) -> MixtralForCausalLM:
    """A model whose weights are exactly ``tensors``; experts fused in only ``with_experts``."""
    with torch.device("meta"):
        model = MixtralForCausalLM._from_config(config)
    state: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in tensors:
        key = parse_expert_key(name)
        if key is None:
            state[hf_name(name)] = tensor
        elif with_experts:
            experts.setdefault(key.layer, {})[(key.expert, key.proj)] = tensor
    for layer, parts in experts.items():
        n = config.num_local_experts
        gate_up = torch.stack([torch.cat([parts[(e, "w1")], parts[(e, "w3")]], dim=0) for e in range(n)])
        down = torch.stack([parts[(e, "w2")] for e in range(n)])
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up  # [E, 2I, H]
        state[f"model.layers.{layer}.mlp.experts.down_proj"] = down  # [E, H, I]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"unexpected tensors in the shard: {sorted(unexpected)[:5]}")
    expert_params = {n for n in missing if ".mlp.experts." in n}
    if with_experts and expert_params:
        raise ValueError(f"the shard lacks expert tensors: {sorted(expert_params)[:5]}")
    other = set(missing) - expert_params
    if other:
        raise ValueError(f"the shard lacks tensors: {sorted(other)[:5]}")
    if not with_experts:
        for module in _experts_modules(model):
            # Main never holds expert weights: keep empty placeholders, not meta tensors.
            module.gate_up_proj = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            module.down_proj = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    # Non-persistent buffers (RoPE frequencies) were created on meta: build them for real.
    model.model.rotary_emb = MixtralRotaryEmbedding(config=model.config)
    model.eval()
    model.requires_grad_(False)
    return model


def cast_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` with floating ones cast to ``dtype`` (unchanged when it is None), one at a time."""
    for name, tensor in tensors:
        yield name, tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)


def build_main_model(
    shard_dir: str | Path, dispatcher: ExpertDispatcher, *, dtype: torch.dtype | None = None
) -> MixtralForCausalLM:
    """Main's model: everything but the experts, whose work goes to ``dispatcher``.

    Weights keep the checkpoint's dtype (what ``from_pretrained(dtype="auto")`` gives) unless
    ``dtype`` says otherwise.
    """
    config = load_config(shard_dir)
    model = build_model(config, cast_tensors(load_role_tensors(shard_dir), dtype), with_experts=False)
    for layer, module in enumerate(_experts_modules(model)):
        module._odmoe_layer = layer
        module._odmoe_dispatcher = dispatcher
    model.set_experts_implementation(REMOTE_EXPERTS)
    generation_config = load_generation_config(shard_dir)
    if generation_config is not None:
        model.generation_config = generation_config
    return model


def _experts_modules(model: MixtralForCausalLM) -> Iterator[MixtralExperts]:
    for layer in model.model.layers:
        yield layer.mlp.experts
