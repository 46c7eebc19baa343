"""Suggest main / shadow / worker roles for a set of nodes: a pure function, no database.

Roles take *seats*: a node with one GPU or none is one seat (its id); a node with several GPUs
is one seat per GPU (``<node id>:<cuda index>``), so one box with four GPUs can run main, the
shadow and two workers. The shadow runs the whole model (quantized), so it gets the seat with
the most GPU memory; main holds attention, routers and the KV cache, so it gets the next one;
every other seat is a worker, and workers form groups of top-k (see ``inference.policies.placement``).
Seats without a GPU are ranked by RAM instead, after every seat that has one.

Only a deployment whose predictor is the shadow has a shadow seat (``needs_shadow``): under
any other (main's next-layer router, or none at all) main takes the largest seat and every
other seat is a worker, so two seats are enough.

Given the deployment's memory plan (``inference.building.memory``), only a map where every seat can
hold its role is proposed: the shadow goes to the largest seat that holds it, main to the
next that holds main, and the rest must hold their workers' experts; roles on one node share
its RAM and disk, which is checked last. When no map fits, the error says which role no seat
could hold, and by how much the best candidate falls short.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from inference.building.fit import Placed, Shortfall, check_fit, check_plan_fit, gpu_indices
from inference.building.memory import MemoryPlan
from inference.policies.placement import placement
from inference.policies.strategies import predictor_for

MIN_SEATS = 3  # main, shadow and at least one worker
MIN_SEATS_WITHOUT_SHADOW = 2  # main and at least one worker

ShortFn = Callable[[str, str], list[Shortfall]]  # (seat, role) -> what the seat lacks for the role


@dataclass(frozen=True)
class RoleMap:
    """The seat of each role: ``<node id>`` or ``<node id>:<cuda index>``."""

    main: str
    shadow: str | None  # None: a deployment whose predictor is not the shadow has no shadow seat
    workers: tuple[str, ...]

    def as_dict(self) -> dict:
        return {"main": self.main, "shadow": self.shadow, "workers": list(self.workers)}

    def seats(self) -> dict[str, str]:
        """Role name (main, shadow unless there is none, worker-N) -> seat."""
        shadow = {} if self.shadow is None else {"shadow": self.shadow}
        return {"main": self.main} | shadow | {f"worker-{i}": w for i, w in enumerate(self.workers)}


class RoleError(ValueError):
    """The nodes cannot form a deployment; the message says why."""


def needs_shadow(strategy: str, predictor: str = "") -> bool:
    """Whether a deployment of ``strategy`` with ``predictor`` ("" = the strategy's own) has a shadow seat.

    ``ValueError`` for a combination the runtime refuses (``inference.policies.strategies.predictor_for``).
    """
    return predictor_for(strategy, predictor) == "shadow"


def fixed_seats(shadow: bool = True) -> int:
    """Seats that are not workers: main, and the shadow where there is one."""
    return 2 if shadow else 1


def seat(node: str, gpu: int | None = None) -> str:
    return node if gpu is None else f"{node}:{gpu}"


def parse_seat(text: str) -> tuple[str, int | None]:
    """(node id, GPU index or None) of a seat; ``RoleError`` for a malformed one."""
    node, sep, index = text.rpartition(":")
    if not sep:
        return text, None
    if not (node and index.isascii() and index.isdigit() and len(index) <= 3):
        raise RoleError(f"bad seat {text!r}: a node id, or a node id and a GPU index as <node>:<index>")
    return node, int(index)


def seats_of(inventories: Mapping[str, Mapping]) -> list[str]:
    """Every seat the nodes offer: one per GPU of a node with several, else one per node."""
    found: list[str] = []
    for node, inventory in inventories.items():
        indices = gpu_indices(inventory)
        found += [seat(node, i) for i in indices] if len(indices) > 1 else [node]
    return found


def seat_inventory(inventories: Mapping[str, Mapping], text: str) -> Mapping:
    """The node's inventory as one seat sees it: only its own GPU."""
    node, gpu = parse_seat(text)
    return Placed(node, inventories[node], gpu).view


def placed(inventories: Mapping[str, Mapping], roles: RoleMap, names: Mapping[str, str] | None = None) -> dict:
    """Role name -> ``inference.building.fit.Placed`` for the fit check of a whole map."""
    out = {}
    for role, text in roles.seats().items():
        node, gpu = parse_seat(text)
        out[role] = Placed((names or {}).get(node, node), inventories[node], gpu)
    return out


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
    shadow: bool = True,
) -> RoleMap:
    """Roles for the seats of the nodes named in ``inventories`` (node id -> inventory).

    ``shadow``: whether the deployment has a shadow seat (``needs_shadow``); without one, main
    takes the largest seat and every other seat is a worker. With ``memory`` (a plan for
    ``len(seats_of(inventories)) - fixed_seats(shadow)`` workers) only a map where every seat
    holds its role, and every node the roles it runs, is returned (the plan's shadow is not
    checked when there is no shadow seat); ``RoleError`` says which constraint no map met,
    naming nodes by ``names`` (node id -> name) where given.
    """
    seats = seats_of(inventories)
    least = MIN_SEATS if shadow else MIN_SEATS_WITHOUT_SHADOW
    if len(seats) < least:
        roles = "main, shadow, a worker" if shadow else "main, a worker"
        raise RoleError(f"a deployment needs at least {least} nodes or GPUs ({roles}), got {len(seats)}")
    views = {s: seat_inventory(inventories, s) for s in seats}
    ranked = sorted(seats, key=lambda s: (capacity(views[s]), s), reverse=True)
    n_workers = len(ranked) - fixed_seats(shadow)
    placement(1, max(top_k, 1), top_k, n_workers)  # validates the worker count for top-k
    if memory is None:
        if not shadow:
            main, *workers = ranked
            return RoleMap(main=main, shadow=None, workers=tuple(sorted(workers)))
        shadow_seat, main, *workers = ranked
        return RoleMap(main=main, shadow=shadow_seat, workers=tuple(sorted(workers)))
    if memory.n_workers != n_workers:
        raise ValueError(f"the memory plan is for {memory.n_workers} workers, the seats make {n_workers}")
    labels = {s: _label(s, names or {}) for s in seats}
    roles = _fitting_roles(ranked, views, memory, labels, shadow=shadow)
    problems = check_plan_fit(memory, placed(inventories, roles, names))
    if problems:  # each seat holds its role, but a node does not hold all of its roles together
        raise RoleError("no role map fits: " + "; ".join(p.message for p in problems))
    return roles


