"""Our runtime's cluster on one machine under an emulated profile, event by event: its workers'
loaders, its links, the shadow's predictions and main's dispatch (``ClusterSim``), on one clock.

`inference.sim`'s strategy models describe the *paper's* systems on real GPUs (Transformers with
`device_map`, Mixtral-Offloading's HQQ experts). To be checked against our own measured runs, the
simulator also needs a model of what *our* runtime does on *this* machine when
`inference.tools.emulation` slows its copies and links down to a profile's proportions. That is this
module, with two drivers: `inference.sim.local` walks a recorded routing trace through it, and
`inference.tools.engine_clock` runs main's real engine on its clock. Every rule here is the
runtime's own, not a fit, and every decision is taken by the runtime's own pure function
(`inference.policies`), called from here:

- groups: layer ``l`` belongs to group ``l mod G``, ``G = max(1, min(W // top_k, L))``
  (`inference.policies.placement.placement`);
- cacheless strategies deal predicted experts round-robin over the group and send each routed expert
  to whoever loaded it, the rest to the least loaded; caching strategies send expert ``e`` to
  ``members[e % len(members)]`` (main: `inference.policies.strategies.dispatch_plan`; a worker's
  prefetch on a prediction: `prefetch_on_prediction`); full-cache holds each worker's
  `home_experts`, lru-offload starts from what prefill left in its caches (`lru_resident`);
- a worker's loader (`inference.runtime.loader.ExpertLoader`; here `inference.sim.loader_sim`): one
  copy at a time (a batch of one (step, layer)'s pending experts per pass, each usable when its own
  copy is done: `inference.policies.loads.take_batch`), at most ``max_resident`` experts ready or being copied
  (cached ones do not count), prefetches in (step, layer) order, a request for an expert not yet
  copied jumps the queue and pushes out the idle prefetch needed last (`pick_victim`), an expert is
  freed (or admitted to the per-layer LRU cache, `inference.policies.strategies.lru_evictions`) as
  soon as its rows are computed, a request drops the stale prefetches of earlier layers
  (`keep_on_request`, and a prediction those of its own layer it no longer names: `keep_on_prediction`);
- the worker handles its messages one at a time, in arrival order (one thread);
- ``odmoe``: the shadow runs one token ahead: it starts step ``s + 1`` once it has finished step
  ``s`` and main has started step ``s``, and sends each layer's routing to the layer's group as
  it goes; ``lru-offload``: main sends the next layer's router guess before the layer's
  requests (`MainRole._predict_next_layer`), on one box (no emulated link);
- the emulated link (`inference.runtime.transport`): a message leaves after the sender's earlier ones
  have left its uplink (``bytes / rate`` each) and is delivered ``latency`` after its last byte
  (plus how late the receiver's timed wait for that moment wakes up, measured), or when it
  really arrives over loopback, whichever is later; a worker's own Python around its experts
  comes after the delivery, never under the latency;
- hybrid execution (``hybrid=True``, `inference.policies.hybrid`): when main's request reaches a worker,
  each requested expert not on the device runs where it finishes first — its copy (what is left
  of it) plus the compute, or the worker's CPU straight from host memory — and a copy not yet
  started for an expert sent to the CPU is dropped; under odmoe a worker also leaves the predicted
  experts of the (step, layer)s its group plans on the CPUs uncopied (`inference.policies.hybrid.
  planned_on_cpu`), the share set by the runtime's controller (`ShareController`, its ceiling
  from the emulated rates) from the simulated tokens' periods.

What it needs measured (`MachineCosts`, by `benchmarks.sim_prediction` before a run) is this
machine's own time for what the emulation does not scale: main's layer, the per-layer Python
around the experts, a message over loopback, and an expert's compute — measured in a running
main + one worker of the runtime (`benchmarks.sim_prediction.measure_in_rhythm`), so that each
cost holds what it costs right after a wait, as in a cluster. What it does not model, and is
therefore a known source of error: CPU contention between the roles that share this machine's
cores (main, shadow and workers are assumed to each have a core when they compute), a worker's
slower compute after the longer idle of a larger cluster (the measuring worker computes every
layer), the shadow's speed beyond its own layer times, and the tails of process wake-ups (the
costs are medians; the decode rate is a mean).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import asdict, dataclass, field
from fractions import Fraction

from inference.policies.hybrid import ShareController, planned_on_cpu, predicted_share, share_delay
from inference.policies.loads import keep_on_prediction, keep_on_request
from inference.policies.placement import Placement, placement
from inference.policies.strategies import (
    STRATEGIES,
    dispatch_plan,
    get_strategy,
    home_experts,
    lru_resident,
    prefetch_on_prediction,
)
from inference.settings import DeploymentSettings
from inference.sim.loader_sim import LoaderSim

# A routing trace of one generation: per decode step, per layer, the routed experts.
Trace = list[list[list[int]]]


@dataclass(frozen=True)
class MachineCosts:
    """Seconds on this machine, measured, for what the emulation leaves at this machine's speed."""

    expert_compute_s: float  # one expert for one decode row on a worker (Emulation.expert_compute_here_s)
    main_layer_s: float  # main's attention, norms and router of one decode layer
    main_dispatch_s: float  # main's Python per layer around the experts: split, requests, combine
    round_trip_s: float  # an expert request and its result through two processes' endpoints
    step_fixed_s: float  # main's time per token outside its layers (embedding, final norm, LM head)
    # A worker's own Python around its load wait + compute (checks, the loader's calls, the
    # answer): after the request is handed to it, so never hidden under an emulated link's latency.
    worker_python_s: float = 0.0
    # Of main's Python per layer, the part before its requests leave (split, plan, build, send),
    # where it is known apart; ``main_dispatch_s`` is then the part after the answers.
    main_before_send_s: float = 0.0
    # How late an emulated link's held message is handed out after its delivery time (the
    # transport releases it from a timed wait, which wakes up late).
    hold_wake_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
        if self.expert_compute_s <= 0:
            raise ValueError("expert_compute_s must be positive")

    @property
    def one_way_s(self) -> float:
        return self.round_trip_s / 2

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EmulatedRates:
    """The token buckets of `inference.tools.emulation.Emulation` (bytes/s, s), and the model's message sizes."""

    copy_bytes_per_s: float
    link_bytes_per_s: float | None  # None: no emulated network (one box)
    link_latency_s: float
    expert_bytes: int
    request_bytes: int  # a decode request carrying one row (header + row + weight)
    result_bytes: int
    align_bytes: int = 0  # main -> shadow per token (token + the new KV entries of every layer)
    prediction_bytes: int = 64
    host_memory_bytes_per_s: float | None = None  # hybrid execution's CPU path, emulated
    host_flops: float | None = None
    expert_flops: float = 0.0  # one row through one expert
    # A coded expert (``expert_codec``): the bytes the emulated copy carries (None: ``expert_bytes``)
    # and the seconds this machine's CPU takes to decode one, measured: the loader decodes it as its
    # copy starts, one after the other (``inference.runtime.loader``).
    stored_bytes: int | None = None
    decode_s: float = 0.0

    def __post_init__(self) -> None:
        if self.copy_bytes_per_s <= 0 or self.expert_bytes <= 0:
            raise ValueError("copy bandwidth and expert bytes must be positive")
        if self.link_bytes_per_s is not None and self.link_bytes_per_s <= 0:
            raise ValueError("link bandwidth must be positive (or None for no emulated link)")
        if (self.stored_bytes is not None and self.stored_bytes <= 0) or self.decode_s < 0:
            raise ValueError("stored bytes must be positive and decode time not negative")

    @property
    def copy_s(self) -> float:
        """One expert's load: its decode here (if coded), then its stored bytes over the emulated copy."""
        stored = self.expert_bytes if self.stored_bytes is None else self.stored_bytes
        return self.decode_s + stored / self.copy_bytes_per_s


