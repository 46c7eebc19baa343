"""The figures a generation reports: speed, prediction recall, expert memory, overhead.

Recall is the share of really-routed experts that the shadow had named for that
(step, layer); a decode layer with no prediction counts as 0. It is reported overall,
per layer and per step. Peak expert bytes are what each worker had resident on its
compute device, during prefill and during decode.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from inference.policies.assignment import recall
from inference.policies.placement import Placement
from inference.runtime.records import LayerRecord, RequestState, StepRecord
from inference.wire.runtime import ShadowStats, WorkerStats

# The parts of a decode layer's expert round trip, in the order they happen (`layer_breakdown`).
BREAKDOWN = (
    "main_before_send",  # routing split, dispatch plan, build + encode + send every request
    "hops",  # both ways: framing, encryption, ZeroMQ, wake-ups, both receive loops (and an emulated link)
    "worker_python",  # the last-answering worker's own time around its load wait + compute
    "worker_busy",  # that worker's load wait + compute
    "main_after_answers",  # scatter the answers and combine them
)


def layer_breakdown(rec: LayerRecord) -> dict[str, float]:
    """Where one layer's round trip went, in ms, from main's own clock and the worker whose
    answer came last: the parts sum to ``dispatch_ms`` (each clamped at 0 against a worker's
    clock that disagrees). The worker's parts are that worker's (all its requests of the
    layer), not the busiest worker's: they are what main was waiting on. The hops are main's
    wait less the worker's time with the requests: framing, encryption, ZeroMQ and wake-ups,
    and each side's receive loop around them (main's handling of other messages meanwhile, the
    worker's encoding of its answer)."""
    handled = min(reported_ms(rec.last_handled_ms), rec.await_ms)
    busy = min(reported_ms(rec.last_busy_ms), handled)
    return {
        "main_before_send": rec.send_ms,
        "hops": rec.await_ms - handled,
        "worker_python": handled - busy,
        "worker_busy": busy,
        "main_after_answers": max(0.0, rec.dispatch_ms - rec.send_ms - rec.await_ms),
    }


# The hops, split: in the receiving processes (each side's time with a message off its socket
# before handling it) and between the sockets (the rest: encoding after the worker's stamp,
# encryption, ZeroMQ's queues and I/O threads, the kernel, wake-ups, an emulated link's hold).
HOPS_SPLIT = ("receiving", "between_sockets")


def hops_split(rec: LayerRecord) -> dict[str, float]:
    """``layer_breakdown``'s hops of one layer in ms, split as ``HOPS_SPLIT`` says: the receiving
    part is the last-answering worker's time with its requests before handling them plus main's
    with that answer (`LayerRecord.last_received_ms`), clamped at the hops."""
    hops = layer_breakdown(rec)["hops"]
    receiving = min(reported_ms(rec.last_received_ms), hops)
    return {"receiving": receiving, "between_sockets": hops - receiving}


def reported_ms(ms: float) -> float:
    """A time from another process's clock: 0 where it is none (NaN, infinite, negative)."""
    return ms if math.isfinite(ms) and ms > 0 else 0.0


def step_report(step: StepRecord, placement: Placement) -> dict:
    """One step as it happened, sent with its token: per layer the worker group, the experts
    really routed and those predicted when main dispatched the layer (a drafted pass's: the union
    over its positions), and where the time went; the drafts the pass verified and kept."""
    decode = step.step > 0
    layers = []
    for rec in step.layers:
        entry = {
            "layer": rec.layer,
            "group": placement.group_of_layer(rec.layer) if decode else None,
            "real": list(rec.real),
            "wait_ms": round(rec.wait_ms, 3),
            "worker_ms": round(rec.worker_ms, 3),
            "dispatch_ms": round(rec.dispatch_ms, 3),
            "breakdown_ms": {k: round(v, 3) for k, v in layer_breakdown(rec).items()},
            "hops_split_ms": {k: round(v, 3) for k, v in hops_split(rec).items()},
        }
        if decode:
            entry["predicted"] = list(rec.predicted) if rec.predicted is not None else None
            entry["recall"] = recall(rec.predicted, rec.real)
        layers.append(entry)
    recalls = [entry["recall"] for entry in layers if "recall" in entry]
    return {
        "step": step.step,
        "tokens": step.tokens,
        "batch": step.batch,  # sequences main ran in this step, this one included
        "drafted": step.drafted,  # the shadow's drafts the step's pass verified (its layers: the union)
        "accepted": step.accepted,  # ... and those main kept
        "ms": round((step.finished - step.started) * 1000, 3) if step.finished else None,
        "recall": statistics.fmean(recalls) if recalls else None,
        "layers": layers,
    }


