"""Grammar compiles for main (and the shadow), off the step loop: once per distinct grammar, in a
thread of their own.

Main's loop steps every sequence of the batch, one step at a time; a grammar's compile takes what
the grammar asks, up to seconds for the largest the limits admit (``inference.wire.grammar``). So
a request with a grammar, once admitted (``MainRole.admit`` decides admission before any compile,
and counts the requests waiting here as waiting), waits here until its grammar is compiled; then
it enters main's queue, or ends with ``Failed`` naming the limit its grammar is past. A cancel
takes it out at once.

- **Once per distinct grammar.** Compiles are kept by their grammar's digest
  (``CompiledGrammars``: the last ``CACHE_ENTRIES``, at most ``CACHE_BYTES`` of grammar text), a
  refusal too (the limits decide the same way every time); a request whose grammar is being
  compiled waits for that compile. Each sequence gets its own copy of the compiled matcher at
  its join (``take``: ``LLMatcher.deep_copy``, tens of microseconds), so the n choices of one
  request cost one compile.
- **Fair.** One compile at a time; the next is the oldest of the user with the fewest
  generations in main (``scheduler.next_to_join``), so one user's many grammars take turns with
  everyone else's.
- **Off the loop.** llguidance lets go of the GIL while it compiles and computes a mask
  (measured: a 0.66 s validation and a 1.95 s compile in a thread left a Python loop in the main
  thread running throughout, its longest pause 24 ms, where the shared machine's load alone made
  12), so a thread takes the compile off main's loop. The thread runs at the lowest CPU priority
  (nice 19), so that on a busy machine it takes what the step loop and the workers leave: on this
  2-core machine (``benchmarks/grammar_compiles.py``), main's median step while the report's
  8,000-property schema compiled rose 1.13 and 1.24 times without it, 1.00 to 1.16 times with it
  (SCHED_IDLE did no better).
- **A wall clock as a backstop only.** A compile still running ``COMPILE_BACKSTOP_S`` after it
  began fails its requests (the limits should have ended it long before); the thread cannot be
  stopped, so it finishes, and what it compiled is kept.

The shadow compiles the same grammars here for its guesses of main's tokens (``ShadowBegin``
carries the grammar; a guess that breaks it would be a draft main rejects), one compile at a
time too, and guesses without the grammar until its compile ends.

Why a thread and not a process: a compiled matcher cannot leave the process that built it (it
is not picklable), so a child process could only say whether a grammar compiles and main would
compile it again; the GIL, the one reason for a process, is let go.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import llguidance

from inference.runtime.engine.scheduler import next_to_join
from inference.wire.grammar import Compiled, CompiledGrammars, compile_grammar, digest

CACHE_ENTRIES = 32  # compiled grammars main keeps
# ... and their text's bytes: a compiled grammar takes about 50 times its text (measured: 18 MB for
# 128 tools' 372 KB), plus its lexer's states (at most max_lexer_states, 1 to 2 kB each).
CACHE_BYTES = 4 * 1024 * 1024
COMPILE_BACKSTOP_S = 60.0  # 20 times the slowest compile the limits admit here (about 3 s)
LOWEST_PRIORITY = 19  # the compile thread's nice


class GrammarRequest(Protocol):
    """What a compile needs of a request: main's ``Generate``, the shadow's ``ShadowBegin``."""

    @property
    def request_id(self) -> str: ...
    @property
    def user(self) -> str: ...
    @property
    def grammar(self) -> str: ...


R = TypeVar("R", bound=GrammarRequest)


@dataclass
class _Job(Generic[R]):
    """One grammar to compile, and the requests that wait for it (in arrival order)."""

    key: bytes
    grammar: str
    requests: list[tuple[R, bytes]]
    started: float = 0.0  # when the thread took it (0: not yet)
    given_up: bool = False  # its requests were answered by the backstop


class Compiles(Generic[R]):
    """The requests whose grammar is being compiled, the compiles, and the compiled grammars.

    Used from its role's loop only, but for the thread that compiles (``_work``), which talks to it
    through two queues. ``bytes`` beside each request: whom to answer (main's client; the shadow's: b"").
    """

    def __init__(
        self,
        tokenizer: Callable[[], llguidance.LLTokenizer],
        *,
        cache: CompiledGrammars | None = None,
        backstop_s: float = COMPILE_BACKSTOP_S,
    ) -> None:
        self.tokenizer = tokenizer
        self.cache = cache or CompiledGrammars(max_entries=CACHE_ENTRIES, max_bytes=CACHE_BYTES)
        self.backstop_s = backstop_s
        self.compiles = 0  # compiles begun (each distinct grammar not in the cache: one)
        self._jobs: dict[bytes, _Job[R]] = {}  # waiting and running, by grammar digest
        self._running: _Job[R] | None = None
        self._ready: dict[str, llguidance.LLMatcher] = {}  # compiled, by request id, until its join
        self._todo: queue.SimpleQueue[_Job[R] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[_Job[R], Compiled]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # --- main's loop ------------------------------------------------------------------------

    def submit(self, msg: R, client: bytes) -> str | None:
        """An admitted request with a grammar: "" when its grammar is compiled already (the request
        may queue now), why it cannot be served when that is known already, None while it waits here
        for its compile (``poll`` hands it back)."""
        key = digest(msg.grammar)
        compiled = self.cache.get(key)
        if compiled is not None:
            return self._hold(msg, compiled)
        self._jobs.setdefault(key, _Job(key, msg.grammar, [])).requests.append((msg, client))
        return None

    def poll(self, busy_users: list[str]) -> list[tuple[R, bytes, str]]:
        """The requests whose compile ended, each with "" (it may queue) or why not; and the next
        compile begun if none runs. ``busy_users``: one entry per generation in main's batch and queue."""
        ended: list[tuple[R, bytes, str]] = []
        while True:
            try:
                job, compiled = self._done.get_nowait()
            except queue.Empty:
                break
            self.cache.put(job.key, compiled)
            self._running = None
            # The job's requests, or, where the backstop answered them, a later job's for the same grammar.
            waiting = self._jobs.pop(job.key, None)
            if waiting is not None:
                ended += [(msg, client, self._hold(msg, compiled)) for msg, client in waiting.requests]
        job = self._running
        if job is not None and not job.given_up and time.monotonic() - job.started > self.backstop_s:
            job.given_up = True  # its thread runs on; what it compiles is kept
            problem = (
                f"the grammar was still compiling after {self.backstop_s:g} s (a backstop: the grammar "
                "limits should end any compile long before)"
            )
            ended += [(msg, client, problem) for msg, client in job.requests]
            self._jobs.pop(job.key, None)
        if self._running is None:  # those that just compiled are about to queue: busy too
            self._start_next(busy_users + [msg.user for msg, _, problem in ended if not problem])
        return ended

    def cancel(self, request_id: str) -> tuple[R, bytes] | None:
        """Take a request out of its compile's wait (the compile goes on if it began): the request, or
        None if it was not waiting here."""
        for key, job in list(self._jobs.items()):
            for entry in job.requests:
                if entry[0].request_id == request_id:
                    job.requests.remove(entry)
                    if not job.requests and job is not self._running:
                        del self._jobs[key]  # nobody waits for it any more, and it has not begun
                    return entry
        return None

    def take(self, request_id: str) -> llguidance.LLMatcher:
        """A joining request's own matcher: a copy of its compiled grammar, at its first token."""
        return self._ready.pop(request_id).deep_copy()

    def forget(self, request_id: str) -> None:
        """A queued request left before it joined (cancelled, or main failed its queue)."""
        self._ready.pop(request_id, None)

    def holds(self, request_id: str) -> bool:
        """Whether the request waits here for its compile."""
        return any(msg.request_id == request_id for job in self._jobs.values() for msg, _ in job.requests)

    def users(self) -> list[str]:
        """The users of the requests that wait here, one entry each."""
        return [msg.user for job in self._jobs.values() for msg, _ in job.requests]

    @property
    def pending(self) -> bool:
        """Whether any request waits here (main then looks for ended compiles more often)."""
        return any(job.requests for job in self._jobs.values())

    def drain(self) -> list[tuple[R, bytes]]:
        """Every request waiting here, taken out (main is shutting down)."""
        entries = [entry for job in self._jobs.values() for entry in job.requests]
        self._jobs.clear()  # a running compile ends in the thread, and is kept
        return entries

    def close(self) -> None:
        """Let the thread end after its compile (if any)."""
        if self._thread is not None:
            self._todo.put(None)

    def _hold(self, msg: R, compiled: Compiled) -> str:
        if compiled.matcher is not None:
            self._ready[msg.request_id] = compiled.matcher
        return compiled.problem

    def _start_next(self, busy_users: list[str]) -> None:
        waiting = [job for job in self._jobs.values() if job.requests and not job.started]  # oldest first
        if not waiting:
            return
        job = waiting[next_to_join([job.requests[0][0].user for job in waiting], busy_users)]
        job.started = time.monotonic()
        self._running = job
        self.compiles += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="grammar-compiles", daemon=True)
            self._thread.start()
        self._todo.put(job)

    # --- the compile thread -------------------------------------------------------------------

    def _work(self) -> None:
        # Linux gives each thread its own nice value; lowering one's own needs no privilege.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
        while (job := self._todo.get()) is not None:
            try:
                matcher, problem = compile_grammar(job.grammar, self.tokenizer())
            except Exception as exc:  # the model's tokenizer cannot be read: every grammar fails, main serves on
                matcher, problem = None, str(exc)
            self._done.put((job, Compiled(matcher, problem, len(job.grammar.encode()))))
