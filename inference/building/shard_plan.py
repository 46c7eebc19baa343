"""What a shard build will write, decided before a byte is written.

``plan_shards`` reads the checkpoint's headers (never a tensor), places the experts on the
workers, and gives each role of the set its share (``RoleShare``): the checkpoint tensors its
shard holds, the tensor bytes it will hold (a pre-converted shadow's in its dtype), a worker's
experts and how it stores them. ``plan_shadow_shards`` plans the pre-converted shadows added to
a set already built. A damaged or incomplete source fails here, before any output.

The plan is a value: ``inference.building.shard_writer`` writes what it says, and
``inference.building.sharding`` runs the two. Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference.building.tensor_sizes import checkpoint_tensors, shadow_weight_bytes
from inference.modelio.checkpoint import EXPERT_PROJS, Checkpoint, CheckpointError, expert_key_name, expert_keys
from inference.modelio.shards import Role, ShardSet, shard_roles
from inference.policies.placement import LayerExpert, Placement, placement


@dataclass(frozen=True)
class RoleShare:
    """One role's shard as planned: written at ``directory``, holding the checkpoint tensors
    ``keys`` (``nbytes`` of tensors once written), a worker's ``experts`` ((layer, expert) pairs;
    None for main and the shadows), its experts stored by ``expert_codec``."""

    role: Role
    directory: Path
    keys: tuple[str, ...]
    nbytes: int
    experts: tuple[LayerExpert, ...] | None = None
    expert_codec: str = "none"


@dataclass(frozen=True)
class ShardPlan:
    """A shard set's build: the shares to write (``shares``), reading ``read_bytes`` of the
    checkpoint, and what the set's index and every manifest record: the placement, the model's
    summary, the set's roles once built (``roles``, the shares' and any already there) and its
    pre-converted shadows."""

    root: Path
    placement: Placement
    model: dict[str, Any]
    shares: tuple[RoleShare, ...]
    roles: tuple[Role, ...]
    shadow_dtypes: tuple[str, ...]
    expert_codec: str
    read_bytes: int

    @property
    def written_bytes(self) -> int:
        """Tensor bytes the build writes (what the disk must have room for, and a little framing)."""
        return sum(share.nbytes for share in self.shares)

    def shard_set(self) -> ShardSet:
        """The set once the plan is written."""
        return ShardSet(self.root, self.placement, self.model, self.shadow_dtypes, self.expert_codec)


def plan_shards(
    ckpt: Checkpoint, root: Path, workers: int, shadow_dtypes: tuple[str, ...] = (), expert_codec: str = "none"
) -> ShardPlan:
    """The build of ``ckpt``'s shard set at ``root`` for ``workers`` workers, with a shadow shard
    pre-converted to each of ``shadow_dtypes`` and the workers' experts stored by ``expert_codec``.

    Raises ``CheckpointError`` (or ``ValueError`` from a header) for a source that cannot be sharded.
    """
    check_experts_present(ckpt)
    layout = placement(ckpt.n_layers, ckpt.n_experts, ckpt.top_k, workers)
    owned = {worker: tuple(sorted(layout.owned(worker))) for worker in range(workers)}
    roles = shard_roles(workers, shadow_dtypes)
    tensors = checkpoint_tensors(ckpt)  # sizing reads every header, so a damaged source file fails here
    shares, read = [], 0
    for role in roles:
        experts = owned[role.worker] if role.worker is not None else None
        if experts is not None:
            keys = expert_keys(experts)
        else:
            keys = ckpt.keys() if role.role == "shadow" else ckpt.dense_keys()
        source = sum(ckpt.nbytes(key) for key in keys)
        nbytes = source if role.shadow_dtype is None else shadow_weight_bytes(tensors, role.shadow_dtype)
        codec = expert_codec if experts is not None else "none"
        shares.append(RoleShare(role, root / role.dirname, tuple(keys), nbytes, experts, codec))
        read += source
    return ShardPlan(root, layout, model_summary(ckpt), tuple(shares), roles, shadow_dtypes, expert_codec, read)


def plan_shadow_shards(ckpt: Checkpoint, shard_set: ShardSet, shadow_dtypes: Sequence[str]) -> ShardPlan:
    """The pre-converted shadow shards of ``shadow_dtypes`` added to ``shard_set``, built from ``ckpt``
    (each reads the whole checkpoint once)."""
    keys = tuple(ckpt.keys())
    tensors = checkpoint_tensors(ckpt)
    roles = [Role("shadow", shadow_dtype=dtype) for dtype in shadow_dtypes]
    shares = tuple(
        RoleShare(role, shard_set.root / role.dirname, keys, shadow_weight_bytes(tensors, role.shadow_dtype))
        for role in roles
    )
    dtypes = (*shard_set.shadow_dtypes, *shadow_dtypes)
    return ShardPlan(
        shard_set.root,
        shard_set.placement,
        shard_set.model,
        shares,
        tuple(shard_roles(shard_set.placement.n_workers, dtypes)),
        dtypes,
        shard_set.expert_codec,
        len(shares) * sum(ckpt.nbytes(key) for key in keys),
    )


def check_experts_present(ckpt: Checkpoint) -> None:
    """Refuses a checkpoint missing an expert's projection, or holding one of another shape than
    its config's: a worker shard silently missing an expert would only fail mid-generation."""
    want = ckpt.family.projection_shapes(ckpt.config)
    missing = []
    for layer in range(ckpt.n_layers):
        for expert in range(ckpt.n_experts):
            for proj in EXPERT_PROJS:
                key = expert_key_name(layer, expert, proj)
                if key not in ckpt:
                    missing.append((layer, expert, proj))
                elif ckpt.shape(key) != want[proj]:  # a fused tensor's whole shape is checked here too
                    raise CheckpointError(
                        f"expert {expert} of layer {layer}: its {_PROJ_WORDS[proj]} is {list(ckpt.shape(key))}, "
                        f"the config says {list(want[proj])}"
                    )
    if missing:
        layer, expert, proj = missing[0]
        source = ckpt.expert_source(expert_key_name(layer, expert, proj))
        where = f" (looked for {source.name!r})" if source is not None else ""
        raise CheckpointError(
            f"{len(missing)} expert projection(s) are missing, e.g. expert {expert}'s {_PROJ_WORDS[proj]} in "
            f"layer {layer}{where}; expected the {ckpt.family.model_type} release's expert layout"
        )


_PROJ_WORDS = {"w1": "w1 (gate)", "w2": "w2 (down)", "w3": "w3 (up)"}


def model_summary(ckpt: Checkpoint) -> dict[str, Any]:
    """The model as a shard set's index describes it."""
    return {
        "model_type": ckpt.config.get("model_type"),
        "layers": ckpt.n_layers,
        "experts": ckpt.n_experts,
        "top_k": ckpt.top_k,
        "hidden": ckpt.hidden_size,
    }