@dataclass
class DecodeTally:
    """What the decode layers of a generation add up to, gathered in one walk over its steps."""

    per_layer: dict[int, list[float]] = field(default_factory=dict)
    recalls: list[float] = field(default_factory=list)
    covered: int = 0
    in_time: int = 0
    late: int = 0  # decode experts computed that no prediction had named when main dispatched their layer
    dispatch: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    coordination: list[float] = field(default_factory=list)
    worker: list[float] = field(default_factory=list)
    parts: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in BREAKDOWN})
    hops: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in HOPS_SPLIT})
    # Per decode step, main's own time per layer outside the round trips: the step's whole token
    # interval (what the decode rate counts: the embedding, layer 0's attention before its first
    # round trip, streaming the token) less the round trips, spread over the layers.
    main_between: list[float] = field(default_factory=list)


def _layer_entry(state: RequestState, step: StepRecord, rec: LayerRecord, tally: DecodeTally) -> dict:
    """One layer's entry in ``per_step``; a decode layer's figures are added to ``tally``."""
    parts, hops = layer_breakdown(rec), hops_split(rec)
    entry = {
        "layer": rec.layer,
        "real": rec.real,
        "wait_ms": round(rec.wait_ms, 3),
        "worker_ms": round(rec.worker_ms, 3),
        "dispatch_ms": round(rec.dispatch_ms, 3),
        "breakdown_ms": {k: round(v, 3) for k, v in parts.items()},
        "hops_split_ms": {k: round(v, 3) for k, v in hops.items()},
        "hits": rec.hits,
        "misses": rec.misses,
    }
    if step.step > 0:
        predicted = state.predictions.get((step.step, rec.layer))
        tally.covered += predicted is not None
        tally.in_time += rec.predicted is not None
        r = recall(predicted, rec.real)
        entry.update(predicted=predicted, predicted_in_time=rec.predicted is not None, recall=r)
        tally.late += len(set(rec.real) - set(rec.predicted or ()))
        tally.per_layer.setdefault(rec.layer, []).append(r)
        tally.dispatch.append(rec.dispatch_ms)
        tally.wait.append(rec.wait_ms)
        # What the layer cost beyond loading and computing: message hops and scheduling.
        tally.coordination.append(max(0.0, rec.dispatch_ms - rec.worker_ms))
        tally.worker.append(rec.worker_ms)
        for k, v in parts.items():
            tally.parts[k].append(v)
        for k, v in hops.items():
            tally.hops[k].append(v)
    return entry


def per_step_entries(state: RequestState, tally: DecodeTally) -> list[dict]:
    """Every step as ``build_metrics`` reports it under ``per_step``, its decode layers tallied."""
    times = state.token_times
    per_step = []
    for step in state.steps:
        layers = [_layer_entry(state, step, rec, tally) for rec in step.layers]
        step_recalls = [entry["recall"] for entry in layers if "recall" in entry]
        tally.recalls.extend(step_recalls)
        if step.step > 0 and step.layers and step.step < len(times):  # decode step s made token s
            interval_ms = (times[step.step] - times[step.step - 1]) * 1000
            spent = interval_ms - sum(rec.dispatch_ms for rec in step.layers)
            tally.main_between.append(max(0.0, spent) / len(step.layers))
        per_step.append(
            {
                "step": step.step,
                "tokens": step.tokens,
                "ms": round((step.finished - step.started) * 1000, 3) if step.finished else None,
                "recall": statistics.fmean(step_recalls) if step_recalls else None,
                "layers": layers,
            }
        )
    return per_step


def prediction_metrics(state: RequestState, tally: DecodeTally) -> dict:
    """How well the predictions and the expert choices served the decode layers."""
    tokens = len(state.token_times)
    decode_layers = len(tally.recalls)
    per_layer = tally.per_layer
    return {
        "recall": statistics.fmean(tally.recalls) if tally.recalls else None,
        "recall_per_layer": [statistics.fmean(per_layer[k]) for k in sorted(per_layer)],
        "prediction_coverage": tally.covered / decode_layers if decode_layers else None,
        # Share of decode layers whose prediction had reached main when it dispatched the layer.
        "prediction_in_time": tally.in_time / decode_layers if decode_layers else None,
        # How many layers ahead of main the predictions that came in time arrived (median).
        "prediction_lead_layers": statistics.median(state.prediction_leads) if state.prediction_leads else None,
        # importance: the share of decode expert slots served from what workers held, and substitutions.
        "cache_hit_rate": state.resident_slots / state.expert_slots if state.expert_slots else None,
        "substitutions": state.substitutions,
        "substitutions_per_token": state.substitutions / max(1, tokens - 1),
        "late_experts": tally.late,
        "late_experts_per_token": tally.late / max(1, tokens - 1),
        # prerouter: the share of routed expert slots that the model's own router would have chosen too.
        "router_agreement": state.router_matches / state.router_slots if state.router_slots else None,
    }


