"""Continuous batching in main: sequences that take turns and meet at every MoE layer.

Each active sequence runs Transformers' own ``generate`` in a thread of its own, and the
threads take turns: exactly one runs at any time, the others wait. A sequence runs until
its model reaches an MoE layer, where it hands over the layer's routed rows (a
``LayerCall``) and waits; when every sequence of the batch waits at the same layer, main
serves that layer's experts for all of them in one round (each expert loaded once for
every row routed to it) and hands each its answer. So a batch step is every sequence's
next token, and a sequence joins or leaves the batch between steps.

Why this way: every sequence's attention, routers, sampling and cache are exactly what
its own single-sequence run computes (same operations on the same shapes in the same
order, only interleaved with other sequences'), so batching never changes a token. Only
one thread runs at a time, so no lock is needed around main's sockets or records, and the
random generator's state is swapped at every turn, so seeded sampling draws what it
would alone.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inference.records import RequestState


class SequenceAborted(RuntimeError):
    """Main gave up on the layer this sequence waited at (a peer failed or timed out)."""


@dataclass
class LayerCall:
    """What a sequence waits for: the experts of ``layer`` for its routed rows."""

    layer: int
    hidden_states: torch.Tensor  # [T, H]
    top_k_index: torch.Tensor  # [T, K]
    top_k_weights: torch.Tensor  # [T, K]


@dataclass(eq=False)
class Sequence:
    """One sequence of the batch and its turn-taking thread.

    ``body`` is what the thread does (main's ``generate`` for the request); it runs only
    while the sequence has the turn.
    """

    state: RequestState
    body: Callable[[Sequence], object]
    device: torch.device
    threads: int
    call: LayerCall | None = None  # set while it waits at a layer
    answer: torch.Tensor | None = None
    abort: str = ""
    result: object = None
    error: BaseException | None = None
    finished: bool = False
    joined_step: int = -1  # the session step of its prefill
    user: str = ""  # who asked (for fairness between users)
    _go: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    _back: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    _thread: threading.Thread | None = None
    _rng: torch.Tensor | None = None
    _cuda_rng: torch.Tensor | None = None

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def step(self) -> int:
        """Its own step: 0 is its prefill."""
        return len(self.state.steps) - 1

    # --- the coordinator's side ---------------------------------------------------------

    def resume(self) -> None:
        """Give this sequence the turn and wait until it waits at a layer or has finished."""
        assert not self.finished
        self._swap_rng_in()
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=f"sequence-{self.request_id}", daemon=True)
            self._thread.start()
        self._go.release()
        self._back.acquire()
        self._swap_rng_out()

    def answer_with(self, output: torch.Tensor | None, abort: str = "") -> None:
        """Set what its waiting layer call returns (or that it fails), then let it run on."""
        self.call, self.answer, self.abort = None, output, abort
        self.resume()

    # --- the sequence's side ------------------------------------------------------------

    def wait_at(self, call: LayerCall) -> torch.Tensor:
        """Called in the sequence's thread: hand over ``call`` and wait for its answer."""
        self.call = call
        self._back.release()
        self._go.acquire()
        if self.abort:
            raise SequenceAborted(self.abort)
        assert self.answer is not None
        answer, self.answer = self.answer, None
        return answer

    def _main(self) -> None:
        self._go.acquire()
        # Per-thread settings a role made in its main thread: the intra-op threads, the GPU.
        torch.set_num_threads(self.threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            self.result = self.body(self)
        except BaseException as exc:  # the coordinator reports it to the client
            self.error = exc
        finally:
            self.finished = True
            self._back.release()

    def _swap_rng_in(self) -> None:
        if self._rng is not None:
            torch.set_rng_state(self._rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state(self._cuda_rng, self.device)

    def _swap_rng_out(self) -> None:
        self._rng = torch.get_rng_state()
        if self.device.type == "cuda":
            self._cuda_rng = torch.cuda.get_rng_state(self.device)


_CURRENT = threading.local()


def current_sequence() -> Sequence | None:
    """The sequence whose thread is calling, or None outside one."""
    return getattr(_CURRENT, "sequence", None)


def enter_sequence(sequence: Sequence) -> None:
    """Mark the calling thread as ``sequence``'s (its body's first act)."""
    _CURRENT.sequence = sequence


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


def next_to_join(waiting_users: list[str], running_users: list[str]) -> int:
    """Which waiting request joins the batch next (its index in ``waiting_users``, oldest first).

    Fair between users: the oldest request of the user with the fewest sequences running,
    so one user's many requests take turns with everyone else's instead of going first.
    """
    running: dict[str, int] = {}
    for user in running_users:
        running[user] = running.get(user, 0) + 1
    return min(range(len(waiting_users)), key=lambda i: (running.get(waiting_users[i], 0), i))


def prefill_pieces(prompt_len: int, step_tokens: int) -> list[tuple[int, int]]:
    """The [start, end) pieces a prompt is prefilled in, one batch step each (chunked prefill).

    ``step_tokens`` tokens a piece, the last piece the rest (1 to ``step_tokens`` tokens);
    0 means the whole prompt in one piece.
    """
    if prompt_len < 1:
        raise ValueError(f"a prompt has at least one token, got {prompt_len}")
    if step_tokens < 0:
        raise ValueError(f"step_tokens must be >= 0, got {step_tokens}")
    if step_tokens == 0:
        return [(0, prompt_len)]
    starts = range(0, prompt_len, step_tokens)
    return [(start, min(start + step_tokens, prompt_len)) for start in starts]


@dataclass(frozen=True)
class Segment:
    """One sequence's rows of one expert at a layer: the unit a worker computes on its own.

    ``offset`` is the first row in the layer's rows of that expert (every sequence's, one
    after another); ``count`` rows follow.
    """

    expert: int
    offset: int
    count: int


def pack_segments(segments: list[Segment], chunk: int) -> list[tuple[list[Segment], bool]]:
    """The requests one worker gets for a layer: (segments, final) pairs.

    Without a chunk (decode) every segment goes in one request. With one (a prefill is in
    the layer), each expert's segments go in requests of at most ``chunk`` rows (a segment
    is never split: it is what the worker computes in one go), expert after expert, with
    ``final`` on an expert's last one so the worker frees it at once.
    """
    if not segments:
        return []
    if chunk <= 0:
        return [(segments, True)]
    requests: list[tuple[list[Segment], bool]] = []
    by_expert: dict[int, list[Segment]] = {}
    for segment in segments:
        by_expert.setdefault(segment.expert, []).append(segment)
    for expert_segments in by_expert.values():
        current: list[Segment] = []
        rows = 0
        for segment in expert_segments:
            if current and rows + segment.count > chunk:
                requests.append((current, False))
                current, rows = [], 0
            current.append(segment)
            rows += segment.count
        requests.append((current, True))
    return requests
