"""Our runtime on one machine under an emulated profile, walked through a recorded routing trace:
what `benchmarks.strategies` runs, predicted.

The cluster and its rules are `inference.sim.cluster`'s (``ClusterSim``); this module is the trace's
driver. ``simulate_generation`` decodes one generation step by step as main's loop would, every
step's routing taken from the trace (the shadow's predictions too, at the options' recall); with
drafts, pass by pass, each pass keeping the tokens a measured agreement yields (``draft_passes``, or
main's own ``DraftTuner`` choosing under ``auto``: ``AutoPasses``). What the trace cannot give (how
a real shadow's drafts agree token by token, a batch's sequences joining and leaving) is what
`inference.tools.engine_clock` adds by running main's real engine on the same cluster's clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from inference.policies.drafting import DraftTuner, expected_tokens
from inference.sim.cluster import STRATEGIES, ClusterSim, EmulatedRates, MachineCosts, Options, Shape, Trace


def draft_passes(decode_steps: int, drafts: int, tokens_per_pass: float) -> list[tuple[int, int, int]]:
    """The passes a drafted decode of ``decode_steps`` tokens makes (pure): (its first decode step, its
    positions, the tokens it keeps), each pass keeping as many as bring the running total nearest to
    ``tokens_per_pass`` a pass (at least its own token, at most its positions)."""
    if drafts < 1 or not 1.0 <= tokens_per_pass <= drafts + 1:
        raise ValueError(f"{drafts} drafts a pass yield 1 to {drafts + 1} tokens, not {tokens_per_pass}")
    passes, first = [], 0
    while first < decode_steps:
        positions = min(drafts + 1, decode_steps - first)
        kept = min(positions, max(1, round((len(passes) + 1) * tokens_per_pass) - first))
        passes.append((first, positions, kept))
        first += kept
    return passes


def agreement_for(drafts: int, tokens_per_pass: float) -> float:
    """The chance each draft is kept (given those before it were) under which a pass of ``drafts``
    drafts yields ``tokens_per_pass`` tokens on average (pure): ``expected_tokens`` solved for it."""
    if drafts < 1 or not 1.0 <= tokens_per_pass <= drafts + 1:
        raise ValueError(f"{drafts} drafts a pass yield 1 to {drafts + 1} tokens, not {tokens_per_pass}")
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens(middle, drafts) < tokens_per_pass else (low, middle)
    return (low + high) / 2


class AutoPasses:
    """The passes of a decode under ``draft_policy="auto"``: main's own ``DraftTuner`` picks each pass's
    drafts from the passes simulated so far; each pass keeps the tokens that bring the running total
    nearest the expected tokens of the passes so far, at ``agreement`` (as ``draft_passes`` does)."""

    def __init__(self, shape: Shape, most: int, agreement: float) -> None:
        self.tuner = DraftTuner(most=most, auto=True, experts=shape.experts, top_k=shape.top_k, layers=shape.layers)
        self.agreement = agreement
        self.expected = 0.0

    def next(self, first: int, decode_steps: int) -> tuple[int, int, int]:
        """This pass's drafts, positions and kept tokens, the pass starting at decode step ``first``."""
        drafts = self.tuner.drafts()
        positions = min(drafts + 1, decode_steps - first)
        self.expected += expected_tokens(self.agreement, drafts)
        return drafts, positions, min(positions, max(1, round(self.expected) - first))


def simulate_generation(
    options: Options,
    shape: Shape,
    costs: MachineCosts,
    rates: EmulatedRates,
    trace: Trace,
    *,
    next_gate: Trace | None = None,
    prefill_experts: list[list[int]] | None = None,
) -> dict:
    """Decode of one generation: ``trace[s][l]`` are step ``s``'s routed experts at layer ``l``
    (decode steps only, the first token's step excluded); ``next_gate[s][l]`` main's guess for layer
    ``l`` made at layer ``l - 1`` (lru-offload); ``prefill_experts[l]`` the experts the prompt hit
    (what an LRU cache holds when decode starts). Returns the decode rate as the runtime measures it
    (tokens after the first / time from the first token to the last)."""
    strategy = options.strategy
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if not trace:
        raise ValueError("the trace needs at least one decode step")
    if strategy == "lru-offload" and next_gate is None:
        raise ValueError("lru-offload needs main's next-gate guesses (next_gate)")
    for step in trace:
        if len(step) != shape.layers or any(len(set(e)) != len(e) or not e for e in step):
            raise ValueError("each trace step needs one non-empty list of distinct experts per layer")
    cluster = ClusterSim(options, shape, costs, rates, prefill_experts=prefill_experts)
    if options.drafts and strategy == "odmoe":
        return _drafted(cluster, trace)
    now = shadow_end = 0.0
    step_times = []
    for s, step in enumerate(trace, start=1):
        start = now
        cluster.step_starts.append(start)
        if strategy == "odmoe":
            # The shadow, one token ahead, predicts step s + 1 while main runs step s.
            if s == 1:
                shadow_end = cluster.shadow_pass(s, step, now)
            if s < len(trace):
                shadow_end = cluster.shadow_pass(s + 1, trace[s], max(shadow_end, start))
        for layer, experts in enumerate(step):
            gate = next_gate[s - 1][layer + 1] if strategy == "lru-offload" and layer + 1 < shape.layers else None
            now, _ = cluster.layer_round(s, layer, dict.fromkeys(experts, 1), 1, now, next_gate=gate)
        now += costs.step_fixed_s
        if strategy == "odmoe" and rates.align_bytes:
            cluster.main_link.send(now, rates.align_bytes)  # the shadow's alignment occupies main's uplink
        step_times.append(now - start)
    decode_s = sum(step_times)
    return {
        "decode_tok_s": len(step_times) / decode_s,
        "step_ms_median": statistics.median(step_times) * 1000,
        **cluster.totals(),
    }