@dataclass(frozen=True)
class Shape:
    """The benchmark's model and deployment."""

    layers: int
    experts: int
    top_k: int
    workers: int
    max_resident: int = 2
    cache_experts: int = 2  # lru-offload: experts cached per layer

    def __post_init__(self) -> None:
        if min(self.layers, self.experts, self.top_k, self.workers, self.max_resident) < 1:
            raise ValueError("layers, experts, top_k, workers and max_resident must be at least 1")
        if self.top_k > self.experts:
            raise ValueError("top_k cannot exceed experts")

    def placement(self) -> Placement:
        """The runtime's placement of this shape (`inference.policies.placement.placement`)."""
        return placement(self.layers, self.experts, self.top_k, self.workers)

    def groups(self) -> list[list[int]]:
        """The placement's decode groups."""
        return [list(members) for members in self.placement().groups]


# --- the cluster ---------------------------------------------------------------------------------------


@dataclass
class WorkerSim:
    loader: LoaderSim
    free_at: float = 0.0
    served: tuple[int, int] = (-1, -1)
    uplink_free: float = 0.0
    cpu_experts: int = 0
    planned_experts: int = 0  # predicted experts planned on the CPU, never copied
    predictions: list[tuple[float, int, int, list[int]]] = field(default_factory=list)
    share_control: ShareController | None = None  # hybrid odmoe: the planned CPU share
    token_mark: int | None = None  # the step of the last token's first request


