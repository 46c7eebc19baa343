"""The main role: attention, norms, routers, LM head and KV cache; experts are remote.

Main runs Transformers' own ``generate`` on a model whose experts implementation hands
every layer's routed rows to ``ExpertDispatch.moe``: it sorts the (token, expert) pairs
exactly as the reference grouped implementation does, sends each worker of the layer's
group the rows of the experts assigned to it, and puts the weighted answers back in the
reference order before summing, so the output is the full-precision model's bit for bit.
Between steps it streams the token to the client and aligns the shadow. Which worker gets
which expert, and whether main itself guesses the next layer's experts, is the
deployment's strategy (``inference.strategies``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from inference import schedule
from inference.failover import NoSurvivor, reroute, taker
from inference.metrics import build_metrics, step_report
from inference.model import build_main_model
from inference.placement import Placement, placement_from_dict
from inference.protocol import (
    Align,
    Begin,
    Cancel,
    End,
    ExpertRequest,
    ExpertResult,
    GenerateDone,
    GenerateError,
    GenerateRequest,
    Ping,
    Pong,
    Prediction,
    SetAlignment,
    ShadowBegin,
    ShadowStats,
    Shutdown,
    TokenEvent,
    WorkerStats,
)
from inference.records import LayerRecord, RequestState, StepRecord
from inference.roles.common import (
    PeerHealth,
    answer_ping,
    connect_peers,
    handle_safely,
    open_endpoint,
    release_free_heap,
    setup_process,
)
from inference.routing import RoutedRows, Routing, resolve_arithmetic
from inference.sharding import verify_shard
from inference.spec import RoleSpec, compute_dtype
from inference.strategies import dispatch_plan, get_strategy
from inference.transport import Received

log = logging.getLogger(__name__)


class GenerationAborted(RuntimeError):
    """A peer failed or timed out during a generation."""


class MainRole:
    def __init__(self, spec: RoleSpec) -> None:
        self.spec = spec
        self.device = setup_process(spec)
        manifest = verify_shard(spec.shard_dir, expect_role="main")
        self.placement: Placement = placement_from_dict(manifest["placement"])
        if self.placement.n_workers != len(spec.addresses.workers):
            raise RuntimeError(
                f"shards were built for {self.placement.n_workers} workers but the peer table lists "
                f"{len(spec.addresses.workers)}"
            )
        config = json.loads((Path(spec.shard_dir) / "config.json").read_text())
        self.model = build_main_model(spec.shard_dir, self, dtype=compute_dtype(spec.settings.dtype, config))
        self.model.to(self.device)
        release_free_heap()
        config = self.model.config
        self.routing = Routing(
            resolve_arithmetic(
                spec.settings.experts_arithmetic,
                config.hidden_size,
                config.intermediate_size,
                self.model.dtype,
                self.device,
            )
        )
        self.strategy = get_strategy(spec.settings.strategy)
        self.has_shadow = spec.addresses.shadow is not None and self.strategy.uses_shadow
        self.endpoint = open_endpoint(spec)
        connect_peers(self.endpoint, spec, workers=True, shadow=self.has_shadow, main=False, watch=True)
        self.health = PeerHealth(self.endpoint, self.endpoint.peers)
        self.token_period = spec.settings.token_period
        self.kv_period = spec.settings.kv_period
        self.request: RequestState | None = None
        self.step = -1
        self.pending_results: list[tuple[str, ExpertResult]] = []
        self.worker_stats: dict[int, WorkerStats] = {}
        self.shadow_stats: ShadowStats | None = None
        # Worker loss (inference.failover): gone, reconnected and asked, back and ready.
        self.lost: set[int] = set()
        self.returning: set[int] = set()
        self.rejoined: set[int] = set()
        # Shadow loss: main serves without predictions (workers load what is routed) until it is back.
        self.shadow_lost = self.shadow_returning = self.shadow_back = False
        log.info(
            "main ready to connect: %d workers in groups %s, shadow %s, %s experts arithmetic, strategy %s",
            self.placement.n_workers,
            self.placement.groups,
            "yes" if self.has_shadow else "no",
            self.routing.arithmetic,
            self.strategy.name,
        )

    # --- idle loop ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while True:
                self.health.tick()
                received = self.endpoint.recv(timeout_s=0.1)
                self._note_links()
                if received is None:
                    continue
                if isinstance(received.msg, Shutdown):
                    for peer in self.endpoint.peers:
                        self.endpoint.send(peer, Shutdown())
                    return
                if isinstance(received.msg, GenerateRequest):
                    self.serve_request(received.msg, received.identity)
                else:
                    handle_safely(self.handle_side_message, received)
        finally:
            time.sleep(0.2)  # let the Shutdown messages leave
            self.endpoint.close()

    def handle_side_message(self, received: Received) -> None:
        """Everything that may arrive at any time, also while a generation runs."""
        msg = received.msg
        if isinstance(msg, Pong) and msg.ready and received.via.startswith("worker-"):
            index = worker_index(received.via)
            if index in self.returning:  # a lost worker is back and loaded: it serves from the next request
                self.returning.discard(index)
                self.rejoined.add(index)
        elif isinstance(msg, Pong) and msg.ready and received.via == "shadow" and self.shadow_returning:
            self.shadow_returning, self.shadow_back = False, True
        if self.health.observe(received):
            return
        if isinstance(msg, Ping):
            detail = "" if self.health.ready else f"waiting for {', '.join(sorted(self.health.waiting))}"
            answer_ping(self.endpoint, received, "main", self.health.ready, detail)
        elif isinstance(msg, Prediction):
            if self.request is not None and msg.request_id == self.request.request_id:
                self.request.predictions[(msg.step, msg.layer)] = msg.experts
        elif isinstance(msg, SetAlignment):
            self.set_alignment(msg)
        elif isinstance(msg, Cancel):
            if self.request is not None and msg.request_id == self.request.request_id:
                self.request.cancelled = True
        elif isinstance(msg, ExpertResult):
            self.pending_results.append((received.via, msg))
        elif isinstance(msg, WorkerStats):
            self.worker_stats[msg.worker] = msg
        elif isinstance(msg, ShadowStats):
            self.shadow_stats = msg
        elif isinstance(msg, GenerateRequest):
            self.endpoint.reply(
                received.identity,
                GenerateError(
                    request_id=msg.request_id,
                    error="main is busy with another generation; try again when it ends",
                ),
            )
        else:
            log.warning("dropped unexpected %s from %s", msg.TYPE, msg.sender)

    def set_alignment(self, msg: SetAlignment) -> None:
        try:
            schedule.validate_periods(msg.token_period, msg.kv_period)
        except ValueError as exc:
            log.warning("ignored alignment change: %s", exc)
            return
        self.token_period, self.kv_period = msg.token_period, msg.kv_period
        from_step = self.step + 1
        if self.request is not None:
            self.request.alignment_log.append(
                {"from_step": from_step, "token_period": msg.token_period, "kv_period": msg.kv_period}
            )
            if self.shadow_serving:
                self.endpoint.send(
                    "shadow",
                    SetAlignment(token_period=msg.token_period, kv_period=msg.kv_period, from_step=from_step),
                )
        log.info("alignment periods now token=%d kv=%d", msg.token_period, msg.kv_period)

    # --- one generation -------------------------------------------------------------------

    def serve_request(self, msg: GenerateRequest, client: bytes) -> None:
        error = self._check_request(msg)
        if error:
            self.endpoint.reply(client, GenerateError(request_id=msg.request_id, error=error))
            return
        state = RequestState(
            msg.request_id,
            client,
            len(msg.prompt_ids),
            msg.max_new_tokens,
            self.token_period,
            self.kv_period,
            time.perf_counter(),
        )
        self.request = state
        self.step = -1
        self.worker_stats.clear()
        self.shadow_stats = None
        prompt = torch.tensor([msg.prompt_ids], dtype=torch.long)
        self._note_links()
        if self.rejoined:
            log.info("back in the cluster: %s", ", ".join(f"worker-{w}" for w in sorted(self.rejoined)))
            self.lost -= self.rejoined
            self.rejoined.clear()
        if self.shadow_back:
            log.info("the shadow is back: predictions again from this request on")
            self.shadow_lost = self.shadow_back = False
        for w in self.live_workers():
            self.endpoint.send(
                f"worker-{w}",
                Begin(request_id=msg.request_id, prompt_len=state.prompt_len, max_new_tokens=msg.max_new_tokens),
            )
        if self.shadow_serving:
            self.endpoint.send(
                "shadow",
                ShadowBegin(
                    request_id=msg.request_id,
                    max_new_tokens=msg.max_new_tokens,
                    token_period=self.token_period,
                    kv_period=self.kv_period,
                    prompt_ids=prompt[0],
                ),
            )
        finish_reason = "length"
        try:
            output = self._generate(msg, prompt, state)
            generated = output[0, state.prompt_len :].tolist()
            if state.cancelled:
                finish_reason = "cancelled"
            elif len(generated) < msg.max_new_tokens:
                finish_reason = "stop"
            self._end_request(state)
            metrics = build_metrics(
                state,
                self.worker_stats,
                self.shadow_stats,
                self.placement,
                token_period=self.token_period,
                kv_period=self.kv_period,
            )
            metrics["roles_lost"] = sorted(state.roles_lost)
            self.endpoint.reply(
                client,
                GenerateDone(
                    request_id=msg.request_id,
                    token_ids=generated,
                    finish_reason=finish_reason,
                    metrics=metrics,
                ),
            )
        except GenerationAborted as exc:
            log.error("generation %s failed: %s", msg.request_id, exc)
            self.endpoint.reply(client, GenerateError(request_id=msg.request_id, error=str(exc)))
        except Exception as exc:  # main keeps serving; the client learns what went wrong
            log.exception("generation %s failed", msg.request_id)
            self.endpoint.reply(client, GenerateError(request_id=msg.request_id, error=f"{type(exc).__name__}: {exc}"))
        finally:
            self.request = None

    def _check_request(self, msg: GenerateRequest) -> str:
        if not self.health.ready:
            return f"the cluster is not ready: waiting for {', '.join(sorted(self.health.waiting))}"
        if not msg.prompt_ids:
            return "the prompt is empty"
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in msg.prompt_ids):
            return f"prompt token ids must be in [0, {vocab})"
        if msg.max_new_tokens < 1:
            return "max_new_tokens must be >= 1"
        if msg.do_sample and not msg.temperature > 0:
            return f"temperature must be > 0 when sampling, got {msg.temperature}"
        if msg.do_sample and not 0 < msg.top_p <= 1:
            return f"top_p must be in (0, 1], got {msg.top_p}"
        limit = self.model.config.max_position_embeddings
        if len(msg.prompt_ids) + msg.max_new_tokens > limit:
            return (
                f"prompt ({len(msg.prompt_ids)} tokens) + max_new_tokens ({msg.max_new_tokens}) exceeds "
                f"the model's context of {limit} tokens"
            )
        return ""

    @torch.inference_mode()
    def _generate(self, msg: GenerateRequest, prompt: torch.Tensor, state: RequestState) -> torch.Tensor:
        state.cache = DynamicCache(config=self.model.config)
        kwargs: dict = {"do_sample": msg.do_sample}
        if msg.do_sample:
            kwargs.update(temperature=msg.temperature, top_p=msg.top_p)
            if msg.seed is not None:
                torch.manual_seed(msg.seed)
        return self.model.generate(
            prompt.to(self.device),
            attention_mask=torch.ones_like(prompt, device=self.device),
            max_new_tokens=msg.max_new_tokens,
            cache=state.cache,
            streamer=_TokenStreamer(self, state),
            stopping_criteria=StoppingCriteriaList([_CancelCriterion(state)]),
            **kwargs,
        )

    def on_token(self, state: RequestState, token: int) -> None:
        """Called by ``generate`` after each step: stream the token, then align the shadow."""
        now = time.perf_counter()
        state.steps[-1].finished = now
        state.token_times.append(now)
        state.generated.append(token)
        report = step_report(state.steps[-1], self.placement) if state.steps else None
        self.endpoint.reply(
            state.client,
            TokenEvent(request_id=state.request_id, index=len(state.generated) - 1, token_id=token, step=report),
        )
        next_step = len(state.generated)
        if self.shadow_serving and next_step < state.max_new_tokens:
            self.endpoint.send("shadow", self._align_message(state, next_step, token))

    def _align_message(self, state: RequestState, step: int, token: int) -> Align:
        token_due, kv_due = schedule.alignment_due(step, self.token_period, self.kv_period)
        keys = values = None
        kv_from = kv_to = 0
        if kv_due and state.cache is not None:
            # The shadow gets main's cache for the positions it has not been given yet.
            kv_from, kv_to = state.kv_synced, state.cache.get_seq_length()
            keys = torch.stack([layer.keys[:, :, kv_from:kv_to] for layer in state.cache.layers])
            values = torch.stack([layer.values[:, :, kv_from:kv_to] for layer in state.cache.layers])
            state.kv_synced = kv_to
        return Align(
            request_id=state.request_id,
            step=step,
            token=token if token_due else None,
            kv_from=kv_from,
            kv_to=kv_to,
            keys=keys,
            values=values,
        )

    # --- the experts of one layer -----------------------------------------------------------

    def moe(
        self, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Sum of the routed experts' weighted outputs for [T, H] ``hidden_states``."""
        state = self.request
        if state is None:
            raise GenerationAborted("experts were called outside a generation")
        if layer == 0:
            self.step += 1
            state.steps.append(StepRecord(self.step, hidden_states.shape[0], time.perf_counter()))
        started = time.perf_counter()
        routed = self.routing.split(hidden_states, top_k_index, top_k_weights)
        predicted = state.predictions.get((self.step, layer)) if self.step > 0 else None
        if self.strategy.main_predicts and self.step > 0:
            self._predict_next_layer(state, layer, hidden_states)
        assignment, candidates = dispatch_plan(
            self.strategy, self.placement, self.step, layer, routed.experts, predicted
        )
        holders = self.placement.workers_for_layer(layer)
        try:
            assignment, candidates = reroute(assignment, candidates, self.lost, holders, layer)
        except NoSurvivor as exc:
            raise GenerationAborted(str(exc)) from None
        record = LayerRecord(layer, routed.experts, predicted)
        state.steps[-1].layers.append(record)
        expected: dict[str, int] = {}
        sent: dict[str, list[ExpertRequest]] = {}
        chunk = self.spec.settings.prefill_chunk if self.step == 0 else 0
        for worker in candidates:
            peer = f"worker-{worker}"
            batches = _batches(routed, assignment.get(worker, []), chunk)
            for segments, final in batches or [([], True)]:
                request = ExpertRequest(
                    request_id=state.request_id,
                    step=self.step,
                    layer=layer,
                    experts=[e for e, _, _ in segments],
                    counts=[n for _, _, n in segments],
                    offsets=[o for _, o, _ in segments],
                    final=final,
                    rows=torch.cat([routed.rows[e][o : o + n] for e, o, n in segments]) if segments else None,
                    weights=torch.cat([routed.weights[e][o : o + n] for e, o, n in segments]) if segments else None,
                )
                self.endpoint.send(peer, request)  # an empty one releases the worker's prefetch
                if segments:
                    sent.setdefault(peer, []).append(request)
            if batches:
                expected[peer] = len(batches)
        outputs = {e: torch.empty_like(routed.rows[e]) for e in routed.experts}
        busy: dict[str, float] = {}
        for peer, result in self._collect(expected, self.step, layer, sent, holders):
            start = 0
            for expert, count, offset in zip(result.experts, result.counts, result.offsets, strict=True):
                outputs[expert][offset : offset + count] = result.output[start : start + count]
                start += count
            record.wait_ms += result.wait_ms
            record.compute_ms += result.compute_ms
            busy[peer] = busy.get(peer, 0.0) + result.wait_ms + result.compute_ms
            record.hits += result.hits
            record.misses += result.misses
        record.worker_ms = max(busy.values(), default=0.0)
        final = self.routing.combine(routed, outputs, hidden_states.dtype)  # [T, H]
        record.dispatch_ms = (time.perf_counter() - started) * 1000
        return final

    def _predict_next_layer(self, state: RequestState, layer: int, hidden_states: torch.Tensor) -> None:
        """Speculative prefetch (``lru-offload``): the next layer's router on this layer's input.

        Mixtral-Offloading's guess: consecutive layers' inputs differ little (the residual
        stream dominates), so the next router applied now names most of its experts.
        """
        following = layer + 1
        if following >= self.placement.n_layers:
            return
        _, _, indices = self.model.model.layers[following].mlp.gate(hidden_states)
        experts = sorted(set(indices.reshape(-1).tolist()))
        state.predictions[(self.step, following)] = experts
        for worker in self.placement.workers_for_layer(following):
            self.endpoint.send(
                f"worker-{worker}",
                Prediction(request_id=state.request_id, step=self.step, layer=following, experts=experts),
            )

    def live_workers(self) -> list[int]:
        return [w for w in range(self.placement.n_workers) if w not in self.lost]

    def _note_links(self) -> None:
        """Act on the workers' links: a lost one is served around, a returning one asked if it is ready."""
        for event, peer in self.endpoint.take_link_events():
            if peer == "shadow" and self.has_shadow:
                self._note_shadow_link(event)
                continue
            if not peer.startswith("worker-"):
                continue
            index = worker_index(peer)
            if event == "lost" and index not in self.lost:
                self.lost.add(index)
                if self.request is not None:
                    self.request.roles_lost.add(peer)
                self.returning.discard(index)
                self.rejoined.discard(index)
                log.warning("%s is gone (its connection closed): the rest of its group serves its experts", peer)
            elif event == "up" and index in self.lost:
                self.returning.add(index)
                self.endpoint.send(peer, Ping())

    def _note_shadow_link(self, event: str) -> None:
        if event == "lost" and not self.shadow_lost:
            self.shadow_lost, self.shadow_returning, self.shadow_back = True, False, False
            if self.request is not None:
                self.request.roles_lost.add("shadow")
            log.warning("the shadow is gone (its connection closed): workers load what is routed until it is back")
        elif event == "up" and self.shadow_lost:
            self.shadow_returning = True
            self.endpoint.send("shadow", Ping())

    @property
    def shadow_serving(self) -> bool:
        """Whether the shadow takes part in this request: there is one, and it is not lost."""
        return self.has_shadow and not self.shadow_lost

    def _resend_lost(
        self,
        remaining_by_peer: dict[str, int],
        sent: dict[str, list[ExpertRequest]],
        holders: tuple[int, ...],
        layer: int,
    ) -> None:
        """Send what a lost worker had not answered yet to a surviving worker of the layer's group."""
        for peer in [p for p, n in remaining_by_peer.items() if n and worker_index(p) in self.lost]:
            unanswered = sent.get(peer, [])[-remaining_by_peer[peer] :]
            load = {worker_index(p): n for p, n in remaining_by_peer.items()}
            try:
                target = f"worker-{taker(holders, self.lost, load, layer)}"
            except NoSurvivor as exc:
                raise GenerationAborted(str(exc)) from None
            for request in unanswered:
                self.endpoint.send(target, request)
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
    ) -> list[tuple[str, ExpertResult]]:
        """Wait for every worker's ``expected`` answers to (step, layer), within the timeout.

        A worker lost meanwhile has what it had not answered sent to a survivor of its group.
        """
        results: list[tuple[str, ExpertResult]] = []
        remaining_by_peer = dict(expected)
        deadline = time.monotonic() + self.spec.settings.timeout_s
        self.pending_results.clear()
        while True:
            self._note_links()
            self._resend_lost(remaining_by_peer, sent, holders, layer)
            if not any(remaining_by_peer.values()):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(peer for peer, n in remaining_by_peer.items() if n)
                raise GenerationAborted(
                    f"{', '.join(missing)} did not answer layer {layer} of step {step} within "
                    f"{self.spec.settings.timeout_s:.0f} s (is the process alive?)"
                )
            received = self.endpoint.recv(timeout_s=remaining)
            if received is None:
                continue
            self.handle_side_message(received)
            for peer, result in self.pending_results:
                if remaining_by_peer.get(peer) and (result.step, result.layer) == (step, layer):
                    results.append((peer, result))
                    remaining_by_peer[peer] -= 1
                else:
                    log.warning("dropped a stale result from %s for step %d layer %d", peer, result.step, result.layer)
            self.pending_results.clear()
        return results

    def _end_request(self, state: RequestState) -> None:
        """Tell every role the request is over and gather their statistics (bounded)."""
        live = self.live_workers()
        for w in live:
            self.endpoint.send(f"worker-{w}", End(request_id=state.request_id))
        if self.shadow_serving:
            self.endpoint.send("shadow", End(request_id=state.request_id))
        deadline = time.monotonic() + self.spec.settings.timeout_s
        while time.monotonic() < deadline:
            self._note_links()
            workers_done = set(self.worker_stats) >= {w for w in self.live_workers() if w in live}
            shadow_done = not self.shadow_serving or self.shadow_stats is not None
            if workers_done and shadow_done:
                return
            received = self.endpoint.recv(timeout_s=deadline - time.monotonic())
            if received is not None:
                self.handle_side_message(received)
        log.warning("some roles did not report statistics in time; metrics are partial")


