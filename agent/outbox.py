"""A generation's events that the control plane has not acknowledged yet: kept, and sent again
after the link comes back up (agent protocol 8).

Main's agent sends each event of a generation (``Token``, ``Done``, ``Failed``) up the link as main
answers, whether the link is up or not: it may be down then, or drop before the control plane has
handed the event on. The outbox keeps every event, in the order it was sent, until the control
plane acknowledges it (``Acknowledge``: this generation's events up to that index were handed
on). When the link comes up again, what is kept goes first, so the caller gets every event in
order; it drops, by their index, the ones it already had. ``Done`` and ``Failed`` are numbered here,
after the tokens before them; an event after a generation's end is dropped.

Bounded: at most ``max_bytes`` of kept frames in all. A generation whose next event would pass that
is given up: what it kept is replaced by a retryable ``Failed`` saying why (its caller hears it
once the link is back), its later events are dropped, and ``keep`` hands that ``Failed`` back, so the
runner cancels the generation in main.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import msgspec

from agent.frames import encode
from inference.wire.generation import Failed, GenerationEvent, Token

MAX_KEPT_BYTES = 64 * 2**20  # 4 frames of the largest a link carries; a chat token's frame is ~100 bytes
GIVEN_UP = "the agent's link to the control plane was down for longer than it keeps a generation's events"


@dataclass
class _Kept:
    """One generation's unacknowledged events, oldest first, and what comes next."""

    events: deque[tuple[GenerationEvent, str]] = field(default_factory=deque)
    bytes: int = 0
    next_index: int = 0  # the next token's index: where Done or Failed goes
    ended: bool = False  # its Done or Failed is kept (or was acknowledged)


class Outbox:
    def __init__(self, max_bytes: int = MAX_KEPT_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: dict[str, _Kept] = {}

    def __len__(self) -> int:
        """The generations with an event kept or an end still to be acknowledged."""
        return len(self._kept)

    def number(self, event: GenerationEvent) -> GenerationEvent:
        """``event`` with its place: a ``Done`` or ``Failed`` after the generation's tokens so far."""
        if isinstance(event, Token):
            return event
        kept = self._kept.get(event.request_id)
        return msgspec.structs.replace(event, index=kept.next_index if kept is not None else 0)

    def keep(self, event: GenerationEvent, text: str) -> GenerationEvent | None:
        """Keep ``event`` (numbered, encoded as ``text``) until it is acknowledged; returns what is to
        be sent: the event, None after its generation's end, or the ``Failed`` a generation that ran
        out of room ends with (send that instead, and cancel the generation)."""
        kept = self._kept.setdefault(event.request_id, _Kept())
        if kept.ended:
            return None
        if self.bytes + len(text) > self.max_bytes:
            return self._give_up(event.request_id, kept)
        kept.events.append((event, text))
        kept.bytes += len(text)
        self.bytes += len(text)
        if isinstance(event, Token):
            kept.next_index = event.index + 1
        else:
            kept.ended = True
        return event

    def _give_up(self, request_id: str, kept: _Kept) -> Failed:
        failed = Failed(request_id=request_id, error=GIVEN_UP, retryable=True, index=kept.next_index)
        text = encode(failed)
        self.bytes -= kept.bytes
        kept.events.clear()
        kept.events.append((failed, text))
        kept.bytes = len(text)
        self.bytes += kept.bytes  # past the bound by one small frame at most: the end must be told
        kept.ended = True
        return failed

    def acknowledge(self, request_id: str, index: int) -> None:
        """The control plane handed on ``request_id``'s events up to and including ``index``."""
        kept = self._kept.get(request_id)
        if kept is None:
            return
        while kept.events and _index(kept.events[0][0]) <= index:
            _, text = kept.events.popleft()
            kept.bytes -= len(text)
            self.bytes -= len(text)
        if kept.ended and not kept.events:
            del self._kept[request_id]

    def pending(self) -> list[tuple[GenerationEvent, str]]:
        """Every kept event with its text, each generation's in the order they were sent."""
        return [item for kept in self._kept.values() for item in kept.events]


def _index(event: GenerationEvent) -> int:
    return event.index if event.index is not None else 0
