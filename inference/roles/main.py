"""The main role: attention, norms, routers, LM head and KV caches; experts are remote.

Main runs Transformers' own ``generate`` on a model whose experts implementation hands
every layer's routed rows to ``MainRole.moe``. Several sequences run at once
(``inference.batching``): each in a thread of its own, taking turns, all meeting at each
MoE layer, where main serves the layer for the whole batch in one round. It sorts each
sequence's (token, expert) pairs exactly as the reference grouped implementation does,
sends each worker of the layer's group the rows of every sequence routed to the experts
assigned to it (one segment per sequence and expert, so each expert is loaded once and
each sequence's rows are computed as in its own run), and puts the weighted answers back
in the reference order before summing, so every sequence's output is the full-precision
model's bit for bit. Between steps it streams each sequence's token to its client and
aligns the shadow. Which worker gets which expert, and whether main itself guesses the
next layer's experts, is the deployment's strategy (``inference.strategies``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict, deque
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from inference import schedule
from inference.batching import (
    Admission,
    LayerCall,
    Segment,
    Sequence,
    SequenceAborted,
    admission,
    current_sequence,
    enter_sequence,
    next_to_join,
    pack_segments,
    prefill_pieces,
)
from inference.failover import NoSurvivor, reroute, taker
from inference.importance import ResidentExperts, load_similarity, substitute
from inference.metrics import build_metrics, reported_ms, step_report
from inference.model import build_main_model, expert_dims, family_of
from inference.placement import Placement, placement_from_dict
from inference.prerouter import SequenceRoutes, attach_lora, load_prerouter, matching_slots, prerouted_weights
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
from inference.routing import Routing, resolve_arithmetic
from inference.sharding import verify_shard
from inference.spec import RoleSpec, compute_dtype
from inference.strategies import dispatch_plan, get_strategy, predictor_for
from inference.transport import Received
from inference.wire.generation import Done, Failed, Generate, Token
from inference.wire.runtime import (
    Align,
    Begin,
    Cancel,
    End,
    ExpertRequest,
    ExpertResult,
    Ping,
    Pong,
    Prediction,
    SequenceJoin,
    SequenceLeave,
    SetAlignment,
    ShadowBegin,
    ShadowStats,
    Shutdown,
    WorkerStats,
)

log = logging.getLogger(__name__)

MAX_CANCELLED_EARLY = 1024  # cancels remembered for requests not yet come (a peer flooding cancels forgets)


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
        self.family = family_of(config)
        n_experts, intermediate = expert_dims(config)
        self.routing = Routing(
            resolve_arithmetic(
                spec.settings.experts_arithmetic,
                config.hidden_size,
                intermediate,
                self.model.dtype,
                self.device,
            )
        )
        self.strategy = get_strategy(spec.settings.strategy)
        # importance substitutes experts from what workers hold.
        self.resident: ResidentExperts | None = None
        if self.strategy.substitutes:
            self.similarity = load_similarity(
                spec.shard_dir, layers=self.placement.n_layers, experts=self.placement.n_experts
            )
            self.resident = ResidentExperts(spec.settings.cache_experts)
        self.predictor = predictor_for(spec.settings.strategy, spec.settings.predictor)
        # The prerouter's heads (inference.prerouter): the routing itself under the prerouter
        # strategy (with its recovery adapter on main's attention), or odmoe's predictor.
        self.prerouter = None
        if self.predictor == "prerouter":
            trained = load_prerouter(
                spec.shard_dir,
                layers=config.num_hidden_layers,
                experts=n_experts,
                hidden=config.hidden_size,
                top_k=config.num_experts_per_tok,
            )
            self.prerouter = trained.prerouter.to(self.device)
            if self.strategy.routes_by_prediction:
                attach_lora(self.model, trained.lora, trained.shape, like_base=True)
            self.normalize_top_k = bool(getattr(config, "norm_topk_prob", True))
            self.model.model.embed_tokens.register_forward_hook(self._on_embeds)
        self.has_shadow = spec.addresses.shadow is not None and self.predictor == "shadow"
        self.endpoint = open_endpoint(spec)
        connect_peers(self.endpoint, spec, workers=True, shadow=self.has_shadow, main=False, watch=True)
        self.health = PeerHealth(self.endpoint, self.endpoint.peers)
        self.token_period = spec.settings.token_period
        self.kv_period = spec.settings.kv_period
        # Continuous batching: the sequences running, the requests waiting for a place.
        self.batch: dict[str, Sequence] = {}
        self.waiting: deque[tuple[Generate, bytes]] = deque()
        # Cancels that came before their request: a client's cancel travels another connection than
        # its request and may overtake it; the request then ends at once (as many as are remembered).
        self.cancelled_early: OrderedDict[str, None] = OrderedDict()
        # A session runs while any sequence does; workers key their loads by its steps.
        self.session = ""
        self.step = -1
        # When the session's current step began, and how long its previous one took (0: none yet),
        # as main times them: stamped on every expert request, the period each worker's hybrid
        # share is found from (``inference.hybrid.ShareController``), the same for all of them.
        self.step_began = 0.0
        self.previous_step_s = 0.0
        self.stopping = False  # a Shutdown came: end the batch and stop
        self.pending_results: list[tuple[str, ExpertResult]] = []
        self.worker_stats: dict[int, WorkerStats] = {}
        self.shadow_stats: dict[str, ShadowStats] = {}
        # Worker loss (inference.failover): gone, reconnected and asked, back and ready.
        self.lost: set[int] = set()
        self.returning: set[int] = set()
        self.rejoined: set[int] = set()
        # Shadow loss: main serves without predictions (workers load what is routed) until it is back.
        self.shadow_lost = self.shadow_returning = self.shadow_back = False
        log.info(
            "main ready to connect: %d workers in groups %s, shadow %s, %s experts arithmetic, strategy %s, "
            "up to %d sequences at once",
            self.placement.n_workers,
            self.placement.groups,
            "yes" if self.has_shadow else "no",
            self.routing.arithmetic,
            self.strategy.name,
            spec.settings.max_batch,
        )

    # --- idle loop ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while True:
                self.health.tick()
                received = self.endpoint.recv(timeout_s=0.1)
                self._note_links()
                if received is not None:
                    handle_safely(self.handle_side_message, received)
                if self.waiting and not self.stopping:
                    try:
                        self.serve_batch()
                    except Exception:  # main keeps serving; the batch's clients were told
                        log.exception("the batch failed")
                if self.stopping:
                    for peer in self.endpoint.peers:
                        self.endpoint.send(peer, Shutdown())
                    return
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
            sequence = self.batch.get(msg.request_id)
            if sequence is not None:
                sequence.state.predictions[(msg.step, msg.layer)] = msg.experts
                self._note_lead(sequence, msg.step, msg.layer)
        elif isinstance(msg, SetAlignment):
            self.set_alignment(msg)
        elif isinstance(msg, Cancel):
            self.cancel(msg.request_id)
        elif isinstance(msg, ExpertResult):
            self.pending_results.append((received.via, msg))
        elif isinstance(msg, WorkerStats):
            if msg.request_id == self.session:
                self.worker_stats[msg.worker] = msg
        elif isinstance(msg, ShadowStats):
            self.shadow_stats[msg.request_id] = msg
        elif isinstance(msg, Generate):
            self.admit(msg, received.identity)
        elif isinstance(msg, Shutdown):
            self.stopping = True  # the running batch ends after its step, its clients told why
        else:
            log.warning("dropped unexpected %s from %s", msg.TYPE, msg.sender)

    def set_alignment(self, msg: SetAlignment) -> None:
        try:
            schedule.validate_periods(msg.token_period, msg.kv_period)
        except ValueError as exc:
            log.warning("ignored alignment change: %s", exc)
            return
        self.token_period, self.kv_period = msg.token_period, msg.kv_period
        for sequence in self.batch.values():
            from_step = sequence.step + 1
            sequence.state.alignment_log.append(
                {"from_step": from_step, "token_period": msg.token_period, "kv_period": msg.kv_period}
            )
        if self.batch and self.shadow_serving:
            self.endpoint.send("shadow", SetAlignment(token_period=msg.token_period, kv_period=msg.kv_period))
        log.info("alignment periods now token=%d kv=%d", msg.token_period, msg.kv_period)

    # --- the batch ------------------------------------------------------------------------

    def admit(self, msg: Generate, client: bytes) -> None:
        """Queue a generation, or refuse it at once with the reason."""
        if msg.request_id in self.cancelled_early:
            del self.cancelled_early[msg.request_id]
            done = Done(request_id=msg.request_id, token_ids=[], finish_reason="cancelled", metrics={})
            self.endpoint.reply(client, done)
            return
        error = self._check_request(msg)
        if not error and (msg.request_id in self.batch or any(w.request_id == msg.request_id for w, _ in self.waiting)):
            error = f"a generation with id {msg.request_id!r} is already running"
        if error:
            self.endpoint.reply(client, Failed(request_id=msg.request_id, error=error))
            return
        settings = self.spec.settings
        running, waiting = [s.user for s in self.batch.values()], [m.user for m, _ in self.waiting]
        decision = admission(
            msg.user, running, waiting, max_waiting=settings.max_waiting, max_per_user=settings.max_per_user
        )
        if decision is Admission.TOO_MANY:
            error = (
                f"this user already has {settings.max_per_user} generations running or waiting on this deployment, "
                "the most one user may have at once; send more when one ends"
            )
        elif decision is Admission.FULL:
            error = (
                f"main is full: {len(self.batch)} sequences running and {len(self.waiting)} waiting; "
                "try again when one ends"
            )
        if error:
            refusal = Failed(
                request_id=msg.request_id,
                error=error,
                busy=decision is Admission.FULL,
                too_many_generations=decision is Admission.TOO_MANY,
            )
            self.endpoint.reply(client, refusal)
            return
        self.waiting.append((msg, client))

    def cancel(self, request_id: str) -> None:
        """Stop a running sequence after its current step, or drop a waiting one at once."""
        sequence = self.batch.get(request_id)
        if sequence is not None:
            sequence.state.cancelled = True
            return
        for entry in list(self.waiting):
            if entry[0].request_id == request_id:
                self.waiting.remove(entry)
                self.endpoint.reply(
                    entry[1], Done(request_id=request_id, token_ids=[], finish_reason="cancelled", metrics={})
                )
                return
        self.cancelled_early[request_id] = None  # not here yet (or long done): its request may still come
        while len(self.cancelled_early) > MAX_CANCELLED_EARLY:
            self.cancelled_early.popitem(last=False)

    def serve_batch(self) -> None:
        """Run batch steps until no sequence runs and none waits (or main is told to stop)."""
        reason = "main failed while serving the batch"
        try:
            while (self.batch or self.waiting) and not self.stopping:
                self._join_waiting()
                self._batch_step()
                self._drain_inbox()
            reason = "main is shutting down"
        finally:
            for sequence in list(self.batch.values()):  # on a stop, or an error of main's own
                self._abort(sequence, reason)
            while self.waiting:
                msg, client = self.waiting.popleft()
                self.endpoint.reply(client, Failed(request_id=msg.request_id, error=reason))
            if self.session:
                self._end_session()

    def _join_waiting(self) -> None:
        """Start waiting requests, up to the batch's size, between two steps."""
        while self.waiting and len(self.batch) < self.spec.settings.max_batch:
            chosen = next_to_join([m.user for m, _ in self.waiting], [s.user for s in self.batch.values()])
            msg, client = self.waiting[chosen]
            del self.waiting[chosen]
            if not self.session:
                self._begin_session(msg)
            state = RequestState(
                msg.request_id,
                client,
                len(msg.prompt_ids),
                msg.max_new_tokens,
                self.token_period,
                self.kv_period,
                time.perf_counter(),
            )
            if self.prerouter is not None:
                state.routes = SequenceRoutes(self.prerouter)
            prompt = torch.tensor([msg.prompt_ids], dtype=torch.long)
            # A prompt prefilled in pieces takes a step per piece; its step 0, as the workers
            # and the shadow count, is the last piece's.
            pieces = prefill_pieces(len(msg.prompt_ids), self.spec.settings.prefill_step)
            sequence = Sequence(
                state,
                lambda sequence, msg=msg, prompt=prompt: self._generate(sequence, msg, prompt),
                self.device,
                self.spec.settings.threads,
                joined_step=self.step + len(pieces),
                user=msg.user,
            )
            self.batch[msg.request_id] = sequence
            for w in self.live_workers():
                self.endpoint.send(
                    f"worker-{w}",
                    SequenceJoin(request_id=self.session, sequence=msg.request_id, first_step=sequence.joined_step),
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
            sequence.resume()  # its prefill runs up to the first MoE layer
            if sequence.finished:
                self._finish(sequence)

    def _batch_step(self) -> None:
        """Every sequence's next token: each layer's experts served once for the whole batch."""
        self.step += 1
        began, self.step_began = self.step_began, time.perf_counter()
        self.previous_step_s = self.step_began - began if self.step > 0 else 0.0
        size = len(self.batch)
        for layer in range(self.placement.n_layers):
            calls = [s for s in self.batch.values() if s.call is not None]
            if not calls:
                return
            stray = [s.request_id for s in calls if s.call.layer != layer]  # type: ignore[union-attr]
            if stray:
                raise RuntimeError(f"sequences {stray} are not at layer {layer} with the rest of the batch")
            if layer == 0:
                for s in calls:
                    s.state.steps[-1].batch = size
            try:
                answers = self.serve_layer(layer, calls)
            except GenerationAborted as exc:
                for s in calls:
                    s.answer_with(None, abort=str(exc))
            else:
                for s, answer in zip(calls, answers, strict=True):
                    s.answer_with(answer)
            for s in calls:
                if s.finished:
                    self._finish(s)

    def _drain_inbox(self) -> None:
        """Between steps: whatever arrived (new requests, cancels, pings, predictions)."""
        self._note_links()
        while (received := self.endpoint.recv(timeout_s=0.0)) is not None:
            handle_safely(self.handle_side_message, received)

    def _begin_session(self, first: Generate) -> None:
        self.session = f"session-{uuid.uuid4().hex[:12]}"
        self.step = -1
        self.worker_stats.clear()
        self._note_links()
        if self.rejoined:
            log.info("back in the cluster: %s", ", ".join(f"worker-{w}" for w in sorted(self.rejoined)))
            self.lost -= self.rejoined
            self.rejoined.clear()
        if self.shadow_back:
            log.info("the shadow is back: predictions again from this session on")
            self.shadow_lost = self.shadow_back = False
        for w in self.live_workers():
            self.endpoint.send(
                f"worker-{w}",
                Begin(request_id=self.session, prompt_len=len(first.prompt_ids), max_new_tokens=first.max_new_tokens),
            )

    def _finish(self, sequence: Sequence) -> None:
        """A sequence left the batch: end it everywhere and answer its client."""
        state = sequence.state
        # Still in the batch while the shadow ends it: its last predictions may be on the way.
        shadow_stats = self._end_shadow(state.request_id)
        del self.batch[state.request_id]
        last = not self.batch and not self.waiting
        if last:
            self._end_session()  # workers report the session's statistics, which this answer carries
        else:  # the others go on: the workers forget its predictions (and may plan for one sequence again)
            leave = SequenceLeave(
                request_id=self.session, sequence=state.request_id, last_step=max(self.step, sequence.joined_step)
            )
            for w in self.live_workers():
                self.endpoint.send(f"worker-{w}", leave)
        if sequence.error is not None:
            exc = sequence.error
            if isinstance(exc, (GenerationAborted, SequenceAborted)):
                log.error("generation %s failed: %s", state.request_id, exc)
                error = str(exc)
            else:
                log.error("generation %s failed", state.request_id, exc_info=exc)
                error = f"{type(exc).__name__}: {exc}"
            self.endpoint.reply(state.client, Failed(request_id=state.request_id, error=error))
            return
        generated = sequence.result[0, state.prompt_len :].tolist()  # type: ignore[index]
        finish_reason = "length"
        if state.cancelled:
            finish_reason = "cancelled"
        elif len(generated) < state.max_new_tokens:
            finish_reason = "stop"
        metrics = build_metrics(
            state,
            dict(self.worker_stats) if last else {},
            shadow_stats,
            self.placement,
            token_period=self.token_period,
            kv_period=self.kv_period,
        )
        metrics["roles_lost"] = sorted(state.roles_lost)
        metrics["joined_step"] = sequence.joined_step
        metrics["prefill_pieces"] = len(prefill_pieces(state.prompt_len, self.spec.settings.prefill_step))
        metrics["max_batch"] = max((step.batch for step in state.steps), default=1)
        self.endpoint.reply(
            state.client,
            Done(request_id=state.request_id, token_ids=generated, finish_reason=finish_reason, metrics=metrics),
        )

    def _abort(self, sequence: Sequence, reason: str) -> None:
        """Let a waiting sequence fail at its layer and end it."""
        while not sequence.finished:
            sequence.answer_with(None, abort=reason)
        self._finish(sequence)

    def _check_request(self, msg: Generate) -> str:
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

    def _generate(self, sequence: Sequence, msg: Generate, prompt: torch.Tensor) -> torch.Tensor:
        """The sequence's thread: Transformers' ``generate``, exactly as for one sequence alone."""
        enter_sequence(sequence)
        state = sequence.state
        with torch.inference_mode():
            state.cache = DynamicCache(config=self.model.config)
            # Chunked prefill: every piece but the last is a step of its own, run straight
            # through the model into the cache; ``generate`` then prefills the rest (it feeds
            # only the positions the cache lacks) and decodes.
            for start, end in prefill_pieces(prompt.shape[1], self.spec.settings.prefill_step)[:-1]:
                if state.cancelled:
                    return prompt
                self.model(
                    input_ids=prompt[:, start:end].to(self.device),
                    cache=state.cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
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
            Token(request_id=state.request_id, index=len(state.generated) - 1, token_id=token, step=report),
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
        """Sum of the routed experts' weighted outputs for [T, H] ``hidden_states``.

        Called in a sequence's thread: the sequence waits here until main has served the
        layer for the whole batch (``serve_layer``).
        """
        sequence = current_sequence()
        if sequence is None:
            raise GenerationAborted("experts were called outside a generation")
        if layer == 0:
            state = sequence.state
            if state.steps and not state.token_times:  # the next piece of a chunked prefill: still step 0
                state.steps[-1].tokens += hidden_states.shape[0]
            else:
                state.steps.append(StepRecord(len(state.steps), hidden_states.shape[0], time.perf_counter()))
        return sequence.wait_at(LayerCall(layer, hidden_states, top_k_index, top_k_weights))

    def serve_layer(self, layer: int, batch: list[Sequence]) -> list[torch.Tensor]:
        """The layer's experts for every sequence of ``batch``, each expert loaded once for all of them."""
        started = time.perf_counter()
        if self.prerouter is not None:
            self._preroute(layer, batch)
        if self.resident is not None:
            self._substitute(layer, batch)
        calls = [s.call for s in batch]
        routed = [self.routing.split(c.hidden_states, c.top_k_index, c.top_k_weights) for c in calls]  # type: ignore[union-attr]
        steps = [s.step for s in batch]
        prefilling = 0 in steps
        if self.predictor == "next-gate":
            self._predict_next_layer(layer, batch)
        predicted_each = [
            s.state.predictions.get((step, layer)) if step > 0 else None for s, step in zip(batch, steps, strict=True)
        ]
        known = [p for p in predicted_each if p is not None]
        predicted = sorted(set().union(*known)) if known else None
        real = sorted(set().union(*(r.experts for r in routed)))
        # A layer with a prefill in it is planned as a prefill (every worker takes a share).
        assignment, candidates = dispatch_plan(
            self.strategy, self.placement, 0 if prefilling else max(self.step, 1), layer, real, predicted
        )
        holders = self.placement.workers_for_layer(layer)
        try:
            assignment, candidates = reroute(assignment, candidates, self.lost, holders, layer)
        except NoSurvivor as exc:
            raise GenerationAborted(str(exc)) from None
        if self.resident is not None:
            for worker, experts in assignment.items():
                self.resident.used(worker, layer, experts)
        records = [LayerRecord(layer, r.experts, p) for r, p in zip(routed, predicted_each, strict=True)]
        for s, record in zip(batch, records, strict=True):
            s.state.steps[-1].layers.append(record)
        # Each expert's rows: every sequence's, one after another; where each sequence's start.
        rows: dict[int, torch.Tensor] = {}
        weights: dict[int, torch.Tensor] = {}
        starts: list[dict[int, int]] = [{} for _ in batch]
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
        chunk = self.spec.settings.prefill_chunk
        expected: dict[str, int] = {}
        sent: dict[str, list[ExpertRequest]] = {}
        for worker in candidates:
            peer = f"worker-{worker}"
            segments = [
                Segment(expert, starts[i][expert] + offset, size)
                for expert in assignment.get(worker, [])
                for i, r in enumerate(routed)
                if expert in r.rows
                # A prefill's rows go in the mini-batches its own run would use.
                for offset, size in _pieces(schedule.chunk_sizes(r.count(expert), chunk if steps[i] == 0 else 0))
            ]
            requests = pack_segments(segments, chunk if prefilling else 0)
            for pieces, final in requests or [([], True)]:
                request = ExpertRequest(
                    request_id=self.session,
                    step=self.step,
                    layer=layer,
                    experts=[p.expert for p in pieces],
                    counts=[p.count for p in pieces],
                    offsets=[p.offset for p in pieces],
                    final=final,
                    previous_step_s=self.previous_step_s,
                    rows=torch.cat([rows[p.expert][p.offset : p.offset + p.count] for p in pieces]) if pieces else None,
                    weights=torch.cat([weights[p.expert][p.offset : p.offset + p.count] for p in pieces])
                    if pieces
                    else None,
                )
                self.endpoint.send(peer, request)  # an empty one releases the worker's prefetch
                if pieces:
                    sent.setdefault(peer, []).append(request)
            if requests:
                expected[peer] = len(requests)
        sent_at = time.perf_counter()
        answers_in, last_receive_ms = self._collect(expected, self.step, layer, sent, holders)
        answered_at = time.perf_counter()
        outputs = {e: torch.empty_like(rows[e]) for e in real}
        busy: dict[str, float] = {}
        handled: dict[str, float] = {}
        received: dict[str, float] = {}
        wait_ms = compute_ms = 0.0
        hits = misses = 0
        for peer, result in answers_in:
            start = 0
            for expert, count, offset in zip(result.experts, result.counts, result.offsets, strict=True):
                outputs[expert][offset : offset + count] = result.output[start : start + count]
                start += count
            # A worker's own figures, for the records only: what is not a time is not counted.
            waited, computed = reported_ms(result.wait_ms), reported_ms(result.compute_ms)
            wait_ms += waited
            compute_ms += computed
            busy[peer] = busy.get(peer, 0.0) + waited + computed
            handled[peer] = handled.get(peer, 0.0) + reported_ms(result.handled_ms)
            received[peer] = received.get(peer, 0.0) + reported_ms(result.received_ms)
            hits += result.hits
            misses += result.misses
        answers = []
        for i, r in enumerate(routed):
            mine = {e: outputs[e][starts[i][e] : starts[i][e] + r.count(e)] for e in r.experts}
            answers.append(self.routing.combine(r, mine, calls[i].hidden_states.dtype))  # type: ignore[union-attr]
        dispatch_ms = (time.perf_counter() - started) * 1000
        for record in records:  # the layer's figures, shared by the batch
            record.wait_ms, record.compute_ms, record.hits, record.misses = wait_ms, compute_ms, hits, misses
            record.worker_ms = max(busy.values(), default=0.0)
            record.dispatch_ms = dispatch_ms
            record.send_ms = (sent_at - started) * 1000
            record.await_ms = (answered_at - sent_at) * 1000
            if answers_in:  # the worker main waited for last, all its requests of the layer
                last = answers_in[-1][0]
                record.last_handled_ms, record.last_busy_ms = handled[last], busy[last]
                record.last_received_ms = received[last] + last_receive_ms
        return answers

    def _predict_next_layer(self, layer: int, batch: list[Sequence]) -> None:
        """The ``next-gate`` predictor: the next layer's router on this layer's input.

        Mixtral-Offloading's guess: consecutive layers' inputs differ little (the residual
        stream dominates), so the next router applied now names most of its experts. The
        workers get the union over the batch's decoding sequences.
        """
        following = layer + 1
        if following >= self.placement.n_layers:
            return
        union: set[int] = set()
        for s in batch:
            if s.step > 0:
                router = self.family.router(self.model.model.layers[following])
                _, _, indices = router(s.call.hidden_states)  # type: ignore[union-attr]
                experts = sorted(set(indices.reshape(-1).tolist()))
                s.state.predictions[(s.step, following)] = experts
                self._note_lead(s, s.step, following)
                union.update(experts)
        if not union:
            return
        for worker in self.placement.workers_for_layer(following):
            self.endpoint.send(
                f"worker-{worker}",
                Prediction(request_id=self.session, step=self.step, layer=following, experts=sorted(union)),
            )

    def _on_embeds(self, _module, _args, embeds: torch.Tensor) -> None:
        """A sequence's step embedded its tokens (in its thread): a decode token's layer-0 prediction
        goes out now, before any of the step's attention runs."""
        sequence = current_sequence()
        if sequence is None or sequence.state.routes is None:
            return
        chosen = sequence.state.routes.embedded(embeds.reshape(-1, embeds.shape[-1]))
        if chosen is not None:
            self._send_prediction(sequence, len(sequence.state.steps), 0, chosen)

    def _preroute(self, layer: int, batch: list[Sequence]) -> None:
        """The prerouter's heads on this layer: under the prerouter strategy their choice becomes
        each sequence's routing (weighted by the real router's probabilities); for a decoding
        sequence, the next layer's prediction goes to its workers before this layer is dispatched."""
        gate = self.family.router(self.model.model.layers[layer])
        for s in batch:
            call, routes = s.call, s.state.routes
            if call is None or routes is None:
                continue
            real = call.top_k_index
            chosen = routes.served(layer, call.hidden_states, real).to(real.device)
            if self.strategy.routes_by_prediction:
                logits = F.linear(call.hidden_states, gate.weight)  # what the router computed
                call.top_k_index = chosen
                call.top_k_weights = prerouted_weights(logits, chosen, normalize=self.normalize_top_k).to(
                    call.top_k_weights.dtype
                )
                s.state.router_slots += chosen.numel()
                s.state.router_matches += matching_slots(chosen, real)
            following = routes.next_layer(layer) if s.step > 0 else None
            if following is not None:
                self._send_prediction(s, s.step, layer + 1, following)

    def _send_prediction(self, sequence: Sequence, step: int, layer: int, chosen: torch.Tensor) -> None:
        """Main's own prediction of ``layer`` at the sequence's ``step``, to the layer's workers (one layer ahead)."""
        experts = sorted(set(chosen.reshape(-1).tolist()))
        sequence.state.predictions[(step, layer)] = experts
        sequence.state.prediction_leads.append(1)
        for worker in self.placement.workers_for_layer(layer):
            self.endpoint.send(
                f"worker-{worker}",
                Prediction(request_id=sequence.request_id, step=step, layer=layer, experts=experts),
            )

    def _substitute(self, layer: int, batch: list[Sequence]) -> None:
        """importance: each decoding sequence's low-importance experts no worker holds become held ones."""
        assert self.resident is not None
        held = self.resident.resident(layer)
        threshold = self.spec.settings.importance_threshold
        for s in batch:
            call = s.call
            if s.step == 0 or call is None:
                continue  # a prefill computes exactly what is routed
            chosen, count = substitute(call.top_k_index, call.top_k_weights, held, self.similarity[layer], threshold)
            call.top_k_index = chosen
            state = s.state
            state.substitutions += count
            state.expert_slots += chosen.numel()
            state.resident_slots += sum(1 for e in chosen.reshape(-1).tolist() if e in held)

    def _note_lead(self, sequence: Sequence, step: int, layer: int) -> None:
        """How many layers ahead of ``sequence`` a prediction for (``step``, ``layer``) came.

        Where the sequence is: the layer it waits at, or the first of its step while it runs
        main's own part; a prediction for a layer already served counts nowhere (too late).
        """
        here = sequence.call.layer if sequence.call is not None else 0
        lead = (step - sequence.step) * self.placement.n_layers + (layer - here)
        if lead > 0:
            sequence.state.prediction_leads.append(lead)

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
                if self.resident is not None:
                    self.resident.forget(index)
                for sequence in self.batch.values():
                    sequence.state.roles_lost.add(peer)
                self.returning.discard(index)
                self.rejoined.discard(index)
                log.warning("%s is gone (its connection closed): the rest of its group serves its experts", peer)
            elif event == "up" and index in self.lost:
                self.returning.add(index)
                self.endpoint.send(peer, Ping())

    def _note_shadow_link(self, event: str) -> None:
        if event == "lost" and not self.shadow_lost:
            self.shadow_lost, self.shadow_returning, self.shadow_back = True, False, False
            for sequence in self.batch.values():
                sequence.state.roles_lost.add("shadow")
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
    ) -> tuple[list[tuple[str, ExpertResult]], float]:
        """Wait for every worker's ``expected`` answers to (step, layer), within the timeout; with
        them, main's time with the last one from its frames off the socket (decoding, other
        messages read with it) to here, in ms.

        A worker lost meanwhile has what it had not answered sent to a survivor of its group.
        """
        results: list[tuple[str, ExpertResult]] = []
        last_receive_ms = 0.0
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
                    last_receive_ms = max(0.0, time.monotonic() - received.ready_at) * 1000
                else:
                    log.warning("dropped a stale result from %s for step %d layer %d", peer, result.step, result.layer)
            self.pending_results.clear()
        return results, last_receive_ms

    def _end_session(self) -> None:
        """Tell the workers the session is over and gather their statistics (bounded)."""
        live = self.live_workers()
        for w in live:
            self.endpoint.send(f"worker-{w}", End(request_id=self.session))
        deadline = time.monotonic() + self.spec.settings.timeout_s
        try:
            while time.monotonic() < deadline:
                self._note_links()
                if set(self.worker_stats) >= {w for w in self.live_workers() if w in live}:
                    return
                self._wait_for_side_message(deadline)
            log.warning("some workers did not report statistics in time; metrics are partial")
        finally:
            self.session = ""

    def _end_shadow(self, request_id: str) -> ShadowStats | None:
        """Tell the shadow a sequence is over; its statistics for it, if they come in time."""
        if not self.shadow_serving:
            return None
        self.endpoint.send("shadow", End(request_id=request_id))
        deadline = time.monotonic() + self.spec.settings.timeout_s
        while request_id not in self.shadow_stats and self.shadow_serving and time.monotonic() < deadline:
            self._note_links()
            self._wait_for_side_message(deadline)
        if request_id not in self.shadow_stats:
            log.warning("the shadow did not report statistics for %s in time; metrics are partial", request_id)
        return self.shadow_stats.pop(request_id, None)

    def _wait_for_side_message(self, deadline: float) -> None:
        received = self.endpoint.recv(timeout_s=max(0.0, deadline - time.monotonic()))
        if received is not None:
            handle_safely(self.handle_side_message, received)


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