def speed_metrics(state: RequestState) -> dict:
    """Time to the first token and the token rates, from main's token times."""
    times = state.token_times
    ttft_ms = (times[0] - state.started) * 1000 if times else 0.0
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    decode_tok_s = (len(times) - 1) / decode_s if decode_s > 0 else 0.0
    total_s = times[-1] - state.started if times else 0.0
    return {
        "ttft_ms": ttft_ms,
        "decode_tok_s": decode_tok_s,
        "e2e_tok_s": len(times) / total_s if total_s > 0 else 0.0,
        "prompt_tokens": state.prompt_len,
        "generated_tokens": len(times),
    }


def worker_metrics(worker_stats: dict[int, WorkerStats]) -> dict:
    """The workers' expert memory and loads, from the stats each sent at the session's end."""
    stats = worker_stats.values()
    ordered = sorted(worker_stats.items())
    return {
        "expert_bytes": max((s.expert_bytes for s in stats), default=0),
        "worker_peak_expert_bytes": {str(w): s.peak_decode_bytes for w, s in ordered},
        "worker_peak_prefill_bytes": {str(w): s.peak_prefill_bytes for w, s in ordered},
        "expert_loads": sum(s.loads for s in stats),
        "prefetch_hits": sum(s.hits for s in stats),
        "prefetch_misses": sum(s.misses for s in stats),
        "wasted_loads": sum(s.wasted_loads for s in stats),
        "disk_reads": sum(s.disk_reads for s in stats),
        "hot_set_hits": sum(s.hot_hits for s in stats),
        "cpu_experts": sum(s.cpu_experts for s in stats),
    }


def decode_layer_metrics(tally: DecodeTally) -> dict:
    """Where a decode layer's time went: medians (and the parts' means) over the decode layers."""
    any_layer = bool(tally.dispatch)
    between = tally.main_between
    return {
        "decode_layer_dispatch_ms_median": statistics.median(tally.dispatch) if tally.dispatch else None,
        "decode_layer_load_wait_ms_median": statistics.median(tally.wait) if tally.wait else None,
        "decode_layer_worker_ms_median": statistics.median(tally.worker) if tally.worker else None,
        "decode_layer_coordination_ms_median": (statistics.median(tally.coordination) if tally.coordination else None),
        # Medians of each part of a decode layer's round trip (`layer_breakdown`); medians do not add up.
        "decode_layer_breakdown_ms_median": (
            {k: statistics.median(v) for k, v in tally.parts.items()} if any_layer else None
        ),
        # Their means, which add up where medians do not: a decode token took about
        # layers × (main between layers + the parts), so a tail shows as a mean above its median.
        "decode_layer_breakdown_ms_mean": (
            {k: statistics.fmean(v) for k, v in tally.parts.items()} if any_layer else None
        ),
        "decode_hops_split_ms_median": (
            {k: statistics.median(v) for k, v in tally.hops.items()} if any_layer else None
        ),
        # Main's attention, norms and router per decode layer (and its per-token work spread over them).
        "decode_main_between_layers_ms_median": statistics.median(between) if between else None,
        "decode_main_between_layers_ms_mean": statistics.fmean(between) if between else None,
    }


def shadow_metrics(shadow_stats: ShadowStats | None) -> dict | None:
    """The shadow's own counts, or None without a shadow."""
    if shadow_stats is None:
        return None
    return {
        "steps_done": shadow_stats.steps_done,
        "rewinds": shadow_stats.rewinds,
        "token_aligns": shadow_stats.token_aligns,
        "kv_aligns": shadow_stats.kv_aligns,
        "speculations": shadow_stats.speculations,
        "speculation_misses": shadow_stats.speculation_misses,
        "largest_batch": shadow_stats.largest_batch,
        "cached_prompt_tokens": shadow_stats.cached_prompt_tokens,
    }


def build_metrics(
    state: RequestState,
    worker_stats: dict[int, WorkerStats],
    shadow_stats: ShadowStats | None,
    placement: Placement,
    *,
    token_period: int,
    kv_period: int,
) -> dict:
    """A generation's figures, each part from its own function, in the order they are reported."""
    tally = DecodeTally()
    per_step = per_step_entries(state, tally)
    return {
        **prediction_metrics(state, tally),
        **speed_metrics(state),
        "token_period": token_period,
        "kv_period": kv_period,
        "alignment_changes": state.alignment_log,
        **worker_metrics(worker_stats),
        **decode_layer_metrics(tally),
        "shadow": shadow_metrics(shadow_stats),
        "groups": [list(g) for g in placement.groups],
        "per_step": per_step,
    }