Segment = tuple[int, int, int]  # (expert, first row, rows)


def worker_index(peer: str) -> int:
    """3 for the link "worker-3"."""
    return int(peer.removeprefix("worker-"))


def _batches(routed: RoutedRows, experts: list[int], chunk: int) -> list[tuple[list[Segment], bool]]:
    """The requests one worker gets for a layer: (segments, final) pairs.

    Decode (``chunk`` 0) sends all of a worker's experts in one request; a long prefill
    sends each expert's rows as mini-batches so the worker computes one while the next
    is in flight, ``final`` on an expert's last one so the worker frees it at once.
    """
    if chunk <= 0:
        return [([(e, 0, routed.count(e)) for e in experts], True)] if experts else []
    batches: list[tuple[list[Segment], bool]] = []
    for expert in experts:
        sizes = schedule.chunk_sizes(routed.count(expert), chunk)
        offset = 0
        for i, size in enumerate(sizes):
            batches.append(([(expert, offset, size)], i == len(sizes) - 1))
            offset += size
    return batches


class _TokenStreamer(BaseStreamer):
    """Receives each new token from ``generate``; the first call carries the prompt."""

    def __init__(self, role: MainRole, state: RequestState) -> None:
        self.role = role
        self.state = state
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.role.on_token(self.state, int(value.reshape(-1)[0]))

    def end(self) -> None:
        pass


class _CancelCriterion(StoppingCriteria):
    def __init__(self, state: RequestState) -> None:
        self.state = state

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.state.cancelled, dtype=torch.bool, device=input_ids.device)


def serve(spec: RoleSpec) -> None:
    MainRole(spec).run()
