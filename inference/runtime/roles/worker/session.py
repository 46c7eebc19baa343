"""What a worker knows of main's session: its sequences, their predictions, the layers served.

Pure bookkeeping, no sockets, tensors or loads: the role asks it which session step a
prediction is for, what the batch predicted for a layer, and what was planned on the CPUs.
"""

from __future__ import annotations

from inference.wire.runtime import SequenceJoin, SequenceLeave

MAX_JOINED = 1024  # sequences of one session a worker remembers (main runs far fewer at once)
# (step, layer) pairs with predictions not yet served: the shadow runs a few steps ahead, a
# chunked prefill's pieces some more; beyond this it is a peer flooding the worker.
MAX_PREDICTED = 16384


def session_step(source: str, step: int, session: str, joined: dict[str, int]) -> int | None:
    """The session step a prediction from ``source`` for its ``step`` is for, or None: main's
    own guesses come in session steps, the shadow's in a joined sequence's steps; with no
    session running (a late one for a session that ended, or a peer's stray) it is for none."""
    if not session:
        return None
    if source == session:
        return step
    if source in joined:
        return joined[source] + step
    return None


class Session:
    """Main's session as one worker sees it: one or more sequences batched, in lockstep."""

    def __init__(self) -> None:
        self.request_id = ""  # main's session; "" while none runs
        self.joined: dict[str, int] = {}  # a sequence of the session -> the session step of its prefill
        # The first session step of the session's one sequence: once others have left, the step
        # from which every worker of the group knows it (``leave``); 0 before any left.
        self.alone_from = 0
        # Per (session step, layer), what each source predicted (main, or the shadow per sequence).
        self.predicted: dict[tuple[int, int], dict[str, list[int]]] = {}
        self.flooded = 0  # predictions dropped this session because too many layers ahead were predicted
        self.served: tuple[int, int] = (-1, -1)  # the last (step, layer) main asked for
        # Per planned (session step, layer): the predicted experts this worker would have loaded.
        self.planned: dict[tuple[int, int], set[int]] = {}
        # The session step of the last decode token's first request to the group.
        self.token_mark: int | None = None

    def start(self, request_id: str) -> None:
        self.request_id = request_id
        self.forget()
        self.served = (-1, -1)

    def end(self) -> None:
        """The session ended: no request is served until the next begins."""
        self.request_id = ""
        self.forget()

    def forget(self) -> None:
        """What a session learnt of its sequences, predictions and plans: dropped at its begin and end."""
        self.joined.clear()
        self.alone_from = 0
        self.predicted.clear()
        self.planned.clear()
        self.token_mark = None
        self.flooded = 0

    def join(self, msg: SequenceJoin) -> None:
        if msg.request_id != self.request_id or msg.first_step < 0:
            return
        if len(self.joined) >= MAX_JOINED and msg.sequence not in self.joined:
            self.joined.pop(next(iter(self.joined)))  # the oldest: long gone, or a peer flooding us
        self.joined[msg.sequence] = msg.first_step

    def leave(self, msg: SequenceLeave, delay: int) -> bool:
        """A sequence left: its predictions are dropped. True when one sequence is left, alone
        from ``delay`` steps after the leaving one's last (a step every worker of the group agrees on)."""
        if msg.request_id != self.request_id or msg.sequence not in self.joined or msg.last_step < 0:
            return False
        del self.joined[msg.sequence]
        for sources in self.predicted.values():
            sources.pop(msg.sequence, None)  # a sequence that stopped early: its shadow ran on
        if len(self.joined) != 1:
            return False
        self.alone_from = max(self.alone_from, msg.last_step + delay)
        return True

    def alone(self, step: int) -> bool:
        """Whether session step ``step`` runs the session's one sequence (as every worker knows
        it), the only steps a share is planned for and measured on: batched rows make the CPU
        slower than the share was found for."""
        return len(self.joined) == 1 and step >= self.alone_from

    def step_of(self, source: str, step: int) -> int | None:
        return session_step(source, step, self.request_id, self.joined)

    def full(self, here: tuple[int, int]) -> bool:
        """Whether a prediction for a new (step, layer) ``here`` is one too many (counted once)."""
        if here in self.predicted or len(self.predicted) < MAX_PREDICTED:
            return False
        self.flooded += 1
        return True

    def predict(self, here: tuple[int, int], source: str, experts: list[int]) -> list[int]:
        """Note ``source``'s prediction for ``here``: the union the batch predicted, sorted."""
        sources = self.predicted.setdefault(here, {})
        sources[source] = experts  # a newer prediction from the same source replaces its older one
        return sorted(set().union(*sources.values()))

    def advance(self, here: tuple[int, int]) -> bool:
        """Main asked for ``here``: True when it is a new layer, whose earlier predictions are dropped."""
        if here <= self.served:
            return False
        self.served = here
        for key in [k for k in self.predicted if k <= here]:
            del self.predicted[key]
        return True

    def take_plan(self, here: tuple[int, int]) -> set[int]:
        """The experts planned on the CPUs for ``here`` (kept for the layer's other requests),
        the plans of earlier layers dropped."""
        planned: set[int] = set()
        for key in [k for k in self.planned if k <= here]:
            experts = self.planned.pop(key)
            if key == here:
                planned = experts
        if planned:  # the layer's other requests (more sequences' rows) find the same plan
            self.planned[here] = planned
        return planned
