"""What the runtime's processes say to each other over ZeroMQ (framing: ``inference.runtime.protocol``).

Client and main: ``Generate`` and its events (``inference.wire.generation``), ``Cancel``,
``SetAlignment``, ``Shutdown``; every role: ``Ping``/``Pong``. Main to workers and the shadow:
the session and its steps (``Begin``, ``SequenceJoin``/``Leave``, ``ShadowBegin``, ``Align``,
``DraftAsk``, ``ExpertRequest``, ``End``); back: ``ExpertResult``, ``Prediction`` (the shadow's
batched in ``Predictions``), the shadow's ``Drafts`` and the statistics.

A field declared ``Tensor`` holds a ``torch.Tensor``; it travels as a raw frame after the
header, never pickled, never copied into the header. ``TENSORS`` names those fields.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from inference.constants import MAX_DRAFT_TOKENS
from inference.wire.base import Message, Tensor, declared, own_fields
from inference.wire.generation import Done, Failed, Generate, Sampled, Token

# --- lifecycle and health -------------------------------------------------------------


class Ping(Message, kw_only=True, tag="ping"):
    """Health question. ``nonce``, the asker's number for it, comes back in the Pong."""

    nonce: int = 0


class Pong(Message, kw_only=True, tag="pong"):
    """Health answer. ``ready`` is true once the role can serve; ``detail`` says why not.

    The role's memory, measured when it answers: ``host_bytes`` and ``peak_host_bytes`` its
    process's resident set now and at its highest, ``device_bytes`` what it holds on its GPU
    (0 on a CPU). ``nonce`` is the Ping's: an asker tells its answer from those to earlier pings.
    """

    role: str
    ready: bool
    detail: str = ""
    host_bytes: int = 0
    peak_host_bytes: int = 0
    device_bytes: int = 0
    nonce: int = 0


class Shutdown(Message, kw_only=True, tag="shutdown"):
    pass


# --- client -> main (and Generate, Token, Done, Failed: inference.wire.generation) ---------


class Cancel(Message, kw_only=True, tag="cancel"):
    request_id: str


class SetAlignment(Message, kw_only=True, tag="set_alignment"):
    """Change the shadow's alignment periods; applies from the next decode step on.

    A period of 0 means never align. Sent by a client to main, and by main to the shadow
    with ``from_step`` filled in.
    """

    token_period: int
    kv_period: int
    from_step: int = 0


# --- main -> workers / shadow -------------------------------------------------------------


class Begin(Message, kw_only=True, tag="begin"):
    """A session starts (the first of a batch of sequences): workers reset and prefetch their prefill experts."""

    request_id: str
    prompt_len: int
    max_new_tokens: int


class SequenceJoin(Message, kw_only=True, tag="sequence_join"):
    """A sequence joins the batch of session ``request_id``: its prefill is session step ``first_step``.

    Main runs several sequences in lockstep, one step each per session step, so the shadow's
    prediction for the sequence's step ``s`` is one for session step ``first_step + s``.
    """

    request_id: str
    sequence: str
    first_step: int


class SequenceLeave(Message, kw_only=True, tag="sequence_leave"):
    """A sequence left the batch of session ``request_id``: session step ``last_step`` ran its
    last token. The session goes on with the others (its end is ``End``)."""

    request_id: str
    sequence: str
    last_step: int


class ShadowBegin(Sampled, kw_only=True, tag="shadow_begin"):
    """The shadow starts emulating a request: it prefills the prompt on its own, reusing only its
        tenant's prefix-cache blocks (``user`` and ``prefix_namespace``: the ``Generate``'s). The
        request's sampling (its parameters and knobs, the ``Generate``'s) and the seed main's generator
        drew from (the request's, or the one main drew for a request without one) let the shadow guess
        each token with the draw main makes there; ``grammar`` (the ``Generate``'s, "" for none) lets it
        guess only tokens the grammar allows; ``answered`` (the ``Generate``'s) says how many of the prompt's
    last tokens are the answer's own, sent before main's restart."""

    TENSORS: ClassVar[tuple[str, ...]] = ("prompt_ids",)
    request_id: str
    token_period: int
    kv_period: int
    prompt_ids: Tensor
    user: str = ""
    prefix_namespace: str = ""


class Align(Message, kw_only=True, tag="align"):
    """Main's state at the start of decode step ``step``.

    Always carries main's progress; carries main's input token for the step when tokens
    are aligned at this step, and main's KV cache for positions ``[kv_from, kv_to)`` of
    every layer (``keys``/``values`` shaped [L, B, kvH, P, D]) when KV is aligned.
    """

    TENSORS: ClassVar[tuple[str, ...]] = ("keys", "values")
    request_id: str
    step: int
    token: int | None = None
    kv_from: int = 0
    kv_to: int = 0
    keys: Tensor | None = None
    values: Tensor | None = None


class DraftAsk(Message, kw_only=True, tag="draft_ask"):
    """Main asks the shadow for a sequence's next decode pass, its ``step`` (the sequence's own
    step count, as workers key predictions): ``tokens`` drafted tokens from generated index
    ``position`` on, and its routing of every position of the pass (``tokens + 1`` of them,
    their union per layer sent as the pass's predictions). Sent after the ``Align`` of the token
    at ``position - 1``; 0 tokens asks for the routing of the pass's one position only."""

    request_id: str
    step: int
    position: int
    tokens: int


