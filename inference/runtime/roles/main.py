"""The main role: its sockets and peers, admission, sessions and health; the engine steps the batch.

Main holds everything of the model but the experts: embeddings, attention, norms, routers,
LM head and the KV caches. Its engine (``inference.runtime.engine``) runs every sequence of the
batch in one thread, one step at a time: a pure scheduler decides who joins, leaves and
prefills; the model runner runs each sequence's attention on its own shapes and, at each
MoE layer, hands every sequence's routed rows to the layer exchange, which serves the layer
for the whole batch in one round of the workers (each expert loaded once for every row
routed to it) and gives each sequence exactly the full-precision model's output; then each
sequence samples its token, streams it and aligns the shadow. This module is the role
around it: requests admitted or refused (admission first; a request's grammar then compiles off
the loop, ``inference.runtime.engine.compiles``, and the request queues once it has), cancels,
predictions and alignment changes taken at any time, sessions begun and ended with the
workers, lost workers and shadow served around (``inference.policies.failover``). Which worker
gets which expert, and whether main itself guesses the next layer's experts, is the deployment's
strategy (``inference.policies.strategies``).
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import torch

from inference.modelio.model import build_main_model, expert_dims, family_of
from inference.modelio.shards import verify_shard
from inference.policies import alignment
from inference.policies.placement import Placement, placement_from_dict
from inference.policies.strategies import get_strategy, predictor_for
from inference.runtime.engine.compiles import Compiles
from inference.runtime.engine.engine import Engine, cancelled
from inference.runtime.engine.exchange import Exchange, worker_index
from inference.runtime.engine.grammar import GrammarError, grammar_tokenizer, walked
from inference.runtime.engine.guesses import Guesses
from inference.runtime.engine.host import Served
from inference.runtime.engine.sampling import check_generation_config
from inference.runtime.engine.scheduler import Admission, admission, refusal, request_problem
from inference.runtime.importance import ResidentExperts, load_similarity
from inference.runtime.prerouter import attach_lora, load_prerouter
from inference.runtime.roles.common import (
    PeerHealth,
    answer_ping,
    connect_peers,
    handle_safely,
    open_endpoint,
    pick_device,
    release_free_heap,
)
from inference.runtime.routing import Routing, resolve_arithmetic
from inference.runtime.spec import RoleSpec, compute_dtype
from inference.runtime.transport import Received
from inference.wire.base import Message
from inference.wire.runtime import (
    Align,
    Begin,
    Cancel,
    Done,
    DraftAsk,
    Drafts,
    End,
    ExpertResult,
    Failed,
    Generate,
    Ping,
    Pong,
    Prediction,
    Predictions,
    SequenceJoin,
    SequenceLeave,
    SetAlignment,
    ShadowBegin,
    ShadowStats,
    Shutdown,
    Token,
    WorkerStats,
)

log = logging.getLogger(__name__)

MAX_CANCELLED_EARLY = 1024  # cancels remembered for requests not yet come (a peer flooding cancels forgets)
# How long the idle loop waits for a message while a grammar compiles: how late, at most, a request
# whose grammar compiled while nothing ran enters the queue (between steps, it enters at the next).
COMPILE_POLL_S = 0.005


class MainRole:
    def __init__(self, spec: RoleSpec) -> None:
        self.spec = spec
        self.device = pick_device(spec.settings.device)
        manifest = verify_shard(spec.shard_dir, expect_role="main")
        self.placement: Placement = placement_from_dict(manifest["placement"])
        if self.placement.n_workers != len(spec.addresses.workers):
            raise RuntimeError(
                f"shards were built for {self.placement.n_workers} workers but the peer table lists "
                f"{len(spec.addresses.workers)}"
            )
        self._load_model()
        self.strategy = get_strategy(spec.settings.strategy)
        self.predictor = predictor_for(spec.settings.strategy, spec.settings.predictor)
        guesses = self._load_guesses()
        self.has_shadow = spec.addresses.shadow is not None and self.predictor == "shadow"
        self.endpoint = open_endpoint(spec)
        connect_peers(self.endpoint, spec, workers=True, shadow=self.has_shadow, main=False, watch=True)
        self.health = PeerHealth(self.endpoint, self.endpoint.peers)
        # Cancels that came before their request: a client's cancel travels another connection than
        # its request and may overtake it; the request then ends at once (as many as are remembered).
        self.cancelled_early: OrderedDict[str, None] = OrderedDict()
        # A session runs while any sequence does; workers key their loads by its steps.
        self.session = ""
        self.step = -1
        # When the session's current step began, and how long its previous one took (0: none yet),
        # as main times them: stamped on every expert request, the period each worker's hybrid
        # share is found from (``inference.policies.hybrid.ShareController``), the same for all of them.
        self.step_began = 0.0
        self.previous_step_s = 0.0
        self.stopping = False  # a Shutdown came: end the batch and stop
        self.pending_results: list[tuple[str, ExpertResult]] = []
        self.worker_stats: dict[int, WorkerStats] = {}
        self.shadow_stats: dict[str, ShadowStats] = {}
        # Worker loss (inference.policies.failover): gone, reconnected and asked, back and ready.
        self.lost: set[int] = set()
        self.returning: set[int] = set()
        self.rejoined: set[int] = set()
        # Shadow loss: main serves without predictions (workers load what is routed) until it is back.
        self.shadow_lost = self.shadow_returning = self.shadow_back = False
        exchange = Exchange(
            self,
            self.placement,
            self.strategy,
            self.routing,
            guesses,
            prefill_chunk=spec.settings.prefill_chunk,
            timeout_s=spec.settings.timeout_s,
            on_used=self.resident.used if self.resident is not None else None,
        )
        served = Served(spec.settings, self.model, self.family, self.device, self.placement, self.prerouter)
        self.engine = Engine(self, served, exchange, guesses)
        # Requests whose grammar compiles, off the loop (the model's tokenizer is read at the first).
        self.compiles: Compiles[Generate] = Compiles(
            functools.partial(grammar_tokenizer, str(spec.shard_dir), self.model.config.vocab_size, self.engine.eos)
        )
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

    def _load_model(self) -> None:
        """Main's part of the model from its shard, on its device, and the experts arithmetic."""
        spec = self.spec
        config = json.loads((Path(spec.shard_dir) / "config.json").read_text())
        self.model = build_main_model(spec.shard_dir, dtype=compute_dtype(spec.settings.dtype, config))
        self.model.to(self.device)
        check_generation_config(self.model)  # refuse, at startup, what the engine would not honour
        release_free_heap()
        config = self.model.config
        self.family = family_of(config)
        _, intermediate = expert_dims(config)
        self.routing = Routing(
            resolve_arithmetic(
                spec.settings.experts_arithmetic, config.hidden_size, intermediate, self.model.dtype, self.device
            )
        )

    def _load_guesses(self) -> Guesses:
        """Main's own guesses by strategy: importance's resident experts, the prerouter's heads."""
        config = self.model.config
        self.resident, similarity, self.prerouter = strategy_parts(
            self.spec, self.model, self.placement, self.strategy, self.predictor, self.device
        )
        return Guesses(
            self,
            self.model,
            self.family,
            self.placement,
            self.strategy,
            predictor=self.predictor,
            prerouter=self.prerouter,
            normalize_top_k=bool(getattr(config, "norm_topk_prob", True)),
            resident=self.resident,
            similarity=similarity,
            importance_threshold=self.spec.settings.importance_threshold,
        )

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        """Main's one loop: its inbox read (waiting briefly while idle), then a step of the batch
        while any sequence runs or waits; on a Shutdown, every client answered and the peers told."""
        try:
            while not self.stopping:
                self.health.tick()
                self.take_inbox(wait_s=0.0 if self.engine.busy else COMPILE_POLL_S if self.compiles.pending else 0.1)
                if self.engine.busy and not self.stopping:
                    try:
                        self.engine.step()
                    except Exception:  # main keeps serving; the batch's clients are told
                        log.exception("the batch failed")
                        self._abort("main failed while serving the batch")
                if not self.engine.busy and self.session:
                    self.end_session()  # its last sequence left, or its waiting ones were cancelled
            self._abort("main is shutting down")  # the running batch ends, its clients told why
            for msg, client in self.compiles.drain():
                self.endpoint.reply(client, Failed(request_id=msg.request_id, error="main is shutting down"))
            for peer in self.endpoint.peers:
                self.endpoint.send(peer, Shutdown())
        finally:
            self.compiles.close()
            time.sleep(0.2)  # let the Shutdown messages leave
            self.endpoint.close()

    def _abort(self, reason: str) -> None:
        """Every request ended with ``reason``, and the session; main serves on whatever fails meanwhile."""
        try:
            self.engine.abort(reason)
            self.end_session()
        except Exception:
            log.exception("ending the batch failed")
            self.session = ""

    def take_inbox(self, wait_s: float) -> None:
        """Whatever arrived (new requests, cancels, pings, predictions), waiting up to ``wait_s`` for
        the first; then the requests whose grammar compiled meanwhile."""
        received = self.endpoint.recv(timeout_s=wait_s)
        self.note_links()
        while received is not None:
            handle_safely(self.handle_side_message, received)
            received = self.endpoint.recv(timeout_s=0.0)
        if not self.stopping:
            self.take_compiled()

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
        elif isinstance(msg, Prediction | Predictions):
            self.engine.predicted(msg.items if isinstance(msg, Predictions) else [msg])
        elif isinstance(msg, Drafts):
            self.engine.drafted(msg)
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
            alignment.validate_periods(msg.token_period, msg.kv_period)
        except ValueError as exc:
            log.warning("ignored alignment change: %s", exc)
            return
        if self.engine.realign(msg.token_period, msg.kv_period) and self.shadow_serving:
            self.endpoint.send("shadow", SetAlignment(token_period=msg.token_period, kv_period=msg.kv_period))
        log.info("alignment periods now token=%d kv=%d", msg.token_period, msg.kv_period)

    # --- the batch ------------------------------------------------------------------------

    def admit(self, msg: Generate, client: bytes) -> None:
        """Queue a generation, or refuse it at once with the reason."""
        if self.stopping:  # one that came while the batch ends would wait for nothing
            self.endpoint.reply(client, Failed(request_id=msg.request_id, error="main is shutting down"))
            return
        if msg.request_id in self.cancelled_early:
            del self.cancelled_early[msg.request_id]
            self.endpoint.reply(client, cancelled(msg.request_id))
            return
        error = ""
        if not self.health.ready:
            error = f"the cluster is not ready: waiting for {', '.join(sorted(self.health.waiting))}"
        config = self.model.config
        error = error or request_problem(msg, vocab=config.vocab_size, context=config.max_position_embeddings)
        if not error and (self.engine.holds(msg.request_id) or self.compiles.holds(msg.request_id)):
            error = f"a generation with id {msg.request_id!r} is already running"
        if error:
            self.endpoint.reply(client, Failed(request_id=msg.request_id, error=error))
            return
        # Admission before any compile: a request refused here costs main nothing, and one whose
        # grammar compiles counts as waiting, so one user cannot queue compiles past max_per_user.
        settings = self.spec.settings
        running, queued = self.engine.users()
        waiting = queued + self.compiles.users()
        decision = admission(
            msg.user, running, waiting, max_waiting=settings.max_waiting, max_per_user=settings.max_per_user
        )
        if decision is not Admission.ADMIT:
            error = refusal(decision, max_per_user=settings.max_per_user, running=len(running), waiting=len(waiting))
            busy, too_many = decision is Admission.FULL, decision is Admission.TOO_MANY
            self.endpoint.reply(
                client, Failed(request_id=msg.request_id, error=error, busy=busy, too_many_generations=too_many)
            )
            return
        problem = self.compiles.submit(msg, client) if msg.grammar else ""
        if problem is None:
            return  # its grammar compiles off the loop; it queues when that ends (take_compiled)
        self._queue(msg, client, problem)

    def take_compiled(self) -> None:
        """Requests whose grammar compiled queue now; those whose grammar cannot be served are answered."""
        running, waiting = self.engine.users()
        busy = running + waiting
        for msg, client, problem in self.compiles.poll(busy):
            self._queue(msg, client, problem)

    def _queue(self, msg: Generate, client: bytes, problem: str) -> None:
        matcher = None
        if not problem and msg.grammar:  # a grammar's matcher is its own copy, taken now
            matcher, problem = take_matcher(self.compiles, msg)
        if problem:
            self.endpoint.reply(client, Failed(request_id=msg.request_id, error=problem))
        else:
            self.engine.submit(msg, client, matcher)

    def cancel(self, request_id: str) -> None:
        """Stop a running sequence after its current step, or drop a waiting one (queued, or waiting
        for its grammar's compile, which goes on in its thread and is kept) at once."""
        if self.engine.cancel(request_id):
            return
        waiting = self.compiles.cancel(request_id)
        if waiting is not None:
            self.endpoint.reply(waiting[1], cancelled(request_id))
            return
        self.cancelled_early[request_id] = None  # not here yet (or long done): its request may still come
        while len(self.cancelled_early) > MAX_CANCELLED_EARLY:
            self.cancelled_early.popitem(last=False)

    def begin_step(self) -> None:
        """A batch step begins: the session's step count and clock move on."""
        self.step += 1
        began, self.step_began = self.step_began, time.perf_counter()
        self.previous_step_s = self.step_began - began if self.step > 0 else 0.0

    def begin_session(self, first: Generate) -> None:
        self.session = f"session-{uuid.uuid4().hex[:12]}"
        self.step = -1
        self.worker_stats.clear()
        self.note_links()
        if self.rejoined:
            log.info("back in the cluster: %s", ", ".join(f"worker-{w}" for w in sorted(self.rejoined)))
            self.lost -= self.rejoined
            self.rejoined.clear()
        if self.shadow_back:
            log.info("the shadow is back: predictions again from this session on")
            self.shadow_lost = self.shadow_back = False
        self.to_live_workers(
            Begin(request_id=self.session, prompt_len=len(first.prompt_ids), max_new_tokens=first.max_new_tokens)
        )

    def announce_join(self, msg: Generate, pieces: int, shadow_begin: ShadowBegin) -> int:
        """A request joins the batch (a session begun for it where none runs) and prefills in
        ``pieces`` steps: the workers count its steps from its first token's, the shadow starts its
        copy (``engine.host.Host``). That step, as the session counts."""
        if not self.session:
            self.begin_session(msg)
        joined_step = self.step + pieces
        self.to_live_workers(SequenceJoin(request_id=self.session, sequence=msg.request_id, first_step=joined_step))
        if self.shadow_serving:
            self.endpoint.send("shadow", shadow_begin)
        return joined_step

    def announce_leave(self, request_id: str, joined_step: int, *, last: bool) -> dict[int, WorkerStats]:
        """A sequence left: the last one ends the session and the workers' statistics of it are
        returned; any other is forgotten by the workers (who may plan for one sequence again)."""
        if last:
            self.end_session()
            return dict(self.worker_stats)
        self.to_live_workers(
            SequenceLeave(request_id=self.session, sequence=request_id, last_step=max(self.step, joined_step))
        )
        return {}

    def live_workers(self) -> list[int]:
        return [w for w in range(self.placement.n_workers) if w not in self.lost]

    def to_live_workers(self, msg: Message) -> None:
        """``msg`` to every worker that is not lost, encoded once."""
        self.endpoint.send_to([f"worker-{w}" for w in self.live_workers()], msg)

    def note_links(self) -> None:
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
                self.engine.note_lost(peer)
                self.returning.discard(index)
                self.rejoined.discard(index)
                log.warning("%s is gone (its connection closed): the rest of its group serves its experts", peer)
            elif event == "up" and index in self.lost:
                self.returning.add(index)
                self.endpoint.send(peer, Ping())

    def _note_shadow_link(self, event: str) -> None:
        if event == "lost" and not self.shadow_lost:
            self.shadow_lost, self.shadow_returning, self.shadow_back = True, False, False
            self.engine.note_lost("shadow")
            log.warning("the shadow is gone (its connection closed): workers load what is routed until it is back")
        elif event == "up" and self.shadow_lost:
            self.shadow_returning = True
            self.endpoint.send("shadow", Ping())

    def answer(self, client: bytes, event: Token | Done | Failed) -> None:
        """A request's event to the client that sent it (``engine.host.Host``)."""
        self.endpoint.reply(client, event)

    def tell_shadow(self, msg: Align | DraftAsk) -> None:
        """Main's token and KV (``Align``) or an ask for drafts, to the shadow (``engine.host.Host``)."""
        self.endpoint.send("shadow", msg)

    @property
    def shadow_serving(self) -> bool:
        """Whether the shadow takes part in this request: there is one, and it is not lost."""
        return self.has_shadow and not self.shadow_lost

    def end_session(self) -> None:
        """Tell the workers the session is over and gather their statistics (bounded); nothing
        where no session runs."""
        if not self.session:
            return
        live = self.live_workers()
        self.to_live_workers(End(request_id=self.session))
        deadline = time.monotonic() + self.spec.settings.timeout_s
        try:
            while time.monotonic() < deadline:
                self.note_links()
                if set(self.worker_stats) >= {w for w in self.live_workers() if w in live}:
                    return
                self.wait_for_side_message(deadline)
            log.warning("some workers did not report statistics in time; metrics are partial")
        finally:
            self.session = ""

    def end_shadow(self, request_id: str) -> ShadowStats | None:
        """Tell the shadow a sequence is over; its statistics for it, if they come in time."""
        if not self.shadow_serving:
            return None
        self.endpoint.send("shadow", End(request_id=request_id))
        deadline = time.monotonic() + self.spec.settings.timeout_s
        while request_id not in self.shadow_stats and self.shadow_serving and time.monotonic() < deadline:
            self.note_links()
            self.wait_for_side_message(deadline)
        if request_id not in self.shadow_stats:
            log.warning("the shadow did not report statistics for %s in time; metrics are partial", request_id)
        return self.shadow_stats.pop(request_id, None)

    def wait_for_side_message(self, deadline: float) -> None:
        """The next message before ``deadline`` handled; a link's loss (which ends the wait) acted on."""
        received = self.endpoint.recv(timeout_s=max(0.0, deadline - time.monotonic()))
        if received is not None:
            handle_safely(self.handle_side_message, received)
        self.note_links()  # so that a caller's loop sees a lost peer before it waits again