class Link:
    """One role's uplink, emulated as `inference.runtime.transport` does (or loopback only)."""

    def __init__(self, rates: EmulatedRates, costs: MachineCosts, networked: bool) -> None:
        self.rate = rates.link_bytes_per_s if networked else None
        self.latency = rates.link_latency_s if networked else 0.0
        self.one_way = costs.one_way_s
        self.wake = costs.hold_wake_s
        self.free = 0.0

    def send(self, t: float, nbytes: int) -> float:
        """Delivery time of a message sent at ``t``: when it really arrives over loopback or, if
        later, when the receiver's timed wait for its delivery time ends."""
        real = t + self.one_way
        if self.rate is None:
            return real
        self.free = max(self.free, t) + nbytes / self.rate
        return max(real, self.free + self.latency + self.wake)


@dataclass(frozen=True)
class Options:
    strategy: str
    recall: float = 1.0  # odmoe: share of routed experts the shadow names (1: a shadow of the same precision)
    hybrid: bool = False
    shadow_layer_s: float | None = None  # the shadow's own layer time here (default: main's layer + top_k experts)
    # The runtime's: how many steps after a token a share changed on it plans.
    lookahead: int = DeploymentSettings.lookahead
    # odmoe with drafts (``draft_tokens``): each pass verifies this many of the shadow's guesses, and
    # yields ``tokens_per_pass`` tokens on average (measured before the run: ``draft_passes``). With
    # ``draft_auto`` (``draft_policy="auto"``), up to that many, as main's ``DraftTuner`` picks pass by
    # pass, each draft kept at the agreement under which ``drafts`` drafts yield ``tokens_per_pass``.
    drafts: int = 0
    tokens_per_pass: float = 1.0
    draft_auto: bool = False


def _shadow_guess(real: list[int], experts: int, recall: float, step: int, layer: int) -> list[int]:
    """A deterministic stand-in for a shadow of the given recall (exact when recall is 1)."""
    if recall >= 1.0:
        return sorted(real)
    rng = random.Random(step * 7919 + layer)
    guess = []
    for e in real:
        if rng.random() < recall:
            guess.append(e)
        else:
            guess.append(rng.choice([x for x in range(experts) if x not in real and x not in guess] or [e]))
    return sorted(set(guess))


