"""Suggest main / shadow / worker roles for a set of nodes: a pure function, no database.

The shadow runs the whole model (quantized), so it gets the box with the most GPU memory;
main holds attention, routers and the KV cache, so it gets the next one; every other box
is a worker, and workers form groups of top-k (see ``inference.placement``). Boxes without
a GPU are ranked by RAM instead, after every box that has one.

Given the deployment's memory plan (``inference.memory``), only a map where every node can
hold its role is proposed: the shadow goes to the largest box that holds it, main to the
next that holds main, and the rest must hold their workers' experts; when no map fits, the
error says which role no node could hold, and by how much the best candidate falls short.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from inference.memory import MemoryPlan, Shortfall, check_fit
from inference.placement import placement

MIN_NODES = 3  # main, shadow and at least one worker

ShortFn = Callable[[str, str], list[Shortfall]]  # (node, role) -> what the node lacks for the role


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


def suggest_roles(
    inventories: Mapping[str, Mapping],
    *,
    top_k: int,
    memory: MemoryPlan | None = None,
    names: Mapping[str, str] | None = None,
) -> RoleMap:
    """Roles for the nodes named in ``inventories`` (node id -> inventory).

    With ``memory`` (a plan for ``len(inventories) - 2`` workers) only a map where every
    node holds its role is returned; ``RoleError`` says which constraint no map met,
    naming nodes by ``names`` (node id -> name) where given.
    """
    if len(inventories) < MIN_NODES:
        raise RoleError(
            f"a deployment needs at least {MIN_NODES} nodes (main, shadow, a worker), got {len(inventories)}"
        )
    ranked = sorted(inventories, key=lambda node: (capacity(inventories[node]), node), reverse=True)
    placement(1, max(top_k, 1), top_k, len(ranked) - 2)  # validates the worker count for top-k
    if memory is None:
        shadow, main, *workers = ranked
        return RoleMap(main=main, shadow=shadow, workers=tuple(sorted(workers)))
    if memory.n_workers != len(ranked) - 2:
        raise ValueError(f"the memory plan is for {memory.n_workers} workers, the nodes make {len(ranked) - 2}")
    return _fitting_roles(ranked, inventories, memory, names or {})


def _fitting_roles(
    ranked: list[str], inventories: Mapping[str, Mapping], memory: MemoryPlan, names: Mapping[str, str]
) -> RoleMap:
    """The first map, in order of preference, where every node holds its role."""
    checked: dict[tuple[str, str], list[Shortfall]] = {}

    def short(node: str, role: str) -> list[Shortfall]:
        if (node, role) not in checked:
            checked[node, role] = check_fit(memory.role(role), inventories[node], node=names.get(node, node))
        return checked[node, role]

    shadows = [node for node in ranked if not short(node, "shadow")]
    if not shadows:
        raise RoleError(_nobody("shadow", ranked, short))
    worker_problems: list[Shortfall] | None = None
    for shadow in shadows:
        for main in (node for node in ranked if node != shadow and not short(node, "main")):
            workers = _fitting_workers([node for node in ranked if node not in (shadow, main)], memory, short)
            if isinstance(workers, tuple):
                return RoleMap(main=main, shadow=shadow, workers=workers)
            worker_problems = worker_problems or workers
    if worker_problems is None:
        raise RoleError(_nobody("main", [node for node in ranked if node != shadows[0]], short))
    raise RoleError(
        "no role map fits: with the shadow and main on nodes that hold them, "
        + "; ".join(s.message for s in worker_problems)
    )


def _fitting_workers(nodes: list[str], memory: MemoryPlan, short: ShortFn) -> tuple[str, ...] | list[Shortfall]:
    """Worker nodes in index order when they hold their experts (the shortfalls otherwise).

    Workers keep the usual order (sorted by id); when that does not fit, the largest
    workers go to the largest nodes.
    """
    ordered = sorted(nodes)
    problems = [s for i, node in enumerate(ordered) for s in short(node, f"worker-{i}")]
    if not problems:
        return tuple(ordered)
    by_need = sorted(range(len(nodes)), key=lambda i: (-memory.role(f"worker-{i}").host_bytes, i))
    matched = dict(zip(by_need, nodes, strict=True))  # ``nodes`` is ranked largest first
    if not any(short(matched[i], f"worker-{i}") for i in matched):
        return tuple(matched[i] for i in range(len(nodes)))
    return problems


def _nobody(role: str, nodes: list[str], short: ShortFn) -> str:
    """Why no node holds ``role``: the smallest shortfall among the candidates."""
    best = min(nodes, key=lambda node: sum(s.short_bytes for s in short(node, role)))
    reasons = "; ".join(s.message for s in short(best, role))
    return f"no node can hold the {role}; the closest: {reasons}"


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
