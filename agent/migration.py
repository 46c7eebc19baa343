"""An answer carried across main's restart: what main's agent asks the restarted main for, so the
answer goes on where it stopped (a pure decision; ``agent.generations.MainWork.generate`` runs it).

Main's agent outlives main: it starts main again when main's process exits (``RoleRunner._watch``),
and it already holds each generation's request and sees every token main sends. So it keeps, per
generation, the request and the tokens sent so far (``Carried``). When main exits mid-answer and
comes back, the agent asks the restarted main to go on, as the deployment's ``replay`` setting says:

- ``prefill`` (the default): the same request, its prompt followed by the tokens already sent
  (re-read in one prefill, as Transformers continuing from those tokens computes them), the rest of
  its budget, the same seed. It says how many of its prompt's tokens are the answer's own
  (``Generate.answered``): main walks the request's grammar through them before the first new
  token, and OpenAI's frequency and presence penalties count them as generated, as they would have
  in the undisturbed answer. Its events are renumbered after the tokens already sent and its result
  holds every token.
- ``exact``: the same request again, from its start. Main computes the same tokens (each sequence's
  arithmetic is its own, whatever the batch: ``batch_arithmetic`` exact; the same prefill pieces, the
  same seed), one decode step each; the agent checks each against the one it sent and drops it, and
  sends on from the first new one. The answer is the undisturbed one, grammar and penalties too.

Either way the caller sees a pause and then the rest of one answer, and the result's metrics say
where it resumed and how long each pause was (``main_restarts``: from the last token sent, or the
request, to the first new one). A request that samples without a seed is given one here, before
main first sees it (``seeded``): a random seed is what main would have drawn, and a continuation needs
to know it.

What is not carried (today's retryable error instead, saying why): past the deployment's
``max_migrations`` restarts for one answer or its ``max_replay_tokens`` tokens to re-read. An exact
replay that computes another token than the one sent ends the answer with the same error
(``ReplayDiverged``).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from inference.wire.generation import Done, Failed, Generate, GenerationEvent, Token

PREFILL, EXACT = "prefill", "exact"  # the replay modes (inference.constants.REPLAY_MODES)


class ReplayDiverged(RuntimeError):
    """An exact replay computed another token than the one sent at that place."""


def seeded(request: Generate) -> Generate:
    """``request`` with a seed of its own if it samples without one (what main would draw)."""
    if request.do_sample and request.seed is None:
        return msgspec.structs.replace(request, seed=secrets.randbits(63))
    return request


@dataclass
class Carried:
    """One generation as main's agent carries it: the request as main first got it, the tokens sent."""

    request: Generate
    mode: str = PREFILL  # the deployment's replay setting
    max_migrations: int = 1  # the deployment's: restarts one answer is carried across
    max_replay_tokens: int = 4096  # the deployment's: the most tokens sent that a continuation re-reads
    sent: list[int] = field(default_factory=list)
    resumed_at: list[int] = field(default_factory=list)  # len(sent) at each continuation
    paused_ms: list[float] = field(default_factory=list)  # each continuation's pause, as the caller saw it
    clock: Callable[[], float] = time.monotonic
    last_sent_at: float = field(init=False)  # when the last token was sent (or the request came)
    paused_since: float | None = field(init=False, default=None)  # a continuation's pause, until its first token

    def __post_init__(self) -> None:
        self.last_sent_at = self.clock()

    @property
    def offset(self) -> int:
        """Under prefill, where the events of the request now in main start: the tokens sent before it."""
        return self.resumed_at[-1] if self.resumed_at and self.mode == PREFILL else 0

    @property
    def restarts(self) -> dict:
        return {
            "count": len(self.resumed_at),
            "resumed_at": list(self.resumed_at),
            "paused_ms": list(self.paused_ms),
            "replay": self.mode,
        }

    def renumbered(self, event: GenerationEvent) -> GenerationEvent | None:
        """``event`` of the request now in main, as one of the whole answer (noting a token as sent);
        None for a token an exact replay computed again (checked: ``ReplayDiverged`` if it differs)."""
        offset = self.offset
        if isinstance(event, Token):
            index = event.index + offset
            if index < len(self.sent):  # replayed (exact): the caller has it
                if event.token_id != self.sent[index]:
                    raise ReplayDiverged(
                        f"main's restart replayed token {index} as {event.token_id}, not the {self.sent[index]} sent"
                    )
                return None
            self.sent.append(event.token_id)
            self._resumed()
            return msgspec.structs.replace(event, index=index) if offset else event
        if isinstance(event, Done) and self.resumed_at:
            self._resumed()
            metrics = {**event.metrics, "main_restarts": self.restarts}
            return msgspec.structs.replace(event, token_ids=self.sent[:offset] + event.token_ids, metrics=metrics)
        return event

    def _resumed(self) -> None:
        """A token sent (or the end): the pause of a continuation waiting for its first ends here."""
        now = self.clock()
        if self.paused_since is not None:
            self.paused_ms.append(round((now - self.paused_since) * 1000, 1))
            self.paused_since = None
        self.last_sent_at = now

    def continuation(self) -> Generate | str:
        """The request that continues the answer on a restarted main, or why it is not carried."""
        request, sent = self.request, self.sent
        if len(self.resumed_at) >= self.max_migrations:
            return (
                f"main's process exited mid-answer, past the {self.max_migrations} restart(s) an answer is "
                "carried across"
            )
        if len(sent) > self.max_replay_tokens:
            return (
                f"main's process exited mid-answer after {len(sent)} tokens, past the {self.max_replay_tokens} "
                "a continuation re-reads"
            )
        if self.mode == EXACT:
            self._pause()
            return request  # again from its start: the tokens sent are computed again, checked and dropped
        self._pause()
        return msgspec.structs.replace(
            request,
            prompt_ids=[*request.prompt_ids, *sent],
            answered=len(sent),  # the grammar walks them, the penalties count them
            max_new_tokens=request.max_new_tokens - len(sent),
            prompt_logprobs=request.prompt_logprobs and not sent,  # the caller had them with the first token
        )

    def _pause(self) -> None:
        """A continuation asked for: the answer resumes at the tokens sent, paused since the last."""
        self.resumed_at.append(len(self.sent))
        self.paused_since = self.last_sent_at

    @property
    def spent(self) -> bool:
        """Every token of the budget was sent: nothing is left to ask a restarted main for."""
        return len(self.sent) >= self.request.max_new_tokens

    def finished(self) -> Done:
        """The result of an answer whose budget was spent when main exited before its own result."""
        metrics = {"main_restarts": self.restarts}
        return Done(
            request_id=self.request.request_id, token_ids=list(self.sent), finish_reason="length", metrics=metrics
        )

    def failed(self, why: str) -> Failed:
        return Failed(request_id=self.request.request_id, error=f"{why}: ask again shortly", retryable=True)
