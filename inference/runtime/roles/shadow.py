"""The shadow role: a quantized copy of the whole model that emulates main a step ahead.

It follows every sequence of main's batch, each with its own cache, and steps every sequence
that may step together, as main does: through the engine's model runner
(``inference.runtime.engine.runner``), each sequence's attention on its own and the experts of a
layer in one call for all of them, so a batch of eight costs far less than eight steps one
after another and the shadow keeps ahead of main's batch. For each decode step it runs its copy on
main's token (when tokens are aligned) or on its own guess, and its router decisions at every
layer are sent at once to the workers that serve that layer, and to main, as the prediction of
main's routing (Scaled Emulative Prediction). Main's ``Align`` messages bring its token and KV cache
every ``token_period`` / ``kv_period`` steps; if the shadow had already run a step that
main then aligns, it rewinds its cache and runs the step again.

With ``draft_tokens`` set, the shadow drafts: it runs only as far as main asks (``DraftAsk``: a
pass of main's, from a token on), on main's token and then on its own guesses (greedy, or a sampled
request's draws with main's sampler and seed), answers
main with those guesses (``Drafts``) as soon as it has them, and sends as the pass's predictions,
keyed by main's pass, the union per layer of its routing of every position of the pass (each
message the union so far, which replaces the one before). With ``speculate`` it drafts main's
next pass too while main verifies this one, as if main kept every draft. A guess main did not
keep rewinds it to main's token there, as a wrong speculation does.

A request with a grammar (``ShadowBegin.grammar``) is guessed under it: the shadow compiles it as
main does, off its loop (``inference.runtime.engine.compiles``), and until that ends guesses
without it (a guess the grammar refuses is only a draft main rejects, or a wrong speculation).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import DynamicCache, PreTrainedModel

from inference.constants import DEFAULT_CONTEXT_TOKENS, SHADOW_STATES_PER_SEQUENCE
from inference.modelio.model import expert_dims, family_of, load_config
from inference.modelio.shards import verify_shard
from inference.policies import alignment
from inference.policies.placement import placement_from_dict
from inference.runtime.batching import LayerCall
from inference.runtime.engine.compiles import Compiles
from inference.runtime.engine.grammar import GrammarError, Guessing, grammar_tokenizer, walked
from inference.runtime.engine.runner import ModelRunner
from inference.runtime.engine.sampling import Sampler, end_ids, request_sampler, shapes_greedy
from inference.runtime.engine.scheduler import Work
from inference.runtime.prefix_cache import PrefixCache, cache_from, namespace_root
from inference.runtime.roles import common
from inference.runtime.routing import resolve_arithmetic
from inference.runtime.spec import RoleSpec
from inference.runtime.transport import Received
from inference.shadow.shadow_model import CAST_DTYPES, build_shadow_model
from inference.wire.runtime import (
    Align,
    DraftAsk,
    Drafts,
    End,
    Prediction,
    Predictions,
    SetAlignment,
    ShadowBegin,
    ShadowStats,
    Shutdown,
)

log = logging.getLogger(__name__)

# How long the idle loop waits for a message while a grammar compiles: how late, at most, a
# compiled grammar starts to shape the guesses.
COMPILE_POLL_S = 0.01


@dataclass
class Emulation:
    """The shadow's state for one request."""

    request_id: str
    prompt_len: int
    max_new_tokens: int
    token_period: int
    kv_period: int
    cache: DynamicCache
    tokens: torch.Tensor  # [1, prompt_len + max_new_tokens]: the prompt, then each step's input
    next_step: int = 1
    own_next: int = 0  # the shadow's own greedy token after its last step
    main_step: int = 0  # the newest step main has announced
    inputs: dict[int, int] = field(default_factory=dict)
    aligns: dict[int, Align] = field(default_factory=dict)
    ending: bool = False
    speculated: set[int] = field(default_factory=set)  # steps run on a guess, not yet checked
    speculations: int = 0
    speculation_misses: int = 0
    largest_batch: int = 1  # the most sequences stepped together in one of its steps
    cached_prompt_tokens: int = 0  # its prompt's first tokens whose KV came from the prefix cache
    prefix_root: bytes = b""  # its tenant's prefix-cache namespace (prefix_cache.namespace_root)
    rewinds: int = 0
    token_aligns: int = 0
    kv_aligns: int = 0
    version: int = 0
    running_step: int = 0  # the step its model is running (0: the prompt, no predictions)
    call: LayerCall | None = None  # its rows of the layer being run (the runner's)
    prompt_logprobs: None = None  # the runner's: the shadow never asks for them
    top_logprobs: int = 0
    # Drafting (``draft_tokens``): the steps main asked for, each with the pass it is a position
    # of; the ask still to answer with drafts; each (pass, layer)'s union of experts so far.
    pass_of: dict[int, int] = field(default_factory=dict)
    asked: DraftAsk | None = None
    unions: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    # A sampled request (or a greedy one its knobs change): main's sampler (its processors, a generator
    # seeded as main's where it samples), and the
    # generator's state before each token's draw, so a step run again draws what it drew before.
    sampler: Sampler | None = None
    draws: dict[int, torch.Tensor] = field(default_factory=dict)
    grammar: Guessing | None = None  # its grammar, once compiled here (None: none, or not yet)
    answered: int = 0  # a continuation's: the prompt's last tokens that are the answer's own (ShadowBegin)