class ClusterSim:
    """One generation's emulated cluster (the rules in the module's docstring): the workers' loaders,
    main's, the workers' and the shadow's uplinks, and the runtime's own decisions, on one clock
    (seconds). A driver calls ``layer_round`` for each layer main computes and ``send_prediction``
    for each of the shadow's layers; the times it passes never go backwards for one link."""

    def __init__(
        self,
        options: Options,
        shape: Shape,
        costs: MachineCosts,
        rates: EmulatedRates,
        *,
        prefill_experts: list[list[int]] | None = None,
    ) -> None:
        strategy = options.strategy
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        workers = 1 if strategy == "lru-offload" else shape.workers
        self.options, self.costs, self.rates = options, costs, rates
        self.shape = shape = dataclasses.replace(shape, workers=workers)
        self.place = shape.placement()
        self.groups = shape.groups()
        networked = strategy != "lru-offload"
        self.declared = declared = get_strategy(strategy)
        # The worker's device cache (`inference.runtime.roles.worker.storage.device_cache`): every
        # expert ("all"), a per-layer LRU ("lru"), or none.
        cache: int | str | None = {"all": None, "lru": shape.cache_experts}.get(declared.cache, "none")
        self.pool = pool = [WorkerSim(LoaderSim(rates.copy_s, shape.max_resident, cache)) for _ in range(workers)]
        if declared.cache == "all":  # preloaded at start (`WorkerRole`: `loader.preload(home_experts(...))`)
            for w, worker in enumerate(pool):
                for key in home_experts(self.place, w):
                    worker.loader.cache[key] = None
        if declared.cache == "lru":  # what prefill left in the cache: the prompt's experts, in order
            uses = [
                (layer, e)
                for layer in range(shape.layers)
                for e in (sorted(prefill_experts[layer]) if prefill_experts else range(shape.experts))
            ]
            for key in lru_resident(uses, shape.cache_experts):
                pool[0].loader.cache[key] = None
        self.main_link = Link(rates, costs, networked)
        self.worker_links = [Link(rates, costs, networked) for _ in range(workers)]
        self.shadow_link = Link(rates, costs, networked)
        self.shadow_layer_s = (
            options.shadow_layer_s
            if options.shadow_layer_s is not None
            else costs.main_layer_s + shape.top_k * costs.expert_compute_s
        )
        self.cpu_s = 0.0
        if options.hybrid:
            if not rates.host_memory_bytes_per_s:
                raise ValueError("hybrid execution needs the emulated host memory rate")
            self.cpu_s = max(costs.expert_compute_s, rates.expert_bytes / rates.host_memory_bytes_per_s)
            if rates.host_flops:
                self.cpu_s = max(self.cpu_s, rates.expert_flops / rates.host_flops)
        groups = self.groups
        self.group_layers = [[la for la in range(shape.layers) if la % len(groups) == g] for g in range(len(groups))]
        if options.hybrid and strategy == "odmoe":  # the runtime's controller, with its rates alone
            host_s = rates.expert_bytes / rates.host_memory_bytes_per_s
            if rates.host_flops:
                host_s = max(host_s, rates.expert_flops / rates.host_flops)
            for worker in pool:
                worker.share_control = ShareController(
                    predicted_share(rates.copy_s, host_s, len(groups)), delay=share_delay(options.lookahead)
                )
        self.step_starts: list[float] = []  # when each decode step began (the hybrid share's periods)

    def share_of(self, worker: WorkerSim, step: int) -> Fraction:
        return worker.share_control.share_at(step) if worker.share_control else Fraction(0)

    def mark_token(self, worker: WorkerSim, step: int) -> None:
        """`inference.runtime.roles.worker.cpu_path.mark_token`: the previous decode token's period, as main
        timed it."""
        mark, worker.token_mark = worker.token_mark, step
        if worker.share_control and mark == step - 1:  # (the trace holds decode steps only)
            worker.share_control.observe(mark, self.step_starts[step - 1] - self.step_starts[step - 2])

    def deliver_predictions(self, worker: WorkerSim, until: float) -> None:
        place, groups = self.place, self.groups
        while worker.predictions and worker.predictions[0][0] <= until:
            arrive, step, layer, experts = worker.predictions.pop(0)
            t = max(arrive, worker.free_at)
            if (step, layer) <= worker.served:
                continue
            members = place.workers_for_layer(layer)
            mine = prefetch_on_prediction(self.declared, experts, members, self.pool.index(worker))
            group = self.group_layers[layer % len(groups)]
            if planned_on_cpu(step, layer, group, len(groups), self.share_of(worker, step)):
                worker.planned_experts += len(mine)
                mine = []
            worker.loader.discard(keep_on_prediction((step, layer), set(mine)), t)
            for e in mine:
                worker.loader.prefetch((step, layer, e), t)

    def serve(
        self, worker: int, step: int, layer: int, experts: list[int], arrive: float, rows: dict[int, int] | None = None
    ) -> float:
        """A worker's answer to main's request: when it is done. ``rows``: the positions routed to each
        expert, a segment each (1 when not given)."""
        costs, worker = self.costs, self.pool[worker]
        self.deliver_predictions(worker, max(arrive, worker.free_at))
        t = max(arrive, worker.free_at)
        loader = worker.loader
        here = (step, layer)
        if layer == self.group_layers[layer % len(self.groups)][0]:
            self.mark_token(worker, step)
        if here > worker.served:
            worker.served = here
        loader.discard(keep_on_request(here, set(experts)), t)
        if experts:  # the worker's own Python before its first expert (the checks, the loader's calls)
            t += costs.worker_python_s
        # The runtime decides every expert of the request first, then runs the CPU's on a host
        # thread beside the device's: two chains from the request's arrival, the later one ends it.
        # Its rule is `inference.policies.hybrid.split`'s (strictly sooner on the CPU than the copy's
        # end, CPU experts one after another, a dropped copy moving the later ones up), applied here
        # to the loader model's absolute clock rather than through `split`'s relative snapshot
        # (`CopyState`): the same comparisons, in other float arithmetic, which could tip a tie.
        cpu_t = t
        on_device = []
        for e in experts:
            key = (step, layer, e)
            if self.options.hybrid and loader.state(key) != "ready":
                on_device_at = max(t, loader.copy_eta(key))  # the runtime's rule: against the copy's end
                if cpu_t + self.cpu_s < on_device_at:
                    if loader.state(key) != "loading":
                        loader.forget(key, t)
                    else:
                        loader.drop.add(key)
                    worker.cpu_experts += 1
                    cpu_t += self.cpu_s
                    continue
            on_device.append(key)
        for key in on_device:
            ready = loader.acquire(key, t)
            t = max(t, ready) + costs.expert_compute_s * (rows or {}).get(key[2], 1)
            loader.release(key, t)
        t = max(t, cpu_t)
        worker.free_at = t
        return t

    def send_prediction(self, step: int, layer: int, real: list[int], at: float) -> None:
        """The shadow's routing of (``step``, ``layer``), sent at ``at`` to the layer's group (the
        routed experts ``real``, as a shadow of the options' recall names them)."""
        guess = _shadow_guess(real, self.shape.experts, self.options.recall, step, layer)
        arrive = self.shadow_link.send(at, self.rates.prediction_bytes)
        for w in self.groups[layer % len(self.groups)]:
            self.pool[w].predictions.append((arrive, step, layer, guess))
            self.pool[w].predictions.sort(key=lambda p: (p[0], p[1], p[2]))

    def shadow_pass(self, step: int, routing: list[list[int]], begin: float) -> float:
        """The shadow's forward of one step from ``begin``: each layer's prediction sent as it
        finishes; when the pass ends."""
        for layer in range(self.shape.layers):
            self.send_prediction(step, layer, routing[layer], begin + (layer + 1) * self.shadow_layer_s)
        return begin + self.shape.layers * self.shadow_layer_s

    def plan(self, experts: list[int], step: int, layer: int) -> dict[int, list[int]]:
        """Who computes each routed expert: main's own decode rule (`inference.policies.strategies.dispatch_plan`)."""
        shape, odmoe = self.shape, self.declared.name == "odmoe"
        predicted = _shadow_guess(experts, shape.experts, self.options.recall, step, layer) if odmoe else []
        plan, _ = dispatch_plan(self.declared, self.place, step, layer, experts, sorted(set(predicted)))
        return plan

    def layer_round(
        self,
        step: int,
        layer: int,
        rows: dict[int, int],
        positions: int,
        now: float,
        *,
        next_gate: list[int] | None = None,
        prefill: dict[int, int] | None = None,
    ) -> tuple[float, float]:
        """Main's layer ``layer`` of ``step`` over ``positions`` positions from ``now``, ``rows[e]`` of
        the decoding ones routed to expert ``e``: its own layer work, its requests to the layer's
        group, their answers, its Python after them. When it ends, and the seconds from its requests
        leaving to the last answer. ``next_gate``: main's guess of the next layer's experts, sent
        before the requests (lru-offload). ``prefill``: the rows of prompts prefilled in the same
        pass, per expert, each sent to its prefill worker (``dispatch_plan`` at step 0), every
        prefill candidate told of the layer."""
        costs, rates = self.costs, self.rates
        now += (costs.main_layer_s + costs.main_before_send_s) * positions
        if next_gate is not None:
            sent = self.main_link.send(now, rates.prediction_bytes)
            self.pool[0].predictions.append((sent, step, layer + 1, next_gate))
        work: dict[int, dict[int, int]] = {}  # worker -> its experts (in the plan's order) and their rows
        if rows:
            plan = self.plan(sorted(rows), step, layer)
            for w in self.groups[layer % len(self.groups)]:
                work[w] = {e: rows[e] for e in plan.get(w, [])}
        if prefill:
            plan, told = dispatch_plan(self.declared, self.place, 0, layer, sorted(prefill), None)
            for w in told:
                mine = work.setdefault(w, {})
                for e in plan.get(w, []):
                    mine[e] = mine.get(e, 0) + prefill[e]
        replies = []
        for w, mine in work.items():
            arrive = self.main_link.send(now, rates.request_bytes * positions if mine else rates.prediction_bytes)
            done = self.serve(w, step, layer, list(mine), arrive, mine)
            if mine:
                replies.append(self.worker_links[w].send(done, rates.result_bytes * sum(mine.values())))
        return max(replies) + costs.main_dispatch_s * positions, max(replies) - now

    def totals(self) -> dict:
        """The workers' counts: copies, copies never used, experts run on the CPU or planned there."""
        return {
            "loads": sum(w.loader.loads for w in self.pool),
            "wasted_loads": sum(w.loader.wasted for w in self.pool),
            "cpu_experts": sum(w.cpu_experts for w in self.pool),
            "planned_experts": sum(w.planned_experts for w in self.pool),
        }