def _label(text: str, names: Mapping[str, str]) -> str:
    node, gpu = parse_seat(text)
    name = names.get(node, node)
    return name if gpu is None else f"{name} cuda:{gpu}"


def _fitting_roles(
    ranked: list[str],
    inventories: Mapping[str, Mapping],
    memory: MemoryPlan,
    names: Mapping[str, str],
    *,
    shadow: bool = True,
) -> RoleMap:
    """The first map, in order of preference, where every node holds its role."""
    checked: dict[tuple[str, str], list[Shortfall]] = {}

    def short(node: str, role: str) -> list[Shortfall]:
        if (node, role) not in checked:
            checked[node, role] = check_fit(memory.role(role), inventories[node], node=names.get(node, node))
        return checked[node, role]

    if not shadow:
        return _fitting_without_shadow(ranked, memory, short)
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


def _fitting_without_shadow(ranked: list[str], memory: MemoryPlan, short: ShortFn) -> RoleMap:
    """The first map without a shadow seat where every node holds its role: main on the largest that holds it."""
    worker_problems: list[Shortfall] | None = None
    for main in (node for node in ranked if not short(node, "main")):
        workers = _fitting_workers([node for node in ranked if node != main], memory, short)
        if isinstance(workers, tuple):
            return RoleMap(main=main, shadow=None, workers=workers)
        worker_problems = worker_problems or workers
    if worker_problems is None:
        raise RoleError(_nobody("main", ranked, short))
    raise RoleError(
        "no role map fits: with main on a node that holds it, " + "; ".join(s.message for s in worker_problems)
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


def check_roles(roles: RoleMap, inventories: Mapping[str, Mapping], *, shadow: bool = True) -> None:
    """Refuse an overridden role map that does not seat each role once on the given nodes.

    A node with one GPU or none holds one role; a node with several GPUs holds one role per
    GPU, each seat naming its GPU (``<node id>:<index>``), an index the node reported. The map
    has a shadow seat exactly when the deployment's predictor is the shadow (``shadow``).
    """
    if shadow and roles.shadow is None:
        raise RoleError("this deployment's predictor is the shadow: the role map needs a shadow seat")
    if not shadow and roles.shadow is not None:
        raise RoleError(
            "this deployment's predictor is not the shadow, so it has no shadow seat: "
            "leave the shadow out of the role map (its node can be a worker)"
        )
    used = list(roles.seats().values())
    if len(set(used)) != len(used):
        raise RoleError("a node (or one GPU of a node) can hold only one role in a deployment")
    parsed = [parse_seat(text) for text in used]
    unknown = {node for node, _ in parsed} - set(inventories)
    if unknown:
        raise RoleError(f"nodes not in this deployment: {', '.join(sorted(unknown))}")
    if not roles.workers:
        raise RoleError("a deployment needs at least one worker")
    by_node: dict[str, list[int | None]] = {}
    for node, gpu in parsed:
        by_node.setdefault(node, []).append(gpu)
    for node, gpus in by_node.items():
        reported = gpu_indices(inventories[node])
        if len(gpus) > 1 and None in gpus:
            raise RoleError(f"node {node} holds several roles: give each one of its GPUs as {node}:<index>")
        missing = sorted(g for g in gpus if g is not None and g not in reported)
        if missing:
            offered = ", ".join(map(str, reported)) or "none"
            raise RoleError(f"node {node} has no GPU {missing[0]} (it reported GPUs: {offered})")
