"""Expert-placement strategies behind one scheduler interface, as pure decisions.

The exact strategies compute the same experts on the same rows; they differ only in what a
worker keeps on its device and who tells it what to load ahead:

- ``odmoe`` (default): cacheless. The shadow predicts each future layer's experts, the
  layer group's workers load them just in time and free each one as soon as it is used.
- ``full-cache``: every expert a worker serves is copied to its device once, at start,
  and stays there: the speed ceiling, at the cost of holding the whole model on the GPUs.
- ``reactive``: cacheless without prediction: a worker loads an expert only after main's
  router picked it, so every load sits on the critical path (the floor).
- ``lru-offload``: what Mixtral-Offloading (Eliseev & Mazur, 2023) does: each worker keeps
  the last ``cache_experts`` experts it used per layer on the device (least recently used
  out first) and main applies the *next* layer's router to the current hidden state to
  prefetch a guess of the next layer's experts.
- ``importance`` (approximate; ``inference.runtime.importance``): the caches of ``lru-offload``
  without prediction, and a low-importance routed expert that is not resident is replaced by
  the most similar resident one (Zhu et al. 2025).
- ``prerouter`` (approximate; ``inference.runtime.prerouter``): Edge0's trained heads on main name
  each layer's experts before its input exists, and that prediction *is* the routing, so
  workers (cacheless, as odmoe) compute exactly what they staged: no late experts.

The exact strategies that load ahead take any predictor (``PREDICTORS``, ``predictor_for``):
odmoe with ``next-gate`` or ``prerouter`` runs without a shadow node, on main's own guess.
A strategy whose routing is its prediction takes no other predictor.

With a cache, an expert must always go to the same worker, so the strategies that cache
give each expert a fixed *home* in its layer's group (``home_worker``), in prefill too;
the cacheless ones deal experts to whoever loaded them (``assignment.assign_experts``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from inference.constants import PREROUTER_FILE, SIMILARITY_FILE
from inference.policies import assignment
from inference.policies.placement import Placement

STRATEGIES = ("odmoe", "full-cache", "reactive", "lru-offload")  # exact: every token Transformers' own
# Approximate: they compute other experts than the routed ones for speed (the runtime and the
# platform serve them, marked so; the simulator models only the exact ones).
APPROXIMATE_STRATEGIES = ("importance", "prerouter")
RUNTIME_STRATEGIES = STRATEGIES + APPROXIMATE_STRATEGIES
DEFAULT_STRATEGY = "odmoe"
# Who names the experts a worker loads ahead (``DeploymentSettings.predictor``): the shadow, a whole
# model of its own on a node of its own that runs ahead of main; or ``next-gate``, main itself,
# applying the next layer's router to the current layer's input (no node, one layer of lead);
# or ``prerouter``, main's trained heads (``inference.runtime.prerouter``; no node, one layer of lead).
PREDICTORS = ("shadow", "next-gate", "prerouter")
# What a predictor needs beside the checkpoint's weights, and the command that makes it.
PREDICTOR_NEEDS = {"prerouter": ((PREROUTER_FILE, "python -m inference train-prerouter"),)}

LayerExpert = tuple[int, int]


@dataclass(frozen=True)
class Strategy:
    name: str
    predictor: str | None  # its own predictor (one of PREDICTORS), or None: it loads nothing ahead
    cache: str  # "none" (free after use), "all" (everything resident), "lru" (per-layer LRU)
    exact: bool = True  # computes exactly the routed experts (importance substitutes some)
    substitutes: bool = False  # swaps unimportant experts for held similar ones (importance)
    routes_by_prediction: bool = False  # its predictor's choice is the routing (prerouter)
    # Files it needs beside the checkpoint's weights, each with the command that makes it.
    needs: tuple[tuple[str, str], ...] = ()
    expert_store: str = "ram"  # where its workers keep their experts unless a deployment says (EXPERT_STORES)

    @property
    def fixed_homes(self) -> bool:
        """Whether each expert always goes to the same worker (needed for any cache)."""
        return self.cache != "none"


_BY_NAME = {
    "odmoe": Strategy("odmoe", predictor="shadow", cache="none"),
    "full-cache": Strategy("full-cache", predictor=None, cache="all"),
    "reactive": Strategy("reactive", predictor=None, cache="none"),
    "lru-offload": Strategy("lru-offload", predictor="next-gate", cache="lru"),
    "importance": Strategy(
        "importance",
        predictor=None,
        cache="lru",
        exact=False,
        substitutes=True,
        needs=((SIMILARITY_FILE, "python -m inference calibrate"),),
    ),
    "prerouter": Strategy(
        "prerouter",
        predictor="prerouter",
        cache="none",
        exact=False,
        routes_by_prediction=True,  # needs its predictor's file (PREDICTOR_NEEDS)
        expert_store="hot",  # Edge0 streams experts from the SSD, a hot set in RAM
    ),
}


def get_strategy(name: str) -> Strategy:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"strategy must be one of {', '.join(RUNTIME_STRATEGIES)}, got {name!r}") from None


def predictor_for(strategy: str, chosen: str = "") -> str | None:
    """Who predicts under ``strategy`` when ``chosen`` is asked for ("" = the strategy's own).

    A strategy that loads nothing ahead takes no predictor: asking for one is an error.
    """
    own = get_strategy(strategy).predictor
    if not chosen:
        return own
    if chosen not in PREDICTORS:
        raise ValueError(f"predictor must be one of {', '.join(PREDICTORS)}, got {chosen!r}")
    if own is None:
        raise ValueError(f"{strategy} loads only what is routed and takes no predictor, got {chosen!r}")
    if get_strategy(strategy).routes_by_prediction and chosen != own:
        raise ValueError(f"{strategy} routes by its own {own} and takes no other predictor, got {chosen!r}")
    return chosen


def expert_store_for(strategy: str, chosen: str = "") -> str:
    """Where workers keep their experts under ``strategy``: ``chosen``, or "" for the strategy's own."""
    return chosen or get_strategy(strategy).expert_store


def needed_files(strategy: str, predictor: str = "") -> list[tuple[str, str]]:
    """(file, command that makes it) for everything ``strategy`` with ``predictor`` needs beside the
    checkpoint's weights, in main's shard."""
    needs = list(get_strategy(strategy).needs)
    for need in PREDICTOR_NEEDS.get(predictor_for(strategy, predictor) or "", ()):
        if need not in needs:
            needs.append(need)
    return needs


def home_worker(expert: int, members: Sequence[int]) -> int:
    """The worker of a layer's group that always computes ``expert`` under a caching strategy."""
    return members[expert % len(members)]


def home_experts(placement: Placement, worker: int) -> list[LayerExpert]:
    """Every (layer, expert) ``worker`` is home to, in the order a forward pass needs them."""
    members = placement.groups[placement.group_of_worker(worker)]
    return [
        (layer, expert)
        for layer in placement.decode_layers(worker)
        for expert in range(placement.n_experts)
        if home_worker(expert, members) == worker
    ]


def dispatch_plan(
    strategy: Strategy,
    placement: Placement,
    step: int,
    layer: int,
    real: Iterable[int],
    predicted: Sequence[int] | None,
) -> tuple[dict[int, list[int]], list[int]]:
    """Who computes each really-routed expert of ``layer`` at ``step``, and who must hear of it.

    Returns (experts by worker, the workers main sends a request to — an empty one tells
    a worker that the layer is served, so it frees what it loaded for it).
    """
    if strategy.fixed_homes:
        members = placement.workers_for_layer(layer)
        plan: dict[int, list[int]] = {m: [] for m in members}
        for expert in sorted(set(real)):
            plan[home_worker(expert, members)].append(expert)
        return plan, list(members)
    if step == 0:
        return assignment.assign_prefill(real, placement), assignment.prefill_candidates(placement)
    members = list(placement.workers_for_layer(layer))
    return assignment.assign_experts(real, predicted, members), members


def prefetch_on_prediction(
    strategy: Strategy, predicted: Sequence[int], members: Sequence[int], worker: int
) -> list[int]:
    """Which of a layer's predicted experts ``worker`` should load ahead."""
    if strategy.fixed_homes:
        return sorted({e for e in predicted if home_worker(e, members) == worker})
    return sorted(assignment.prefetch_assignment(predicted, members).get(worker, []))


def prefill_prefetch(strategy: Strategy, placement: Placement, worker: int) -> list[LayerExpert]:
    """(layer, expert) pairs ``worker`` computes during prefill, in the order needed."""
    if strategy.fixed_homes:
        return home_experts(placement, worker)
    return assignment.prefill_prefetch_order(placement, worker)


def lru_evictions(order: Sequence[LayerExpert], layer: int, capacity: int) -> list[LayerExpert]:
    """Which cached experts of ``layer`` to free so it keeps at most ``capacity``.

    ``order`` lists the cached (layer, expert) pairs from least to most recently used.
    """
    of_layer = [key for key in order if key[0] == layer]
    excess = len(of_layer) - max(0, capacity)
    return of_layer[:excess] if excess > 0 else []


def lru_resident(uses: Iterable[LayerExpert], capacity: int) -> list[LayerExpert]:
    """What a per-layer LRU cache of ``capacity`` experts holds after ``uses``, least recently used
    first: each (layer, expert) admitted in turn as it is released, ``lru_evictions`` deciding what
    goes (the state prefill leaves ``lru-offload``'s caches in)."""
    order: list[LayerExpert] = []
    for key in uses:
        if key in order:
            order.remove(key)
        order.append(key)
        for victim in lru_evictions(order, key[0], capacity):
            order.remove(victim)
    return order
