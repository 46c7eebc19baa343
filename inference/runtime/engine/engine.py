"""Main's engine: the batch, the requests waiting for a place, and the step that moves them.

One thread. Each step the scheduler (pure) says who leaves, who joins and what each
sequence computes; the runner runs that work through the model, layer by layer, the
experts by the exchange it was given; each sequence that reached a new token samples it, streams
it to its client (``Token``, with its logprobs where they were asked for) and aligns the shadow;
a sequence that is done leaves at the next plan and its client gets its ``Done`` (or ``Failed``).
What comes in reaches it through its methods (``submit``, ``cancel``, ``predicted``, ``drafted``,
``realign``), and what goes out leaves through its host (``inference.runtime.engine.host.Host``):
main's role, which keeps the sockets, the peers and the session, calls ``step`` from its one loop
and reads its inbox between steps. The engine imports no role.

With ``draft_tokens`` set, each decode also verifies the shadow's drafts of the sequence's next
tokens in the same pass (``inference.runtime.engine.drafts``): the engine asks the shadow after
each pass, waits for its answer before the next (no longer than the deployment's timeout, and not
at all once the shadow is lost), and keeps the drafts main's own sampling confirms.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch
from transformers import DynamicCache

from inference.constants import DEFAULT_CONTEXT_TOKENS
from inference.policies import alignment
from inference.policies.drafting import DraftTuner
from inference.runtime.engine.drafts import draft_length, trim_cache, verify
from inference.runtime.engine.exchange import GenerationAborted
from inference.runtime.engine.grammar import Constraint
from inference.runtime.engine.runner import ModelRunner
from inference.runtime.engine.sampling import end_ids, request_sampler, token_logprobs
from inference.runtime.engine.scheduler import Waiting, Work, done, prefill_pieces, schedule
from inference.runtime.engine.sequence import Sequence
from inference.runtime.metrics import build_metrics, step_report
from inference.runtime.prefix_cache import Block, PrefixCache, cache_from, namespace_root
from inference.runtime.prerouter import SequenceRoutes
from inference.runtime.records import RequestState, StepRecord
from inference.wire.runtime import Align, Done, DraftAsk, Drafts, Failed, Generate, Prediction, ShadowBegin, Token

if TYPE_CHECKING:
    import llguidance

    from inference.runtime.engine.guesses import Guesses
    from inference.runtime.engine.host import Host, LayerServer, Served

log = logging.getLogger(__name__)


@dataclass
class Queued:
    """A request admitted and waiting for a place in the batch: its client, and its own matcher
    of its compiled grammar (None without one)."""

    msg: Generate
    client: bytes
    matcher: llguidance.LLMatcher | None = None


class Engine:
    """The batch of sequences, the requests waiting for a place, and the step that moves them."""

    def __init__(self, host: Host, served: Served, exchange: LayerServer, guesses: Guesses) -> None:
        self.host = host
        self.served = served
        self.settings = settings = served.settings
        self.guesses = guesses
        self.batch: dict[str, Sequence] = {}
        self.waiting: deque[Queued] = deque()  # continuous batching: admitted, not yet joined
        self.token_period, self.kv_period = settings.token_period, settings.kv_period  # the shadow's alignment
        self.runner = ModelRunner(served.model, served.family, exchange.serve_layer, self._embedded)
        self.prefixes = PrefixCache() if settings.prefix_cache else None
        self.draft_tokens = settings.draft_tokens  # 0: a token a pass
        self.tuner = DraftTuner(
            most=self.draft_tokens,
            auto=settings.draft_policy == "auto",
            experts=served.placement.n_experts,
            top_k=served.model.config.num_experts_per_tok,
            layers=served.placement.n_layers,  # its MoE layers, each one expert round
        )
        # A waiting request's prefix found in the store: (the store's version then, its blocks),
        # held from the step that plans its join to the join, whatever the store drops meanwhile.
        self._held: dict[str, tuple[int, list[Block]]] = {}

    @functools.cached_property
    def eos(self) -> tuple[int, ...]:
        """The ids that end a generation, as the samplers have them (the generation config's)."""
        return tuple(sorted(end_ids(self.served.model, self.served.device)))

    # --- what comes in ----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a sequence runs or a request waits: the host steps the engine while it is."""
        return bool(self.batch or self.waiting)

    def submit(self, msg: Generate, client: bytes, matcher: llguidance.LLMatcher | None = None) -> None:
        """An admitted request (its grammar compiled, if it has one) waits for a place in the batch."""
        if msg.grammar and matcher is None:
            raise ValueError(f"{msg.request_id}: a request with a grammar joins with its compiled matcher")
        self.waiting.append(Queued(msg, client, matcher))

    def holds(self, request_id: str) -> bool:
        """Whether a generation with this id runs or waits here."""
        return request_id in self.batch or any(q.msg.request_id == request_id for q in self.waiting)

    def users(self) -> tuple[list[str], list[str]]:
        """The users of the running sequences and of the waiting requests, one entry each."""
        return [s.user for s in self.batch.values()], [q.msg.user for q in self.waiting]

    def cancel(self, request_id: str) -> bool:
        """Stop a running sequence after its current step, or drop a waiting request (answered at
        once): whether either was here."""
        sequence = self.batch.get(request_id)
        if sequence is not None:
            sequence.state.cancelled = True
            return True
        queued = next((q for q in self.waiting if q.msg.request_id == request_id), None)
        if queued is None:
            return False
        self.waiting.remove(queued)
        self.host.answer(queued.client, cancelled(request_id))
        return True

    def realign(self, token_period: int, kv_period: int) -> bool:
        """New alignment periods (validated by the host), logged by every running sequence from
        its next step: whether any runs (the shadow is then told)."""
        self.token_period, self.kv_period = token_period, kv_period
        for sequence in self.batch.values():
            # The step whose alignment is the first under the new periods: the one after the
            # step the sequence is in (between steps, in its next one already).
            sequence.state.alignment_log.append(
                {"from_step": sequence.at[0] + 1, "token_period": token_period, "kv_period": kv_period}
            )
        return bool(self.batch)

    def note_lost(self, peer: str) -> None:
        """A peer was lost: every running sequence's metrics name it."""
        for sequence in self.batch.values():
            sequence.state.roles_lost.add(peer)

    def abort(self, reason: str) -> None:
        """End every sequence and waiting request now, each client told ``reason`` (main stops, or a
        step failed outside any one sequence); a sequence that had already ended is answered as such."""
        for sequence in list(self.batch.values()):
            if not done(sequence.view()):
                sequence.error = sequence.error or reason
            try:
                self._finish(sequence)
            except Exception:  # what failed the step may fail its end too: its client is still told
                log.exception("ending %s failed", sequence.request_id)
                self.batch.pop(sequence.request_id, None)
                self.host.answer(sequence.state.client, Failed(request_id=sequence.request_id, error=reason))
        while self.waiting:
            queued = self.waiting.popleft()
            self.host.answer(queued.client, Failed(request_id=queued.msg.request_id, error=reason))

    # --- the step ---------------------------------------------------------------------------

    def step(self) -> None:
        """One step: the scheduler's plan, the model over the batch, a token per sampling sequence."""
        settings = self.settings
        waiting = [
            Waiting(q.msg.request_id, q.msg.user, len(q.msg.prompt_ids), q.msg.max_new_tokens, self._cached(q.msg))
            for q in self.waiting
        ]
        self._held = {w.request_id: self._held[w.request_id] for w in waiting if w.request_id in self._held}
        plan = schedule(
            waiting,
            [s.view() for s in self.batch.values()],
            max_batch=settings.max_batch,
            prefill_step=settings.prefill_step,
        )
        # The joiners are taken by identity before anyone leaves: a leaver's end reads main's inbox
        # (the shadow's statistics), where a cancel may take a waiting request out of the queue.
        joining = [self.waiting[i] for i in plan.joins]
        for request_id, _ in plan.leaves:
            self._finish(self.batch[request_id])
        for queued in joining:
            if not any(waiting is queued for waiting in self.waiting):
                continue  # cancelled while the leavers ended: answered already, nothing to join
            self.waiting.remove(queued)
            try:
                self._join(queued)
            except Exception as exc:  # its own problem (its sampler, its cache): it alone fails
                log.exception("generation %s could not join", queued.msg.request_id)
                self.batch.pop(queued.msg.request_id, None)
                error = f"could not join the batch: {type(exc).__name__}: {exc}"
                self.host.answer(queued.client, Failed(request_id=queued.msg.request_id, error=error))
        # The plan's work, less a joiner that was cancelled before it joined.
        batch = [(self.batch[w.request_id], w) for w in plan.work if w.request_id in self.batch]
        if not batch:
            return
        if self.draft_tokens:
            batch = self._with_drafts(batch)
        self.host.begin_step()
        try:
            started = time.perf_counter()
            outputs = self.runner.run(batch)
            if self.draft_tokens and self.tuner.auto:  # what auto chooses from; fixed needs none of it
                note_timed_step(self.tuner, batch, time.perf_counter() - started)
            for (s, work), out in zip(batch, outputs, strict=True):
                s.computed = work.end
                if out.prompt is not None and s.prompt_logprobs is not None:
                    s.prompt_logprobs += out.prompt
                if out.last is not None:
                    self._take_tokens(s, work, [out.last, *out.drafted])
        except GenerationAborted as exc:
            self._fail([s for s, _ in batch], str(exc))
            return
        except Exception as exc:  # main's own error: the step's sequences end, main serves on
            log.exception("a batch step failed")
            self._fail([s for s, _ in batch], f"{type(exc).__name__}: {exc}")
            return
        for s, _ in batch:  # its last token, or its end: its client is answered now, not a step later
            if done(s.view()):
                self._finish(s)

    def _take_tokens(self, s: Sequence, work: Work, logits: list[torch.Tensor]) -> None:
        """A sampling step's tokens: its one, or each draft main's own sampling confirms and the one
        after (``drafts.verify``); the cache keeps the positions whose inputs were kept, each token
        is streamed, and the shadow is asked for the next pass's drafts."""

        def next_token(kept: list[int], row: torch.Tensor) -> int:
            tokens = torch.cat([s.tokens, s.tokens.new_tensor([kept])], dim=1) if kept else s.tokens
            return s.sampler.next_token(tokens, row)

        kept, error = verify(next_token, logits, work.drafts, s.sampler.eos.__contains__)
        if work.drafts:  # the positions whose inputs were kept: its last token's, and each kept draft's
            s.computed = work.start + max(len(kept), 1)
            accepted = sum(1 for token, draft in zip(kept, work.drafts, strict=False) if token == draft)
            s.drafting.accepted += accepted
            s.state.steps[-1].drafted, s.state.steps[-1].accepted = len(work.drafts), accepted
            self.tuner.note_verified(min(len(kept), len(work.drafts)), accepted)
        elif self.draft_tokens and work.tokens == 1:  # a decode that verified none: auto may ask again
            self.tuner.note_verified(0, 0)
        if self.draft_tokens:
            trim_cache(s.cache, s.computed)
        for token, row in zip(kept, logits, strict=False):
            self._on_token(s, token, row)
        if error is not None:  # this sequence's grammar: it ends, the batch goes on
            s.error = error
        elif self.draft_tokens:
            self._ask_drafts(s)

    def _ask_drafts(self, s: Sequence) -> None:
        """Ask the shadow for a sequence's next pass: its drafts from the next token on (behind the
        ``Align`` of every token streamed, on the same link)."""
        if not self.host.shadow_serving or done(s.view()):
            return
        position = len(s.state.generated)
        tokens = draft_length(self.tuner.drafts(), position, s.state.max_new_tokens)
        s.drafting.ask(s.step + 1, position, tokens)
        self.host.tell_shadow(DraftAsk(request_id=s.request_id, step=s.step + 1, position=position, tokens=tokens))

    def _with_drafts(self, batch: list[tuple[Sequence, Work]]) -> list[tuple[Sequence, Work]]:
        """Each decode's drafts for this pass, once the shadow answered every one asked for (no longer
        than the deployment's timeout; not at all while the shadow is lost): a late answer is dropped
        and the pass decodes its one token, the same token."""
        host, timeout_s = self.host, self.settings.timeout_s
        decodes = [s for s, w in batch if w.samples and w.start >= s.prompt_len]
        deadline = time.monotonic() + timeout_s
        began = time.perf_counter()
        asked = max((s.drafting.asked for s in decodes if s.drafting.step == s.step + 1), default=0)
        while any(s.drafting.waiting(s.step + 1) for s in decodes):
            host.note_links()  # a lost shadow is noticed before any wait
            if not host.shadow_serving or host.stopping:
                break
            if time.monotonic() >= deadline:
                log.warning(
                    "the shadow's drafts did not come within %.0f s: this pass decodes without",
                    timeout_s,
                )
                break
            host.wait_for_side_message(deadline)
        if self.tuner.auto:  # what auto weighs a draft's wait by
            self.tuner.note_wait(time.perf_counter() - began, asked)
        return [
            (s, dataclasses.replace(w, drafts=s.drafting.take(s.step + 1)) if s in decodes else w) for s, w in batch
        ]

    def drafted(self, msg: Drafts) -> None:
        """The shadow's drafts for a running sequence's next pass."""
        sequence = self.batch.get(msg.request_id)
        if sequence is not None:
            sequence.drafting.answer(msg)

    def predicted(self, predictions: list[Prediction]) -> None:
        """The shadow's routing of running sequences' (step, layer)s, kept for those layers' plans."""
        for prediction in predictions:
            sequence = self.batch.get(prediction.request_id)
            if sequence is not None:
                sequence.state.predictions[(prediction.step, prediction.layer)] = prediction.experts
                self.guesses.note_lead(sequence, prediction.step, prediction.layer)

    def _cached(self, msg: Generate) -> int:
        """How many of a waiting prompt's first tokens the prefix cache holds (at most all but its
        last; none where the prompt's own logprobs are asked for, which need every position)."""
        if self.prefixes is None or msg.prompt_logprobs:
            return 0
        held = self._held.get(msg.request_id)
        if held is None or held[0] != self.prefixes.version:
            held = self._held[msg.request_id] = (
                self.prefixes.version,
                self.prefixes.lookup(
                    msg.prompt_ids, len(msg.prompt_ids) - 1, root=namespace_root(msg.user, msg.prefix_namespace)
                ),
            )
        return len(held[1]) * self.prefixes.block_tokens

    def _prefix_room(self) -> int:
        """Tokens of KV the prefix cache may hold: main's reserved KV (``max_batch`` sequences of
        ``DEFAULT_CONTEXT_TOKENS``) less what the running sequences may fill."""
        settings = self.settings
        running = sum(s.prompt_len + s.state.max_new_tokens for s in self.batch.values())
        return settings.max_batch * DEFAULT_CONTEXT_TOKENS - running

    def _fail(self, sequences: list[Sequence], error: str) -> None:
        for s in sequences:
            if s.request_id in self.batch:
                s.error = error
                self._finish(s)

    def _join(self, queued: Queued) -> None:
        """A waiting request joins the batch: its state, cache, sampler; the workers and shadow told."""
        served, msg = self.served, queued.msg
        model, device = served.model, served.device
        state = RequestState(
            msg.request_id,
            queued.client,
            len(msg.prompt_ids),
            msg.max_new_tokens,
            self.token_period,
            self.kv_period,
            time.perf_counter(),
        )
        if served.prerouter is not None:
            state.routes = SequenceRoutes(served.prerouter)
        _, blocks = self._held.pop(msg.request_id, (0, []))
        state.cache = cache_from(blocks, model.config) if blocks else DynamicCache(config=model.config)
        if self.draft_tokens:
            state.cache.activate_past_recording()  # a sliding window can drop rejected drafts (drafts.trim_cache)
        cached = state.cached_prompt_tokens = state.cache.get_seq_length()
        sampler = request_sampler(
            model,
            msg,
            prompt_len=len(msg.prompt_ids),
            device=device,
            # Its own copy of its compiled grammar (compiled off main's loop before it queued), past
            # the tokens a continuation re-reads (``main.take_matcher``).
            constraint=Constraint(queued.matcher, model.config.vocab_size) if queued.matcher is not None else None,
        )
        tokens = torch.tensor([msg.prompt_ids], dtype=torch.long, device=device)
        # A prompt prefilled in pieces takes a step per piece; its step 0, as the workers
        # and the shadow count, is the last piece's.
        pieces = prefill_pieces(len(msg.prompt_ids), self.settings.prefill_step, cached)
        begin = shadow_begin(msg, sampler.generator, self.token_period, self.kv_period)
        sequence = Sequence(
            state,
            msg.user,
            sampler,
            tokens,
            joined_step=self.host.announce_join(msg, len(pieces), begin),
            prefix_root=namespace_root(msg.user, msg.prefix_namespace),
            computed=cached,
            cached=cached,
            logprobs=msg.logprobs,
            top_logprobs=msg.top_logprobs,
            prompt_logprobs=[] if msg.prompt_logprobs else None,
            step_reports=msg.step_reports,
        )
        self.batch[msg.request_id] = sequence
        if self.prefixes is not None:
            self.prefixes.trim(self._prefix_room())  # room for it, before it fills any

    def _embedded(self, sequence: Sequence, work: Work, embeds: torch.Tensor) -> None:
        """A sequence's step embedded its tokens: main's layer-0 guess, then the step's record."""
        self.guesses.embedded(sequence, embeds)
        state = sequence.state
        if state.steps and not state.token_times:  # the next piece of a chunked prefill: still step 0
            state.steps[-1].tokens += work.tokens
        else:
            state.steps.append(StepRecord(len(state.steps), work.tokens, time.perf_counter()))
        state.steps[-1].batch = len(self.batch)
        sequence.at = (sequence.step, 0)

    def _on_token(self, sequence: Sequence, token: int, logits: torch.Tensor) -> None:
        """A new token (sampled from ``logits`` [1, V]): keep it, stream it, then align the shadow."""
        host, state = self.host, sequence.state
        now = time.perf_counter()
        state.steps[-1].finished = now
        state.token_times.append(now)
        state.generated.append(token)
        sequence.tokens = torch.cat([sequence.tokens, sequence.tokens.new_tensor([[token]])], dim=1)
        sequence.ended = token in sequence.sampler.eos
        sequence.at = (sequence.step + 1, 0)
        report = step_report(state.steps[-1], self.served.placement) if state.steps and sequence.step_reports else None
        logprob = None
        if sequence.logprobs:
            (logprob,) = token_logprobs(logits, torch.tensor([token]), sequence.top_logprobs)
        prompt, sequence.prompt_logprobs = sequence.prompt_logprobs, None  # the first token carries them
        index = len(state.generated) - 1
        event = Token(request_id=state.request_id, index=index, token_id=token, step=report, logprob=logprob)
        host.answer(state.client, msgspec.structs.replace(event, prompt_logprobs=prompt))
        next_step = len(state.generated)
        if host.shadow_serving and next_step < state.max_new_tokens:
            periods = (self.token_period, self.kv_period)
            host.tell_shadow(align_message(state, next_step, token, *periods, drafts=self.draft_tokens))

    def _finish(self, sequence: Sequence) -> None:
        """A sequence left the batch: end it everywhere and answer its client."""
        host, state = self.host, sequence.state
        # Still in the batch while the shadow ends it: its last predictions may be on the way.
        shadow_stats = host.end_shadow(state.request_id)
        del self.batch[state.request_id]
        written = 0  # of its prompt's tokens, those whose KV the prefix cache took from it
        if self.prefixes is not None and sequence.error is None and state.cache is not None:
            ids, room, root = sequence.tokens[0].tolist(), self._prefix_room(), sequence.prefix_root
            written = self.prefixes.store(ids, state.cache, room, root=root, prompt_len=state.prompt_len)
        last = not self.batch and not self.waiting
        worker_stats = host.announce_leave(state.request_id, sequence.joined_step, last=last)
        if sequence.error is not None:
            log.error("generation %s failed: %s", state.request_id, sequence.error)
            host.answer(state.client, Failed(request_id=state.request_id, error=sequence.error))
            return
        generated = list(state.generated)
        finish_reason = "length"
        if state.cancelled:
            finish_reason = "cancelled"
        elif len(generated) < state.max_new_tokens:
            finish_reason = "stop"
        metrics = build_metrics(
            state,
            worker_stats,
            shadow_stats,
            self.served.placement,
            token_period=self.token_period,
            kv_period=self.kv_period,
        )
        metrics |= sequence_metrics(sequence, self.settings.prefill_step, written, drafts=bool(self.draft_tokens))
        host.answer(
            state.client,
            Done(request_id=state.request_id, token_ids=generated, finish_reason=finish_reason, metrics=metrics),
        )


def sequence_metrics(sequence: Sequence, prefill_step: int, written: int, *, drafts: bool) -> dict:
    """What a finished sequence's ``Done`` says of its own run, beside ``build_metrics``' figures:
    peers lost, its join, its prefill's pieces, its prompt's tokens the prefix cache gave and took,
    the largest batch it ran in, and with drafts how its passes went."""
    state = sequence.state
    metrics = {
        "roles_lost": sorted(state.roles_lost),
        "joined_step": sequence.joined_step,
        "prefill_pieces": len(prefill_pieces(state.prompt_len, prefill_step, state.cached_prompt_tokens)),
        "cached_prompt_tokens": state.cached_prompt_tokens,
        "written_prompt_tokens": written,
        "max_batch": max((step.batch for step in state.steps), default=1),
    }
    if drafts:
        decodes = max(len(state.steps) - 1, 0)  # the passes after its prefill's
        metrics["drafts"] = sequence.drafting.metrics() | {
            "decode_passes": decodes,
            "tokens_per_pass": (len(state.generated) - 1) / decodes if decodes else 0.0,
            "distinct_experts": distinct_experts(state.steps[1:]),
        }
    return metrics


def distinct_experts(steps: list) -> float:
    """The mean number of distinct experts a decode pass used per layer (a drafted pass's union)."""
    counts = [len(record.real) for step in steps for record in step.layers]
    return sum(counts) / len(counts) if counts else 0.0


def shadow_begin(msg: Generate, generator: torch.Generator | None, token_period: int, kv_period: int) -> ShadowBegin:
    """What the shadow follows a joining sequence with: its prompt, tenant, grammar and sampling,
    with the seed its generator drew from (main's own draw where the request named none)."""
    seed = generator.initial_seed() if generator is not None else None
    return ShadowBegin(
        request_id=msg.request_id,
        token_period=token_period,
        kv_period=kv_period,
        prompt_ids=torch.tensor(msg.prompt_ids, dtype=torch.long),
        user=msg.user,
        prefix_namespace=msg.prefix_namespace,
        **msg.sampling() | {"seed": seed},
    )


def cancelled(request_id: str) -> Done:
    """The answer to a request cancelled before it ran: no tokens."""
    return Done(request_id=request_id, token_ids=[], finish_reason="cancelled", metrics={})


def align_message(
    state: RequestState, step: int, token: int, token_period: int, kv_period: int, *, drafts: int
) -> Align:
    """What the shadow is told after main's token at ``step``: the token where due (always while
    it drafts), and main's cache for the positions it was not given yet, where due."""
    token_due, kv_due = alignment.alignment_due(step, token_period, kv_period)
    token_due = token_due or bool(drafts)  # the shadow drafts on main's every token
    keys = values = None
    kv_from = kv_to = 0
    if kv_due and state.cache is not None:
        # The shadow gets main's cache for the positions it has not been given yet, up to the
        # step's (a drafted pass's later tokens' positions follow with their own steps).
        kv_from, kv_to = state.kv_synced, min(state.cache.get_seq_length(), state.prompt_len + step - 1)
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


def note_timed_step(tuner: DraftTuner, batch: list[tuple[Sequence, Work]], step_s: float) -> None:
    """What ``auto`` learns from a decode step (``step_s`` long): its expert rounds' share of it and
    the distinct experts they served, and how each drafted pass's positions shared experts. A
    prefill's step teaches it nothing: its positions are not a decode's."""
    if any(w.start < s.prompt_len for s, w in batch):
        return
    records = [s.state.steps[-1].layers for s, _ in batch]
    layers = len(records[0])
    union = [set().union(*(r[layer].real for r in records)) for layer in range(layers)]
    experts_s = sum(record.dispatch_ms for record in records[0]) / 1000
    positions = sum(1 + len(w.drafts) for _, w in batch)
    tuner.note_step(step_s, experts_s, sum(len(u) for u in union), positions, layers)
    for (_, w), layered in zip(batch, records, strict=True):
        if w.drafts and layered:
            tuner.note_pass(1 + len(w.drafts), sum(len(r.real) for r in layered) / len(layered))