def _drafted(cluster: ClusterSim, trace: Trace) -> dict:
    """odmoe's decode with drafts (``simulate_generation`` with ``options.drafts``), pass by pass.

    Each pass computes ``positions`` positions in main (its layer work, Python and LM head each
    position's), copies at each layer the union of the experts they route to (the trace's steps: a
    kept draft's routing is the token's own; a rejected one's is taken as the next token's), each
    position an expert segment of its own, and keeps ``kept`` tokens (``draft_passes``, or under
    ``draft_auto`` ``AutoPasses``). The shadow drafts a pass's positions one model pass each, sending
    the union so far per layer as it goes, and answers main after all but the last; it drafts the next
    pass meanwhile where this one kept every draft (``speculate``), else from main's end of this pass.
    Main waits for the answer (not at all for a pass ``auto`` gave no drafts)."""
    options, shape, costs, rates = cluster.options, cluster.shape, cluster.costs, cluster.rates
    now = shadow_free = 0.0
    times, tokens, kept_all = [], 0, False
    shadow_pass_s = shape.layers * cluster.shadow_layer_s
    auto, fixed = None, iter(())
    if options.draft_auto:
        auto = AutoPasses(shape, options.drafts, agreement_for(options.drafts, options.tokens_per_pass))
    else:
        fixed = iter(draft_passes(len(trace), options.drafts, options.tokens_per_pass))
    first, p = 0, 0
    while first < len(trace):
        p += 1
        if auto is not None:
            drafts, positions, kept = auto.next(first, len(trace))
        else:
            _, positions, kept = next(fixed)
            drafts = options.drafts
        begin = shadow_free if kept_all else max(shadow_free, now)
        for j in range(positions):  # the shadow's passes, each layer's union so far sent as it finishes
            for layer in range(shape.layers):
                union = sorted(set().union(*(trace[first + i][layer] for i in range(j + 1))))
                at = begin + j * shadow_pass_s + (layer + 1) * cluster.shadow_layer_s
                cluster.send_prediction(p, layer, union, at)
        shadow_free = begin + positions * shadow_pass_s
        ready = max(now, begin + (positions - 1) * shadow_pass_s) if drafts else now  # main waits for its drafts
        waited, start, now = ready - now, ready, ready
        experts_s = distinct = 0
        for layer in range(shape.layers):
            rows: dict[int, int] = {}
            for i in range(positions):
                for e in trace[first + i][layer]:
                    rows[e] = rows.get(e, 0) + 1
            now, waited_here = cluster.layer_round(p, layer, rows, positions, now)
            experts_s += waited_here
            distinct += len(rows)
        now += costs.step_fixed_s * positions
        if rates.align_bytes:
            cluster.main_link.send(now, rates.align_bytes * kept)
        if auto is not None:
            auto.tuner.note_timed_pass(
                drafts=drafts,
                positions=positions,
                kept=kept - 1,
                wait_s=waited,
                step_s=now - start,
                experts_s=experts_s,
                distinct=distinct,
            )
        times.append(now - start)
        tokens += kept
        first += kept
        kept_all = kept == positions
    return {
        "decode_tok_s": tokens / (now or 1.0),
        "step_ms_median": statistics.median(times) * 1000,
        "passes": len(times),
        **cluster.totals(),
        "cpu_experts": 0,
        "planned_experts": 0,
    }


def predict(
    options: Options,
    shape: Shape,
    costs: MachineCosts,
    rates: EmulatedRates,
    generations: Sequence[dict],
) -> float:
    """Mean decode tok/s over ``generations`` (each: ``trace``, optional ``next_gate`` and
    ``prefill_experts``), as `benchmarks.strategies` averages its length pairs."""
    if not generations:
        raise ValueError("at least one generation is needed")
    rates_each = [
        simulate_generation(
            options,
            shape,
            costs,
            rates,
            g["trace"],
            next_gate=g.get("next_gate"),
            prefill_experts=g.get("prefill_experts"),
        )["decode_tok_s"]
        for g in generations
    ]
    return statistics.fmean(rates_each)