def serve(spec: RoleSpec) -> None:
    MainRole(spec).run()


def take_matcher(compiles: Compiles[Generate], msg: Generate) -> tuple[object, str]:
    """A queued request's own matcher of its compiled grammar (``Compiles.take``), past the answer's
    tokens a continuation re-reads (``Generate.answered``), or why not."""
    try:
        answered = msg.prompt_ids[len(msg.prompt_ids) - msg.answered :]
        return walked(compiles.take(msg.request_id), answered), ""
    except GrammarError as exc:
        return None, str(exc)
    except Exception as exc:
        return None, f"its grammar could not be prepared: {type(exc).__name__}: {exc}"


def strategy_parts(
    spec: RoleSpec, model: torch.nn.Module, placement: Placement, strategy, predictor: str, device: torch.device
) -> tuple[ResidentExperts | None, object, torch.nn.Module | None]:
    """What main's strategy needs besides the model, from its shard: importance's resident experts and
    similarity table (it substitutes experts from what workers hold), and the prerouter's heads (the
    routing itself under the prerouter strategy, with its recovery adapter attached to main's
    attention, or odmoe's predictor)."""
    config = model.config
    resident = similarity = prerouter = None
    if strategy.substitutes:
        similarity = load_similarity(spec.shard_dir, layers=placement.n_layers, experts=placement.n_experts)
        resident = ResidentExperts(spec.settings.cache_experts)
    if predictor == "prerouter":
        trained = load_prerouter(
            spec.shard_dir,
            layers=config.num_hidden_layers,
            experts=expert_dims(config)[0],
            hidden=config.hidden_size,
            top_k=config.num_experts_per_tok,
        )
        prerouter = trained.prerouter.to(device)
        if strategy.routes_by_prediction:
            attach_lora(model, trained.lora, trained.shape, like_base=True)
    return resident, similarity, prerouter
