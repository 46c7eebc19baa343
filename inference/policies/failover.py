"""Who computes a lost worker's share: a pure decision, no sockets.

Every worker of a decode group keeps every expert of the group's layers in its store
(``inference.policies.placement``), and a layer's prefill experts are among them. So when a worker
is gone, each expert it was given for a layer can go to a surviving worker of that layer's
group; the one with the fewest experts of the layer so far takes it (ties: the lowest
index), so the work spreads over the survivors. Only when every worker of a group is gone
can its layers no longer be served.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


class NoSurvivor(RuntimeError):
    """Every worker that holds a layer's experts is gone; the message names them."""


def survivors(holders: Sequence[int], lost: Collection[int], layer: int) -> list[int]:
    alive = [w for w in holders if w not in lost]
    if not alive:
        names = ", ".join(f"worker-{w}" for w in holders)
        raise NoSurvivor(f"layer {layer} cannot be served: every worker that holds its experts is gone ({names})")
    return alive


def reroute(
    assignment: dict[int, list[int]],
    candidates: Sequence[int],
    lost: Collection[int],
    holders: Sequence[int],
    layer: int,
) -> tuple[dict[int, list[int]], list[int]]:
    """``dispatch_plan``'s (experts by worker, workers to tell) without the ``lost`` workers.

    Each expert of a lost worker goes to the surviving holder with the fewest experts.
    """
    if not any(w in lost for w in (*assignment, *candidates)):
        return assignment, list(candidates)
    alive = survivors(holders, lost, layer)
    plan = {w: sorted(experts) for w, experts in assignment.items() if w not in lost}
    orphans = sorted(e for w, experts in assignment.items() if w in lost for e in experts)
    for expert in orphans:
        taker = min(alive, key=lambda w: (len(plan.get(w, [])), w))
        plan.setdefault(taker, []).append(expert)
    plan = {w: sorted(experts) for w, experts in plan.items()}
    told = [w for w in candidates if w not in lost]
    told += [w for w in sorted(plan) if w not in told]
    return plan, told


def taker(holders: Sequence[int], lost: Collection[int], load: dict[int, int], layer: int) -> int:
    """The surviving holder that takes a lost worker's requests in flight: the least loaded."""
    return min(survivors(holders, lost, layer), key=lambda w: (load.get(w, 0), w))
