"""Build the Transformers model that a role runs, from its shard, for any supported family.

Transformers is the reference implementation, so main and the shadow reuse its model code
(the family's own class: ``inference.modelio.families``) for everything but the routed experts:
main's experts are computed remotely (main's engine runs the model layer by layer and hands
each layer's routed rows to the workers: ``inference.runtime.engine``; the ``odmoe_remote`` experts
implementation only refuses a whole-model call, which would have no experts to run),
the shadow's are local and quantized. Weights come from the role's verified shard one
tensor at a time and are assigned into a model first built on the meta device, so main
never allocates the expert weights it does not hold. Shards keep every non-expert tensor
under its release name (the family maps it to its module path) and the routed experts in the
shard layout (``inference.modelio.checkpoint``), fused here into the experts module's
``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] as Transformers fuses them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from inference.modelio.checkpoint import parse_expert_key
from inference.modelio.families import Family, family_for
from inference.modelio.shards import load_role_tensors

REMOTE_EXPERTS = "odmoe_remote"


def _remote_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    raise RuntimeError(
        f"main holds no expert weights: layer {self._odmoe_layer}'s experts are served by main's engine "
        "(inference.runtime.engine.runner), which runs the model layer by layer, not by calling the whole model"
    )


ALL_EXPERTS_FUNCTIONS.register(REMOTE_EXPERTS, _remote_experts_forward)


def load_config(shard_dir: str | Path) -> PretrainedConfig:
    """The shard's ``config.json`` as its family's Transformers config."""
    with open(Path(shard_dir) / "config.json") as f:
        data = json.load(f)
    return family_for(data).config_class()(**data)


def family_of(config: PretrainedConfig) -> Family:
    """The adapter of a Transformers config's family."""
    return family_for(config.to_dict(), check=False)


def expert_dims(config: PretrainedConfig) -> tuple[int, int]:
    """(routed experts, a routed expert's intermediate size) of a Transformers config."""
    data, family = config.to_dict(), family_of(config)
    return family.n_experts(data), family.expert_intermediate(data)


def load_generation_config(shard_dir: str | Path) -> GenerationConfig | None:
    path = Path(shard_dir) / "generation_config.json"
    return GenerationConfig.from_pretrained(shard_dir) if path.exists() else None


def skeleton(config: PretrainedConfig) -> PreTrainedModel:
    """The family's model on the meta device: modules, names and shapes, no memory."""
    with torch.device("meta"):
        return family_of(config).model_class()._from_config(config)


def build_model(
    config: PretrainedConfig, tensors: Iterable[tuple[str, torch.Tensor]], *, with_experts: bool
) -> PreTrainedModel:
    """A model whose weights are exactly ``tensors``; experts fused in only ``with_experts``."""
    family = family_of(config)
    model = skeleton(config)
    state: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in tensors:
        key = parse_expert_key(name)
        if key is None:
            state[family.hf_name(name)] = tensor
        elif with_experts:
            experts.setdefault(key.layer, {})[(key.expert, key.proj)] = tensor
    n_experts, _ = expert_dims(config)
    for layer, parts in experts.items():
        gate_up = torch.stack([torch.cat([parts[(e, "w1")], parts[(e, "w3")]], dim=0) for e in range(n_experts)])
        down = torch.stack([parts[(e, "w2")] for e in range(n_experts)])
        state[f"{family.experts_path(layer)}.gate_up_proj"] = gate_up  # [E, 2I, H]
        state[f"{family.experts_path(layer)}.down_proj"] = down  # [E, H, I]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"unexpected tensors in the shard: {sorted(unexpected)[:5]}")
    expert_params = {n for n in missing if n.rpartition(".")[0].endswith(".experts")}
    if with_experts and expert_params:
        raise ValueError(f"the shard lacks expert tensors: {sorted(expert_params)[:5]}")
    # A tied LM head (tie_word_embeddings) is the embedding itself: no tensor of its own.
    tied = set(model.all_tied_weights_keys)
    other = set(missing) - expert_params - tied
    if other:
        raise ValueError(f"the shard lacks tensors: {sorted(other)[:5]}")
    if tied:
        model.tie_weights(recompute_mapping=False)
    if not with_experts:
        for module in experts_modules(model):
            # Main never holds expert weights: keep empty placeholders, not meta tensors.
            module.gate_up_proj = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            module.down_proj = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    rebuild_rotary(model)
    model.eval()
    model.requires_grad_(False)
    return model


def cast_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` with floating ones cast to ``dtype`` (unchanged when it is None), one at a time."""
    for name, tensor in tensors:
        yield name, tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)


def rebuild_rotary(model: PreTrainedModel, device: torch.device | str = "cpu") -> None:
    """Non-persistent buffers (RoPE frequencies) were created on meta: build them for real."""
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config).to(device)


def build_main_model(shard_dir: str | Path, *, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Main's model: everything but the experts, which main's engine serves with the workers.

    Weights keep the checkpoint's dtype (what ``from_pretrained(dtype="auto")`` gives) unless
    ``dtype`` says otherwise.
    """
    config = load_config(shard_dir)
    model = build_model(config, cast_tensors(load_role_tensors(shard_dir), dtype), with_experts=False)
    for layer, module in enumerate(experts_modules(model)):
        module._odmoe_layer = layer
    model.set_experts_implementation(REMOTE_EXPERTS)
    generation_config = load_generation_config(shard_dir)
    if generation_config is not None:
        model.generation_config = generation_config
    return model


def experts_modules(model: PreTrainedModel) -> Iterator[torch.nn.Module]:
    """Each decoder layer's experts module, in layer order."""
    family = family_of(model.config)
    for decoder in model.model.layers:
        yield family.experts(decoder)


def routers(model: PreTrainedModel) -> Iterator[torch.nn.Module]:
    """Each decoder layer's router (called on [T, H]: logits, top-k weights, top-k indices), in layer order."""
    family = family_of(model.config)
    for decoder in model.model.layers:
        yield family.router(decoder)
