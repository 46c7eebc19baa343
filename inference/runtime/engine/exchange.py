"""The layer exchange: one MoE layer's experts served by the workers for the whole batch.

Three parts. ``plan_layer`` (pure) sorts each sequence's (token, expert) pairs as the
reference grouped implementation does (``inference.runtime.routing``), lays every sequence's rows
of an expert one after another (one segment per sequence and expert, so each expert is
loaded once and each sequence's rows are computed as in its own run) and packs each
worker's segments into requests. ``Exchange`` moves the bytes: it sends the requests and
collects the answers within the timeout, sending what a lost worker had not answered to a
survivor of its group. An answer counts only where ``answered_request`` (pure) finds the request
main sent that very worker which it answers, segment for segment and row for row: rows for an
expert main did not ask of that worker (a hostile or broken one) are dropped with a log line and
never summed, and main goes on waiting for the worker's real answer as for a silent one's.
``assemble`` (pure) puts the answers back in the reference order
and sums each sequence's weighted outputs, so every sequence's output is the
full-precision model's bit for bit; ``record_layer`` writes the layer's figures.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from inference.policies.assignment import chunk_sizes
from inference.policies.failover import NoSurvivor, reroute, taker
from inference.policies.strategies import dispatch_plan
from inference.runtime.batching import Segment, pack_segments
from inference.runtime.metrics import reported_ms
from inference.runtime.records import LayerRecord
from inference.runtime.routing import RoutedRows, Routing
from inference.wire.runtime import ExpertRequest, ExpertResult

if TYPE_CHECKING:
    from inference.policies.placement import Placement
    from inference.policies.strategies import Strategy
    from inference.runtime.engine.guesses import Guesses
    from inference.runtime.engine.sequence import Sequence
    from inference.runtime.transport import Endpoint

log = logging.getLogger(__name__)


class GenerationAborted(RuntimeError):
    """A peer failed or timed out during a generation."""


def worker_index(peer: str) -> int:
    """3 for the link "worker-3"."""
    return int(peer.removeprefix("worker-"))


def _pieces(sizes: list[int]) -> list[tuple[int, int]]:
    """(offset, size) of consecutive pieces of the given sizes."""
    out, offset = [], 0
    for size in sizes:
        out.append((offset, size))
        offset += size
    return out


@dataclass
class LayerPlan:
    """What goes to the workers for one layer: each expert's rows and weights (every sequence's,
    one after another), where each sequence's rows of an expert start, and per worker its
    requests as (segments, final) pairs (an empty list: an empty request that releases its prefetch)."""

    experts: list[int]
    rows: dict[int, torch.Tensor]
    weights: dict[int, torch.Tensor]
    starts: list[dict[int, int]]
    requests: dict[int, list[tuple[list[Segment], bool]]] = field(default_factory=dict)


def plan_layer(
    routed: list[RoutedRows],
    prefill: list[bool],
    assignment: dict[int, list[int]],
    candidates: list[int] | tuple[int, ...],
    chunk: int,
) -> LayerPlan:
    """The layer's rows and requests (pure): ``prefill[i]`` says sequence i prefills, whose rows
    go in the mini-batches of ``chunk`` rows its own run would use."""
    real = sorted(set().union(*(r.experts for r in routed)))
    rows: dict[int, torch.Tensor] = {}
    weights: dict[int, torch.Tensor] = {}
    starts: list[dict[int, int]] = [{} for _ in routed]
    for expert in real:
        parts, part_weights, offset = [], [], 0
        for i, r in enumerate(routed):
            if expert in r.rows:
                starts[i][expert] = offset
                parts.append(r.rows[expert])
                part_weights.append(r.weights[expert])
                offset += r.count(expert)
        rows[expert] = parts[0] if len(parts) == 1 else torch.cat(parts)
        weights[expert] = part_weights[0] if len(part_weights) == 1 else torch.cat(part_weights)
    plan = LayerPlan(real, rows, weights, starts)
    prefilling = any(prefill)
    for worker in candidates:
        segments = [
            Segment(expert, starts[i][expert] + offset, size)
            for expert in assignment.get(worker, [])
            for i, r in enumerate(routed)
            if expert in r.rows
            for offset, size in _pieces(chunk_sizes(r.count(expert), chunk if prefill[i] else 0))
        ]
        plan.requests[worker] = pack_segments(segments, chunk if prefilling else 0)
    return plan


def answered_request(result: ExpertResult, requests: list[ExpertRequest], answered: set[int]) -> int | None:
    """The index of the request of ``requests`` (what main sent one worker for the layer) that
    ``result`` answers and that no answer counted yet (``answered``) did: the same segments (expert,
    count, offset) in the same order, and a floating-point output of one row of the hidden size per
    row sent. None where it answers none (pure)."""
    for i, request in enumerate(requests):
        if i in answered or request.rows is None:
            continue
        same = (result.experts, result.counts, result.offsets) == (request.experts, request.counts, request.offsets)
        if same and result.output.is_floating_point() and result.output.shape == request.rows.shape:
            return i
    return None


def assemble(
    plan: LayerPlan,
    routed: list[RoutedRows],
    answers: list[tuple[str, ExpertResult]],
    routing: Routing,
    dtypes: list[torch.dtype],
) -> list[torch.Tensor]:
    """Each sequence's summed expert output [T, H] from the workers' answers (pure).

    An answer's rows stay in the dtype its expert's weighted output has, the rows' dtype promoted
    with the routing weights' (a bf16 model's fp32 weights make fp32 products), and are summed
    before they are rounded to the model's dtype, as Transformers' grouped experts do. Rounding
    each product first is the eager experts' arithmetic, which ``combine_eager`` does itself.
    """
    outputs = {
        e: torch.empty(
            plan.rows[e].shape,
            dtype=torch.promote_types(plan.rows[e].dtype, plan.weights[e].dtype),
            device=plan.rows[e].device,
        )
        for e in plan.experts
    }
    for _, result in answers:
        start = 0
        for expert, count, offset in zip(result.experts, result.counts, result.offsets, strict=True):
            outputs[expert][offset : offset + count] = result.output[start : start + count]
            start += count
    combined = []
    for i, r in enumerate(routed):
        mine = {e: outputs[e][plan.starts[i][e] : plan.starts[i][e] + r.count(e)] for e in r.experts}
        combined.append(routing.combine(r, mine, dtypes[i]))
    return combined


def layer_records(
    layer: int, batch: list[Sequence], routed: list[RoutedRows], predicted: list[list[int] | None]
) -> list[LayerRecord]:
    """The layer's record for each sequence of ``batch``, added to its step's: the lanes of a drafted
    decode (``runner.Lane``, whose ``owner`` is the sequence) share their sequence's one record,
    whose experts are the union of theirs (the experts the pass copied for it)."""
    records: dict[int, LayerRecord] = {}
    for s, r, p in zip(batch, routed, predicted, strict=True):
        owner = s.owner
        record = records.get(id(owner))
        if record is None:
            record = records[id(owner)] = LayerRecord(layer, list(r.experts), p)
            owner.state.steps[-1].layers.append(record)
        else:
            record.real = sorted(set(record.real) | set(r.experts))
    return list(records.values())


@dataclass
class Timing:
    """Main's clock around one layer's round trip (perf_counter seconds, and ms off the socket)."""

    started: float
    sent_at: float
    answered_at: float
    last_receive_ms: float


def record_layer(records: list[LayerRecord], answers: list[tuple[str, ExpertResult]], timing: Timing) -> None:
    """The layer's figures, shared by the batch: what the workers said, where main's time went."""
    busy: dict[str, float] = {}
    handled: dict[str, float] = {}
    received: dict[str, float] = {}
    wait_ms = compute_ms = 0.0
    hits = misses = 0
    for peer, result in answers:
        # A worker's own figures, for the records only: what is not a time is not counted.
        waited, computed = reported_ms(result.wait_ms), reported_ms(result.compute_ms)
        wait_ms += waited
        compute_ms += computed
        busy[peer] = busy.get(peer, 0.0) + waited + computed
        handled[peer] = handled.get(peer, 0.0) + reported_ms(result.handled_ms)
        received[peer] = received.get(peer, 0.0) + reported_ms(result.received_ms)
        hits += result.hits
        misses += result.misses
    dispatch_ms = (time.perf_counter() - timing.started) * 1000
    for record in records:
        record.wait_ms, record.compute_ms, record.hits, record.misses = wait_ms, compute_ms, hits, misses
        record.worker_ms = max(busy.values(), default=0.0)
        record.dispatch_ms = dispatch_ms
        record.send_ms = (timing.sent_at - timing.started) * 1000
        record.await_ms = (timing.answered_at - timing.sent_at) * 1000
        if answers:  # the worker main waited for last, all its requests of the layer
            last = answers[-1][0]
            record.last_handled_ms, record.last_busy_ms = handled[last], busy[last]
            record.last_received_ms = received[last] + timing.last_receive_ms


class Peers(Protocol):
    """What the exchange needs of main's role: its sockets, who is lost, the session's clock."""

    endpoint: Endpoint
    lost: set[int]
    session: str
    step: int
    previous_step_s: float
    pending_results: list[tuple[str, ExpertResult]]

    def note_links(self) -> None: ...
    def handle_side_message(self, received) -> None: ...


class Exchange:
    """Serves each layer's experts for the batch: plan, send, collect, assemble."""

    def __init__(
        self,
        peers: Peers,
        placement: Placement,
        strategy: Strategy,
        routing: Routing,
        guesses: Guesses,
        *,
        prefill_chunk: int,
        timeout_s: float,
        on_used=None,
    ) -> None:
        self.peers = peers
        self.placement = placement
        self.strategy = strategy
        self.routing = routing
        self.guesses = guesses
        self.prefill_chunk = prefill_chunk
        self.timeout_s = timeout_s
        self.on_used = on_used  # importance: which experts each worker was given (it now holds them)

    def serve_layer(self, layer: int, batch: list[Sequence]) -> list[torch.Tensor]:
        """The layer's experts for every sequence of ``batch``, each expert loaded once for all of them."""
        started = time.perf_counter()
        for s in batch:
            s.at = (s.step, layer)  # where a prediction arriving meanwhile finds it
        self.guesses.before_layer(layer, batch)
        calls = [s.call for s in batch]
        routed = [self.routing.split(c.hidden_states, c.top_k_index, c.top_k_weights) for c in calls]  # type: ignore[union-attr]
        steps = [s.step for s in batch]
        self.guesses.predict_next_layer(layer, batch)
        predicted_each = [
            s.state.predictions.get((step, layer)) if step > 0 else None for s, step in zip(batch, steps, strict=True)
        ]
        known = [p for p in predicted_each if p is not None]
        predicted = sorted(set().union(*known)) if known else None
        real = sorted(set().union(*(r.experts for r in routed)))
        # A layer with a prefill in it is planned as a prefill (every worker takes a share).
        session_step = 0 if 0 in steps else max(self.peers.step, 1)
        assignment, candidates = dispatch_plan(self.strategy, self.placement, session_step, layer, real, predicted)
        holders = self.placement.workers_for_layer(layer)
        try:
            assignment, candidates = reroute(assignment, candidates, self.peers.lost, holders, layer)
        except NoSurvivor as exc:
            raise GenerationAborted(str(exc)) from None
        if self.on_used is not None:
            for worker, experts in assignment.items():
                self.on_used(worker, layer, experts)
        records = layer_records(layer, batch, routed, predicted_each)
        plan = plan_layer(routed, [step == 0 for step in steps], assignment, candidates, self.prefill_chunk)
        expected, sent = self._send(layer, plan)
        sent_at = time.perf_counter()
        answers, last_receive_ms = self._collect(expected, self.peers.step, layer, sent, holders)
        timing = Timing(started, sent_at, time.perf_counter(), last_receive_ms)
        combined = assemble(plan, routed, answers, self.routing, [c.hidden_states.dtype for c in calls])  # type: ignore[union-attr]
        record_layer(records, answers, timing)
        return combined

    def _send(self, layer: int, plan: LayerPlan) -> tuple[dict[str, int], dict[str, list[ExpertRequest]]]:
        """Every worker's requests of the layer; how many answers each owes, and what it was sent."""
        expected: dict[str, int] = {}
        sent: dict[str, list[ExpertRequest]] = {}
        rows, weights = plan.rows, plan.weights
        for worker, requests in plan.requests.items():
            peer = f"worker-{worker}"
            for pieces, final in requests or [([], True)]:
                request = ExpertRequest(
                    request_id=self.peers.session,
                    step=self.peers.step,
                    layer=layer,
                    experts=[p.expert for p in pieces],
                    counts=[p.count for p in pieces],
                    offsets=[p.offset for p in pieces],
                    final=final,
                    previous_step_s=self.peers.previous_step_s,
                    rows=torch.cat([rows[p.expert][p.offset : p.offset + p.count] for p in pieces]) if pieces else None,
                    weights=torch.cat([weights[p.expert][p.offset : p.offset + p.count] for p in pieces])
                    if pieces
                    else None,
                )
                self.peers.endpoint.send(peer, request)  # an empty one releases the worker's prefetch
                if pieces:
                    sent.setdefault(peer, []).append(request)
            if requests:
                expected[peer] = len(requests)
        return expected, sent

    def _resend_lost(
        self,
        remaining_by_peer: dict[str, int],
        sent: dict[str, list[ExpertRequest]],
        holders: tuple[int, ...],
        layer: int,
    ) -> None:
        """Send what a lost worker had not answered yet to a surviving worker of the layer's group."""
        lost = self.peers.lost
        for peer in [p for p, n in remaining_by_peer.items() if n and worker_index(p) in lost]:
            unanswered = sent.get(peer, [])[-remaining_by_peer[peer] :]
            load = {worker_index(p): n for p, n in remaining_by_peer.items()}
            try:
                target = f"worker-{taker(holders, lost, load, layer)}"
            except NoSurvivor as exc:
                raise GenerationAborted(str(exc)) from None
            for request in unanswered:
                self.peers.endpoint.send(target, request)
            sent.setdefault(target, []).extend(unanswered)
            remaining_by_peer[target] = remaining_by_peer.get(target, 0) + len(unanswered)
            remaining_by_peer[peer] = 0
            log.warning("%s's %d request(s) for layer %d went to %s", peer, len(unanswered), layer, target)

    def _collect(
        self,
        expected: dict[str, int],
        step: int,
        layer: int,
        sent: dict[str, list[ExpertRequest]],
        holders: tuple[int, ...],
    ) -> tuple[list[tuple[str, ExpertResult]], float]:
        """Wait for every worker's ``expected`` answers to (step, layer), within the timeout; with
        them, main's time with the last one from its frames off the socket (decoding, other
        messages read with it) to here, in ms.

        A worker lost meanwhile has what it had not answered sent to a survivor of its group.
        """
        peers = self.peers
        results: list[tuple[str, ExpertResult]] = []
        answered: dict[str, set[int]] = {}  # by peer, which of its requests in ``sent`` an answer counted for
        last_receive_ms = 0.0
        remaining_by_peer = dict(expected)
        deadline = time.monotonic() + self.timeout_s
        peers.pending_results.clear()
        while True:
            peers.note_links()
            self._resend_lost(remaining_by_peer, sent, holders, layer)
            if not any(remaining_by_peer.values()):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(peer for peer, n in remaining_by_peer.items() if n)
                raise GenerationAborted(
                    f"{', '.join(missing)} did not answer layer {layer} of step {step} within "
                    f"{self.timeout_s:.0f} s (is the process alive?)"
                )
            received = peers.endpoint.recv(timeout_s=remaining)
            if received is None:
                continue
            peers.handle_side_message(received)
            for peer, result in peers.pending_results:
                if not remaining_by_peer.get(peer) or (result.step, result.layer) != (step, layer):
                    log.warning("dropped a stale result from %s for step %d layer %d", peer, result.step, result.layer)
                    continue
                index = answered_request(result, sent.get(peer, []), answered.setdefault(peer, set()))
                if index is None:
                    log.warning(
                        "dropped a result from %s for step %d layer %d that answers no request main sent it: "
                        "experts %s, counts %s, offsets %s, output %s",
                        peer,
                        step,
                        layer,
                        result.experts,
                        result.counts,
                        result.offsets,
                        tuple(result.output.shape),
                    )
                    continue
                answered[peer].add(index)
                results.append((peer, result))
                remaining_by_peer[peer] -= 1
                last_receive_ms = max(0.0, time.monotonic() - received.ready_at) * 1000
            peers.pending_results.clear()
        return results, last_receive_ms