class Drafts(Message, kw_only=True, tag="drafts"):
    """The shadow's answer to a ``DraftAsk``: its guesses of main's generated tokens
    ``position``, ``position + 1``, ... (fewer than asked where it drafted an end of sequence)."""

    request_id: str
    step: int
    position: int
    tokens: Annotated[list[int], msgspec.Meta(max_length=MAX_DRAFT_TOKENS)]


class ExpertSegments(Message, kw_only=True):
    """Which rows of (step, layer) go to which expert: ``ExpertRequest`` and the ``ExpertResult``
    that answers it name them alike. ``experts[i]``'s segment is ``counts[i]`` rows starting at row
    ``offsets[i]`` of that expert's rows."""

    request_id: str
    step: int
    layer: int
    experts: list[int]
    counts: list[int]
    offsets: list[int]

    def segments(self) -> dict[str, object]:
        """These fields, by name: what an answer repeats of its request."""
        return {name: getattr(self, name) for name in SEGMENT_FIELDS}


SEGMENT_FIELDS = own_fields(ExpertSegments)


class ExpertRequest(ExpertSegments, kw_only=True, tag="expert_request"):
    """Compute these experts for (step, layer); an empty list releases any prefetch.

    ``rows`` holds the segments' hidden-state rows (``ExpertSegments``), one segment after
    another, and ``weights`` their routing weights. A long prefill arrives as several such requests
    (mini-batches); the worker keeps an expert on the device until a ``final`` request
    for it, the one carrying its last rows. ``previous_step_s`` is how long the session's
    previous step took as main timed it (0 for its first): every worker of a layer group hears
    the same periods, and finds its hybrid share from them (``inference.policies.hybrid``).
    """

    TENSORS: ClassVar[tuple[str, ...]] = ("rows", "weights")
    final: bool = True
    previous_step_s: float = 0.0
    rows: Tensor | None = None
    weights: Tensor | None = None


class End(Message, kw_only=True, tag="end"):
    """The session (workers) or the sequence (shadow) is over: free everything and report statistics."""

    request_id: str


# --- workers / shadow -> main -------------------------------------------------------------


class ExpertResult(ExpertSegments, kw_only=True, tag="expert_result"):
    """Weighted expert outputs for the request's segments, in the order of its rows."""

    TENSORS: ClassVar[tuple[str, ...]] = ("output",)
    output: Tensor
    wait_ms: float  # time spent waiting for experts to reach the device
    compute_ms: float  # time spent computing the experts
    hits: int
    misses: int
    # The worker's time from taking the request out of its inbox (decoded) to building this
    # answer: its wait and compute plus its own Python around them. Main's wait for the answer
    # less this is the hops (framing, encryption, ZeroMQ, wake-ups, an emulated link).
    handled_ms: float = 0.0
    # Of the hops, the worker's time with the request before that: from its frames off the
    # socket (or its emulated delivery; or its previous answer, if later) to taking it out of its
    # inbox, its decoding and whatever else the worker handled first. Optional like
    # ``handled_ms``: an older worker's counts as 0.
    received_ms: float = 0.0


class WorkerStats(Message, kw_only=True, tag="worker_stats"):
    request_id: str
    worker: int
    expert_bytes: int
    peak_decode_bytes: int
    peak_prefill_bytes: int
    loads: int
    hits: int
    misses: int
    wasted_loads: int
    load_ms: float
    # A "hot" expert store (inference.policies.hotset): experts read from disk, and served from RAM.
    disk_reads: int = 0
    hot_hits: int = 0
    cpu_experts: int = 0  # hybrid execution: experts computed on the worker's CPU, not copied


class Prediction(Message, kw_only=True, tag="prediction"):
    """The shadow's routing for (step, layer): the experts main will most likely pick."""

    request_id: str
    step: int
    layer: int
    experts: list[int]
    version: int = 0


MAX_PREDICTIONS = 1024  # Predictions in one message: a batch's sequences, and then some


class Predictions(Message, kw_only=True, tag="predictions"):
    """The shadow's routing of one layer for every sequence of its step, in one message.

    One message to each peer where one ``Prediction`` per sequence would be many: a step of 8
    sequences on a 4-worker group sends 5 messages a layer, not 40, and wakes each receiver
    once. Each item is read as the ``Prediction`` it is, in order; its own ``sender`` and
    ``deployment`` are not read (the batch's are the ones checked).
    """

    items: Annotated[list[Prediction], msgspec.Meta(max_length=MAX_PREDICTIONS)]


class ShadowStats(Message, kw_only=True, tag="shadow_stats"):
    request_id: str
    steps_done: int
    rewinds: int
    token_aligns: int
    kv_aligns: int
    speculations: int = 0  # steps run ahead of main on the shadow's own guess of main's token
    speculation_misses: int = 0  # ... of which the guess was wrong and the step was redone
    largest_batch: int = 1  # the most sequences the shadow stepped together in one of this one's steps
    cached_prompt_tokens: int = 0  # the prompt's first tokens whose KV came from the shadow's prefix cache


# Every message a runtime process may receive, the generation's included.
RUNTIME_MESSAGES: tuple[type[Message], ...] = declared(
    Ping,
    Pong,
    Shutdown,
    Generate,
    Token,
    Done,
    Failed,
    Cancel,
    SetAlignment,
    Begin,
    SequenceJoin,
    SequenceLeave,
    ShadowBegin,
    Align,
    DraftAsk,
    Drafts,
    ExpertRequest,
    End,
    ExpertResult,
    WorkerStats,
    Prediction,
    Predictions,
    ShadowStats,
)

__all__ = [cls.__name__ for cls in RUNTIME_MESSAGES] + ["RUNTIME_MESSAGES", "Message", "Tensor"]
