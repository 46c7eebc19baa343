"""Suggest main / shadow / worker roles for a set of nodes: a pure function, no database.

The shadow runs the whole model (quantized), so it gets the box with the most GPU memory;
main holds attention, routers and the KV cache, so it gets the next one; every other box
is a worker, and workers form groups of top-k (see ``inference.placement``). Boxes without
a GPU are ranked by RAM instead, after every box that has one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from inference.placement import placement

MIN_NODES = 3  # main, shadow and at least one worker


@dataclass(frozen=True)
class RoleMap:
    main: str
    shadow: str
    workers: tuple[str, ...]

    def as_dict(self) -> dict:
        return {"main": self.main, "shadow": self.shadow, "workers": list(self.workers)}


class RoleError(ValueError):
    """The nodes cannot form a deployment; the message says why."""


def capacity(inventory: Mapping) -> tuple[int, int]:
    """Sort key of a node: (total GPU memory, RAM), both in bytes."""
    gpu = sum(int(g.get("memory_bytes", 0)) for g in inventory.get("gpus", []) or [])
    return gpu, int(inventory.get("ram_bytes", 0) or 0)


def suggest_roles(inventories: Mapping[str, Mapping], *, top_k: int) -> RoleMap:
    """Roles for the nodes named in ``inventories`` (node id -> inventory)."""
    if len(inventories) < MIN_NODES:
        raise RoleError(
            f"a deployment needs at least {MIN_NODES} nodes (main, shadow, a worker), got {len(inventories)}"
        )
    ranked = sorted(inventories, key=lambda node: (capacity(inventories[node]), node), reverse=True)
    shadow, main, *workers = ranked
    roles = RoleMap(main=main, shadow=shadow, workers=tuple(sorted(workers)))
    placement(1, max(top_k, 1), top_k, len(roles.workers))  # validates the worker count for top-k
    return roles


def check_roles(roles: RoleMap, nodes: Sequence[str]) -> None:
    """Refuse an overridden role map that does not use each given node exactly once."""
    used = [roles.main, roles.shadow, *roles.workers]
    if len(set(used)) != len(used):
        raise RoleError("a node can hold only one role in a deployment")
    unknown = set(used) - set(nodes)
    if unknown:
        raise RoleError(f"nodes not in this deployment: {', '.join(sorted(unknown))}")
    if not roles.workers:
        raise RoleError("a deployment needs at least one worker")
