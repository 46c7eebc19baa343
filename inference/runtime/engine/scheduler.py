"""The engine's scheduler: a pure function from the waiting and running sequences to a step.

No torch, no sockets: each step it decides who leaves (finished, cancelled), who joins from
the queue (fair between users), and what each running sequence computes in the step (its
next prefill piece, or its next token). Admission of a new request (queue it, or refuse it
and why) is decided here too. The engine applies a plan; the runner executes its work.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from inference.wire.generation import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    PENALTY_LIMIT,
    Generate,
    Sampled,
)


class Admission(enum.Enum):
    """What main does with a new request: queue it, or refuse it and say why."""

    ADMIT = "admit"
    FULL = "full"  # the queue is full: the deployment is busy for everyone
    TOO_MANY = "too_many"  # this user already has the most generations one user may have here


def admission(
    user: str, running_users: list[str], waiting_users: list[str], *, max_waiting: int, max_per_user: int
) -> Admission:
    """Whether main queues a new request of ``user``, given who runs and who waits.

    A user's requests beyond the batch wait in the queue (and join in turn: ``next_to_join``)
    rather than being refused, up to ``max_per_user`` running and waiting at once; that bound
    is set below the batch and queue together, so one user who sends many still leaves room
    for others. The queue itself holds at most ``max_waiting``. Decided here, in main, for
    every caller (chat, the API and jobs, through any number of web processes) at once: one
    count, taken where the requests are. Requests without a user (a runtime client of the
    deployment's own, such as a benchmark) count against the queue only.
    """
    if user and running_users.count(user) + waiting_users.count(user) >= max_per_user:
        return Admission.TOO_MANY
    if len(waiting_users) >= max_waiting:
        return Admission.FULL
    return Admission.ADMIT


def refusal(decision: Admission, *, max_per_user: int, running: int, waiting: int) -> str:
    """Why main refused a request (``decision`` not ``ADMIT``), as its client is told: ``running``
    and ``waiting`` are main's sequences in its batch and its queue (a compiling grammar's too)."""
    if decision is Admission.TOO_MANY:
        return (
            f"this user already has {max_per_user} generations running or waiting on this deployment, "
            "the most one user may have at once; send more when one ends"
        )
    return f"main is full: {running} sequences running and {waiting} waiting; try again when one ends"


def request_problem(msg: Generate, *, vocab: int, context: int) -> str:
    """Why a generation request cannot be served by a model of ``vocab`` tokens and ``context``
    positions ("" when it can)."""
    if not msg.prompt_ids:
        return "the prompt is empty"
    if any(not 0 <= t < vocab for t in msg.prompt_ids):
        return f"prompt token ids must be in [0, {vocab})"
    if msg.max_new_tokens < 1:
        return "max_new_tokens must be >= 1"
    if not 0 <= msg.answered < len(msg.prompt_ids):  # a continuation re-reads its answer after a prompt
        return f"answered must be from 0 to {len(msg.prompt_ids) - 1} (the prompt's tokens but one), got {msg.answered}"
    if msg.do_sample and not msg.temperature > 0:
        return f"temperature must be > 0 when sampling, got {msg.temperature}"
    if msg.do_sample and not 0 < msg.top_p <= 1:
        return f"top_p must be in (0, 1], got {msg.top_p}"
    if not 0 <= msg.top_logprobs <= MAX_TOP_LOGPROBS:
        return f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {msg.top_logprobs}"
    problem = knobs_problem(msg, vocab=vocab)
    if problem:
        return problem
    if len(msg.prompt_ids) + msg.max_new_tokens > context:
        return (
            f"prompt ({len(msg.prompt_ids)} tokens) + max_new_tokens ({msg.max_new_tokens}) exceeds "
            f"the model's context of {context} tokens"
        )
    return ""


def knobs_problem(msg: Sampled, *, vocab: int) -> str:
    """Why a request's sampling knobs cannot be honoured ("" when they can): each within the
    bounds Transformers or OpenAI give it, and a logit bias only for tokens of the model."""
    if msg.top_k is not None and not 0 <= msg.top_k <= MAX_TOP_K:
        return f"top_k must be from 0 (no top-k) to {MAX_TOP_K}, got {msg.top_k}"
    if msg.min_p is not None and not 0 <= msg.min_p <= 1:
        return f"min_p must be in [0, 1], got {msg.min_p}"
    if msg.repetition_penalty is not None and not (0 < msg.repetition_penalty < math.inf):
        return f"repetition_penalty must be a number > 0, got {msg.repetition_penalty}"
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(msg, name)
        if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
            return f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value}"
    if len(msg.logit_bias) > MAX_LOGIT_BIAS:
        return f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(msg.logit_bias)}"
    if len({token for token, _ in msg.logit_bias}) < len(msg.logit_bias):
        return "logit_bias names a token more than once"
    for token, bias in msg.logit_bias:
        if not 0 <= token < vocab:
            return f"logit_bias token ids must be in [0, {vocab}), got {token}"
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            return f"a logit_bias must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {bias} (token {token})"
    return ""


def next_to_join(waiting_users: list[str], running_users: list[str]) -> int:
    """Which waiting request joins the batch next (its index in ``waiting_users``, oldest first).

    Fair between users: the oldest request of the user with the fewest sequences running,
    so one user's many requests take turns with everyone else's instead of going first.
    """
    running: dict[str, int] = {}
    for user in running_users:
        running[user] = running.get(user, 0) + 1
    return min(range(len(waiting_users)), key=lambda i: (running.get(waiting_users[i], 0), i))


def prefill_pieces(prompt_len: int, step_tokens: int, cached: int = 0) -> list[tuple[int, int]]:
    """The [start, end) pieces a prompt is prefilled in, one batch step each (chunked prefill),
    after its first ``cached`` tokens (a prefix whose KV came from the prefix cache).

    ``step_tokens`` tokens a piece, the last piece the rest (1 to ``step_tokens`` tokens);
    0 means the whole rest in one piece.
    """
    if prompt_len < 1:
        raise ValueError(f"a prompt has at least one token, got {prompt_len}")
    if step_tokens < 0:
        raise ValueError(f"step_tokens must be >= 0, got {step_tokens}")
    if not 0 <= cached < prompt_len:
        raise ValueError(
            f"a cached prefix leaves at least the prompt's last token to compute, got {cached} of {prompt_len}"
        )
    if step_tokens == 0:
        return [(cached, prompt_len)]
    starts = range(cached, prompt_len, step_tokens)
    return [(start, min(start + step_tokens, prompt_len)) for start in starts]


@dataclass(frozen=True)
class Waiting:
    """A request in the queue, as the scheduler sees it."""

    request_id: str
    user: str
    prompt_len: int
    max_new_tokens: int
    cached: int = 0  # its prompt's first tokens whose KV the prefix cache holds


@dataclass(frozen=True)
class Running:
    """A sequence of the batch, as the scheduler sees it.

    ``computed`` is how many of its tokens (prompt and generated) its cache holds; ``length``
    how many it has (the prompt, then every token sampled); ``generated`` of them sampled.
    """

    request_id: str
    user: str
    prompt_len: int
    computed: int
    length: int
    generated: int
    max_new_tokens: int
    cancelled: bool = False
    ended: bool = False  # its last token was an end of sequence, or it failed
    cached: int = 0  # its prompt's first tokens whose KV came from the prefix cache


@dataclass(frozen=True)
class Work:
    """What one sequence computes in a step: its tokens [start, end) through the model.

    ``samples``: the step ends with its next token (the last prefill piece, or a decode);
    an earlier prefill piece only fills the cache. ``drafts``: a decode's drafted next tokens
    (the shadow's), computed after its token as positions of their own; the scheduler plans
    none, the engine adds them.
    """

    request_id: str
    start: int
    end: int
    samples: bool
    drafts: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass
class StepPlan:
    """One step: who leaves (and why), who joins (queue indices, in the order they join), and
    each remaining sequence's work, in batch order (those running first, then those joining)."""

    leaves: list[tuple[str, str]] = field(default_factory=list)  # (request id, "cancelled" | "done")
    joins: list[int] = field(default_factory=list)
    work: list[Work] = field(default_factory=list)


def done(sequence: Running) -> bool:
    """Whether a sequence has nothing left to compute: its limit, its end, or its cancel."""
    return sequence.cancelled or sequence.ended or sequence.generated >= sequence.max_new_tokens


def work_of(sequence: Running, prefill_step: int) -> Work:
    """A sequence's next unit: the next prefill piece while its prompt is not all in the cache,
    else its last token (a decode)."""
    if sequence.computed < sequence.prompt_len:
        for start, end in prefill_pieces(sequence.prompt_len, prefill_step, sequence.cached):
            if start == sequence.computed:
                return Work(sequence.request_id, start, end, samples=end == sequence.prompt_len)
        raise ValueError(f"{sequence.request_id}: {sequence.computed} tokens computed is not a piece boundary")
    return Work(sequence.request_id, sequence.computed, sequence.length, samples=True)


def schedule(
    waiting: list[Waiting], running: list[Running], *, max_batch: int, prefill_step: int, admit: bool = True
) -> StepPlan:
    """The next step: every finished or cancelled sequence leaves, then waiting requests join
    (fairly: ``next_to_join``) while the batch has room, then every sequence computes one unit.

    ``admit`` False (main is stopping) lets nobody join.
    """
    plan = StepPlan()
    staying = []
    for sequence in running:
        if done(sequence):
            plan.leaves.append((sequence.request_id, "cancelled" if sequence.cancelled else "done"))
        else:
            staying.append(sequence)
    users = [s.user for s in staying]
    queue = list(enumerate(waiting))
    while admit and queue and len(users) < max_batch:
        chosen = next_to_join([w.user for _, w in queue], users)
        index, request = queue.pop(chosen)
        plan.joins.append(index)
        users.append(request.user)
        staying.append(
            Running(
                request.request_id,
                request.user,
                request.prompt_len,
                request.cached,
                request.prompt_len,
                0,
                request.max_new_tokens,
                cached=request.cached,
            )
        )
    plan.work = [work_of(s, prefill_step) for s in staying]
    return plan