class ShadowRole:
    def __init__(self, spec: RoleSpec) -> None:
        self.spec = spec
        self.device = common.pick_device(spec.settings.device)
        manifest = verify_shard(spec.shard_dir, expect_role="shadow")
        self.placement = placement_from_dict(manifest["placement"])
        config = load_config(spec.shard_dir)
        shadow_dtype = spec.settings.shadow_dtype
        arithmetic = resolve_arithmetic(
            spec.settings.experts_arithmetic,
            config.hidden_size,
            expert_dims(config)[1],
            CAST_DTYPES.get(shadow_dtype, torch.float32),
            self.device,
        )
        # Converted tensor by tensor as it is read: the full-precision model never exists here.
        self.model, self.report = build_shadow_model(
            spec.shard_dir, shadow_dtype, self.device, eager_experts=arithmetic == "eager", verify=False
        )
        common.release_free_heap()
        # Main runs at most max_batch sequences and ends each here before another takes its
        # place; beyond that the oldest state is stale (the memory estimate counts this many).
        self.max_states = SHADOW_STATES_PER_SEQUENCE * spec.settings.max_batch
        self.kv_dtype = next(p.dtype for n, p in self.model.named_parameters() if "embed_tokens" in n)
        self.endpoint = common.open_endpoint(spec)
        common.connect_peers(self.endpoint, spec, workers=True, shadow=False, main=True)
        self.states: dict[str, Emulation] = {}  # the sequences it follows, by request id
        self.family = family_of(self.model.config)
        self.runner = ModelRunner(self.model, self.family, self._serve_layer, lambda *_: None)
        # Its own finished sequences' KV, for prompts that begin the same way (as main keeps its own).
        self.prefixes = PrefixCache() if spec.settings.prefix_cache else None
        self.drafting = spec.settings.draft_tokens > 0
        self.eos = end_ids(self.model, self.device)
        # Requests' grammars, compiled off the loop for the guesses (the tokenizer read at the first).
        self.compiles: Compiles[ShadowBegin] = Compiles(
            partial(grammar_tokenizer, str(spec.shard_dir), self.model.config.vocab_size, tuple(sorted(self.eos)))
        )
        log.info("shadow ready: %s on %s (%s)", spec.settings.shadow_dtype, self.device, self.report)

    # --- message loop -------------------------------------------------------------------

    def run(self) -> None:
        try:
            while True:
                # A sequence main has ended is answered as soon as no step is left, not after a
                # quiet second on the inbox: health pings would otherwise keep postponing it.
                for state in [s for s in self.states.values() if s.ending and not self._can_step(s)]:
                    self.finish(state)
                if self.compiles.pending:
                    self._take_compiled()
                ready = self._ready()
                idle_s = COMPILE_POLL_S if self.compiles.pending else 1.0
                received = self.endpoint.recv(timeout_s=0.0 if ready else idle_s)
                if received is not None:
                    if isinstance(received.msg, Shutdown):
                        return
                    common.handle_safely(self.handle, received)
                    continue
                if ready:
                    self._guarded(ready, partial(self.step, ready))
        finally:
            self.compiles.close()
            self.endpoint.close()

    def handle(self, received: Received) -> None:
        msg = received.msg
        if common.answer_ping(self.endpoint, received, self.spec.name, ready=True):
            return
        state = self.states.get(getattr(msg, "request_id", None) or "")
        if isinstance(msg, ShadowBegin):
            self.begin(msg)
        elif isinstance(msg, SetAlignment):
            for each in self.states.values():
                each.token_period, each.kv_period = msg.token_period, msg.kv_period
            log.info("alignment periods now token=%d kv=%d", msg.token_period, msg.kv_period)
        elif isinstance(msg, DraftAsk) and state is None:
            self._no_drafts(msg)  # not followed (it failed here, or never came)
        elif isinstance(msg, End) and state is None:
            # Nothing to finish (the request failed here, or never reached us): say so at once.
            self.endpoint.send(
                "main", ShadowStats(request_id=msg.request_id, steps_done=0, rewinds=0, token_aligns=0, kv_aligns=0)
            )
        elif state is None:
            log.warning("dropped %s for a request that is not running", msg.TYPE)
        elif isinstance(msg, Align):
            self.on_align(state, msg)
        elif isinstance(msg, DraftAsk):
            self.on_draft_ask(state, msg)
        elif isinstance(msg, End):
            state.ending = True
        else:
            log.warning("dropped unexpected %s from %s", msg.TYPE, msg.sender)

    def _guarded(self, batch: list[Emulation], action) -> None:
        """Run ``action``; if it fails, give up these sequences (their caches may be part-way through
        a step): main goes on without their predictions."""
        try:
            action()
        except Exception:
            names = ", ".join(state.request_id for state in batch)
            log.exception("shadow failed on request %s; workers fall back to on-demand loading", names)
            for state in batch:
                self.states.pop(state.request_id, None)
                if state.asked is not None:  # main waits for these drafts: none will come
                    self._no_drafts(state.asked)

    # --- one request ----------------------------------------------------------------------

    def begin(self, msg: ShadowBegin) -> None:
        if msg.request_id not in self.states and len(self.states) >= self.max_states:
            oldest = next(iter(self.states))
            log.warning("following more than %d sequences: dropped %s", self.max_states, oldest)
            del self.states[oldest]
        prompt_len = int(msg.prompt_ids.numel())
        tokens = torch.zeros((1, prompt_len + msg.max_new_tokens), dtype=torch.long, device=self.device)
        tokens[0, :prompt_len] = msg.prompt_ids.view(-1).to(self.device)
        root = namespace_root(msg.user, msg.prefix_namespace)
        blocks = (
            self.prefixes.lookup(msg.prompt_ids.view(-1).tolist(), prompt_len - 1, root=root) if self.prefixes else []
        )
        cache = cache_from(blocks, self.model.config) if blocks else DynamicCache(config=self.model.config)
        if self.drafting:  # a sliding window keeps its past: a rejected draft rewinds past the window
            cache.activate_past_recording()
        state = Emulation(
            msg.request_id,
            prompt_len,
            msg.max_new_tokens,
            msg.token_period,
            msg.kv_period,
            cache,
            tokens,
            prefix_root=root,
            sampler=shadow_sampler(self.model, msg, prompt_len, self.device),
            answered=msg.answered,
        )
        self.states[msg.request_id] = state
        if msg.grammar:
            self._grammar(state, self.compiles.submit(msg, b""))
        if self.prefixes is not None:
            self.prefixes.trim(self._prefix_room())
        state.cached_prompt_tokens = cache.get_seq_length()
        work = Work(state.request_id, state.cached_prompt_tokens, prompt_len, samples=True)
        self._guarded([state], partial(self._run, [(state, work)]))

    def _take_compiled(self) -> None:
        """Each grammar compiled since the last look, given to its sequence (if still followed)."""
        for msg, _, problem in self.compiles.poll([]):
            state = self.states.get(msg.request_id)
            if state is None:
                self.compiles.forget(msg.request_id)
            else:
                self._grammar(state, problem)

    def _grammar(self, state: Emulation, problem: str | None) -> None:
        """A sequence's grammar, compiled ("") or not (why), or still compiling (None)."""
        if problem:  # main ended it for the same reason: its guesses go without
            log.info("guessing %s without its grammar: %s", state.request_id, problem)
        elif problem == "":
            answered = state.tokens[0, state.prompt_len - state.answered : state.prompt_len].tolist()
            try:
                matcher = walked(self.compiles.take(state.request_id), answered)
            except GrammarError as exc:  # main refuses it for the same reason
                log.info("guessing %s without its grammar: %s", state.request_id, exc)
                return
            state.grammar = Guessing(matcher, self.model.config.vocab_size)

    def on_align(self, state: Emulation, msg: Align) -> None:
        state.aligns[msg.step] = msg
        state.main_step = max(state.main_step, msg.step)
        for index in [i for i in state.draws if i < msg.step - 1]:  # tokens main has drawn for good
            del state.draws[index]
        if msg.step >= state.next_step:
            return
        wrong_token = msg.token is not None and state.inputs.get(msg.step) != msg.token
        if msg.step in state.speculated:
            # We ran this step ahead of main on our own guess of its token.
            state.speculated.discard(msg.step)
            if not wrong_token:
                # The guess was main's token: keep the predictions already sent and only take
                # main's KV for the positions before this step.
                state.token_aligns += msg.token is not None
                if msg.keys is not None:
                    splice_kv(state.cache, msg, self.device, self.kv_dtype)
                    state.kv_aligns += 1
                return
            state.speculation_misses += 1
        # Already ran this step: redo it if main's data differs from what we used.
        if wrong_token or msg.keys is not None:
            truncate_cache(state.cache, state.prompt_len + msg.step - 1)
            state.next_step = msg.step
            state.rewinds += 1
            state.speculated = {s for s in state.speculated if s < msg.step}
            if wrong_token:  # the drafts from here on were not main's: no more of them until main asks
                stale = {p for s, p in state.pass_of.items() if s >= msg.step}
                state.pass_of = {s: p for s, p in state.pass_of.items() if s < msg.step}
                state.unions = {key: union for key, union in state.unions.items() if key[0] not in stale}

    def on_draft_ask(self, state: Emulation, msg: DraftAsk) -> None:
        """Main asks for its pass ``msg.step``: the shadow's steps ``position`` to ``position +
        tokens`` are its positions (bounded by the sequence's length), the drafts answered once known."""
        if msg.position < 1 or msg.tokens < 0:
            log.warning("dropped a draft ask for %s at position %d", state.request_id, msg.position)
            return
        last = min(msg.position + msg.tokens, state.max_new_tokens - 1)
        state.pass_of = {s: p for s, p in state.pass_of.items() if s < msg.position}
        state.pass_of.update(dict.fromkeys(range(msg.position, last + 1), msg.step))
        if self.spec.settings.speculate and msg.tokens:
            # Main's next pass, were every draft of this one kept: drafted while main verifies this one.
            following = range(last + 1, min(last + 1 + msg.tokens, state.max_new_tokens - 1) + 1)
            state.pass_of.update(dict.fromkeys(following, msg.step + 1))
        state.unions = {key: union for key, union in state.unions.items() if key[0] >= msg.step}
        state.asked = msg if msg.tokens else None
        self._answer_drafts(state)

    def _no_drafts(self, ask: DraftAsk) -> None:
        """Answer an ask with no drafts: main decodes that pass without them, at once."""
        self.endpoint.send("main", Drafts(request_id=ask.request_id, step=ask.step, position=ask.position, tokens=[]))

    def _answer_drafts(self, state: Emulation) -> None:
        """Main's pending ask answered as soon as the shadow holds its guesses of every token asked
        for (or of an end of sequence before them)."""
        ask = state.asked
        if ask is None:
            return
        drafts = []
        for index in range(ask.position, ask.position + ask.tokens):
            step = index + 1  # the step that takes generated token ``index`` as its input
            if step < state.next_step:
                token = state.inputs.get(step)
            elif step == state.next_step and step - 1 in state.pass_of and state.next_step > ask.position:
                token = state.own_next
            else:
                return  # not guessed yet
            if token is None:
                return
            drafts.append(token)
            if token in self.eos:
                break
        state.asked = None
        self.endpoint.send(
            "main", Drafts(request_id=state.request_id, step=ask.step, position=ask.position, tokens=drafts)
        )

    def _ready(self) -> list[Emulation]:
        """The sequences that may step now, stepped together."""
        return [s for s in self.states.values() if self._can_step(s)]

    def _can_step(self, state: Emulation) -> bool:
        if state.next_step >= state.max_new_tokens:
            return False
        s = state.next_step
        if self.drafting:  # as far as main asked: on main's token where it came, else on its guess
            if s not in state.pass_of:
                return False
            if s <= state.main_step:
                return s in state.aligns
            return not state.ending and state.own_next not in self.eos
        if s > state.main_step + self.spec.settings.lookahead and not state.ending:
            return False
        token_due, kv_due = alignment.alignment_due(s, state.token_period, state.kv_period)
        waiting_for_main = (token_due or kv_due) and s not in state.aligns
        # Main's data for this step is not here yet: we may guess it and run one step ahead.
        may_guess = self.spec.settings.speculate and s == state.main_step + 1 and not state.ending
        if waiting_for_main and not may_guess:
            return False
        return not (state.ending and s > state.main_step)

    def step(self, batch: list[Emulation]) -> None:
        """One step of each sequence of ``batch``, in one pass of the model."""
        self._run([(state, self._input(state)) for state in batch])

    def _input(self, state: Emulation) -> Work:
        """A sequence's next step made ready: main's KV and token taken where they came, its input
        written after the positions its cache holds."""
        s = state.next_step
        align = state.aligns.get(s)
        if align is not None and align.keys is not None and align.values is not None:
            apply_kv(state.cache, align, self.device, self.kv_dtype)
            state.kv_aligns += 1
        token = state.own_next
        if align is not None and align.token is not None:
            token = align.token
            state.token_aligns += 1
        if align is None and (self.drafting or any(alignment.alignment_due(s, state.token_period, state.kv_period))):
            state.speculated.add(s)
            state.speculations += 1
        state.inputs[s] = token
        state.version += 1
        state.running_step = s
        position = state.prompt_len + s - 1
        state.tokens[0, position] = token
        return Work(state.request_id, position, position + 1, samples=True)

    def _run(self, batch: list[tuple[Emulation, Work]]) -> None:
        """The model over ``batch`` (a prompt, or a step of several sequences); each sequence's own
        greedy token after it, its guess of main's next."""
        outcomes = self.runner.run(batch)
        for (state, _), outcome in zip(batch, outcomes, strict=True):
            assert outcome.last is not None
            state.largest_batch = max(state.largest_batch, len(batch))
            state.own_next = self._guess(state, outcome.last)
            if state.running_step:
                state.next_step = state.running_step + 1
            if self.drafting:
                self._answer_drafts(state)

    def _guess(self, state: Emulation, logits: torch.Tensor) -> int:
        """The shadow's guess of main's token after its step (the prompt's: token 0): its greedy
        token, or for a sampled request the draw main's generator makes for that token, from the
        generator's state before that token's draw (saved the first time, restored when it runs
        again); either among the tokens the sequence's grammar allows there, if it has one."""
        index = state.running_step
        if state.grammar is not None:
            generated = state.tokens[0, state.prompt_len : state.prompt_len + index].tolist()
            allowed = state.grammar.allowed_after(generated, logits.device)
            if allowed is not None:  # None: it refuses a guess made before it came; this one goes without
                logits = logits.masked_fill(~allowed, float("-inf"))
        if state.sampler is None:
            return int(logits.argmax())
        if state.sampler.generator is None:  # greedy, under knobs that change its choice
            return state.sampler.next_token(state.tokens[:, : state.prompt_len + index], logits)
        saved = state.draws.get(index)
        if saved is None:
            state.draws[index] = state.sampler.generator.get_state()
        else:
            state.sampler.generator.set_state(saved)
        return state.sampler.next_token(state.tokens[:, : state.prompt_len + index], logits)

    def finish(self, state: Emulation) -> None:
        # On our link to main, behind every prediction we sent for this sequence: main keeps the
        # sequence until these statistics come, so none of its predictions is lost. (As a reply
        # on main's link to us, they overtook predictions still queued on ours.)
        self.endpoint.send(
            "main",
            ShadowStats(
                request_id=state.request_id,
                steps_done=state.next_step - 1,
                rewinds=state.rewinds,
                token_aligns=state.token_aligns,
                kv_aligns=state.kv_aligns,
                speculations=state.speculations,
                speculation_misses=state.speculation_misses,
                largest_batch=state.largest_batch,
                cached_prompt_tokens=state.cached_prompt_tokens,
            ),
        )
        self.compiles.cancel(state.request_id)
        if self.states.pop(state.request_id, None) is not None and self.prefixes is not None:
            held = state.cache.get_seq_length()
            self.prefixes.store(
                state.tokens[0, :held].tolist(), state.cache, self._prefix_room(), root=state.prefix_root
            )

    def _prefix_room(self) -> int:
        """Tokens of KV its prefix cache may hold: the KV the fit check reserves for the shadow
        (``max_states`` sequences of ``DEFAULT_CONTEXT_TOKENS``) less what its sequences may fill."""
        following = sum(s.prompt_len + s.max_new_tokens for s in self.states.values())
        return self.max_states * DEFAULT_CONTEXT_TOKENS - following

    # --- model plumbing -----------------------------------------------------------------

    def _serve_layer(self, layer: int, batch: list[Emulation]) -> list[torch.Tensor]:
        """The runner's experts of a layer: its router decisions sent first as predictions (of a
        decode step; a prompt's are not), then every sequence's rows through the shadow's own
        experts in one call."""
        calls = [state.call for state in batch]
        predicted = [
            self._prediction(state, layer, call.top_k_index[-1])  # type: ignore[union-attr]
            for state, call in zip(batch, calls, strict=True)
            if state.running_step and (not self.drafting or state.running_step in state.pass_of)
        ]
        if predicted:
            self._predict(layer, predicted)
        rows = torch.cat([c.hidden_states for c in calls])  # type: ignore[union-attr]
        index = torch.cat([c.top_k_index for c in calls])  # type: ignore[union-attr]
        weights = torch.cat([c.top_k_weights for c in calls])  # type: ignore[union-attr]
        routed = self.family.experts(self.model.model.layers[layer])(rows, index, weights)
        return list(routed.split([c.hidden_states.shape[0] for c in calls]))  # type: ignore[union-attr]

    def _prediction(self, state: Emulation, layer: int, chosen: torch.Tensor) -> Prediction:
        """The shadow's routing of a sequence's step at ``layer``: the experts it chose there; drafting,
        the union so far of main's pass that the step is a position of, keyed by that pass."""
        experts = {int(e) for e in chosen.tolist()}
        step = state.running_step
        if self.drafting:
            step = state.pass_of[state.running_step]
            experts = state.unions.setdefault((step, layer), set())
            experts.update(int(e) for e in chosen.tolist())
        return Prediction(
            request_id=state.request_id, step=step, layer=layer, experts=sorted(experts), version=state.version
        )

    def _predict(self, layer: int, predicted: list[Prediction]) -> None:
        """A layer's predictions for the step's sequences, in one message to main and to each of
        the layer's workers."""
        peers = ["main", *(f"worker-{worker}" for worker in self.placement.workers_for_layer(layer))]
        self.endpoint.send_to(peers, Predictions(items=predicted))


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def shadow_sampler(model: PreTrainedModel, msg: ShadowBegin, prompt_len: int, device: torch.device) -> Sampler | None:
    """The request's sampler as main built it (``request_sampler``, main's seed and knobs): the shadow's
    guess of each token is then the draw (or the greedy choice) main makes there, from the shadow's
    own logits. None for a greedy request whose knobs change nothing: its guess is the argmax."""
    if not msg.do_sample and not shapes_greedy(msg):
        return None
    return request_sampler(model, msg, prompt_len=prompt_len, device=device)


