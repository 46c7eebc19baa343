"""The model families odmoe serves, one adapter module each, behind one registry.

``family_for(config)`` picks the adapter by the config's ``model_type`` and checks the config
can be served; ``FAMILIES`` lists them (README's table of supported families).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inference.modelio.families.base import SHARD_EXPERT_RE, SHARD_PROJS, ExpertSource, Family, FamilyError
from inference.modelio.families.granitemoe import GraniteMoe
from inference.modelio.families.mixtral import Mixtral
from inference.modelio.families.olmoe import Olmoe
from inference.modelio.families.qwen2_moe import Qwen2Moe
from inference.modelio.families.qwen3_moe import Qwen3Moe

FAMILIES: dict[str, Family] = {f.model_type: f for f in (Mixtral(), Qwen2Moe(), Qwen3Moe(), Olmoe(), GraniteMoe())}

__all__ = [
    "FAMILIES",
    "SHARD_EXPERT_RE",
    "SHARD_PROJS",
    "ExpertSource",
    "Family",
    "FamilyError",
    "family_for",
    "is_router_name",
]


def is_router_name(name: str) -> bool:
    """Whether a tensor name is a router's weight in any supported family's release."""
    return any(family.is_router(name) for family in FAMILIES.values())


def family_for(config: Mapping[str, Any], *, check: bool = True) -> Family:
    """The adapter of ``config``'s family; ``FamilyError`` says why a config cannot be served."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        known = ", ".join(repr(name) for name in FAMILIES)
        raise FamilyError(f"model_type is {model_type!r}; the supported MoE families are {known}")
    if check:
        family.check(config)
    return family