def apply_kv(cache: DynamicCache, align: Align, device: torch.device, dtype: torch.dtype) -> None:
    """Replace positions [kv_from, kv_to) of every layer of ``cache`` with main's."""
    assert align.keys is not None and align.values is not None
    truncate_cache(cache, align.kv_from)
    keys = align.keys.to(device, dtype)  # [L, B, kvH, P, D]
    values = align.values.to(device, dtype)
    for layer in range(keys.shape[0]):
        cache.update(keys[layer], values[layer], layer)


def splice_kv(cache: DynamicCache, align: Align, device: torch.device, dtype: torch.dtype) -> None:
    """Put main's KV at positions [kv_from, kv_to) of ``cache``, keeping its entries after them."""
    assert align.keys is not None and align.values is not None
    keys = align.keys.to(device, dtype)  # [L, B, kvH, P, D]
    values = align.values.to(device, dtype)
    start, stop = align.kv_from, align.kv_to
    for layer, cached in enumerate(cache.layers):
        cached.keys = torch.cat([cached.keys[:, :, :start], keys[layer], cached.keys[:, :, stop:]], dim=2)
        cached.values = torch.cat([cached.values[:, :, :start], values[layer], cached.values[:, :, stop:]], dim=2)


def serve(spec: RoleSpec) -> None:
    ShadowRole(spec).run()
