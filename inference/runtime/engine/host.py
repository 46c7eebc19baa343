"""What the engine needs of the role that hosts it: one typed interface, so the engine names no role.

Main's role (``inference.runtime.roles.main.MainRole``) is the engine's host: it holds the model
and the sockets, admits requests into ``waiting``, keeps the session with the workers and the
shadow, and notices lost peers. The engine (``engine.Engine``) steps the batch and reaches the
host only through these members, so the engine's modules import nothing of the roles and a
different host (a test's, the simulator's) can drive the same engine. It sends through the host's
two typed outputs (``answer``: tokens and ends to a client; ``tell_shadow``), never a socket.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from inference.modelio.families.base import Family
    from inference.policies.placement import Placement
    from inference.runtime.engine.compiles import Compiles
    from inference.runtime.engine.exchange import Exchange
    from inference.runtime.spec import RoleSpec
    from inference.wire.runtime import (
        Align,
        Done,
        DraftAsk,
        Failed,
        Generate,
        ShadowBegin,
        ShadowStats,
        Token,
        WorkerStats,
    )


class Host(Protocol):
    """Main's side of the engine: the model it runs, the requests it admitted, its session and peers."""

    # What it serves, fixed from the start.
    spec: RoleSpec
    model: PreTrainedModel
    family: Family
    device: torch.device
    placement: Placement
    prerouter: torch.nn.Module | None
    exchange: Exchange
    compiles: Compiles[Generate]
    # What changes as it serves: admitted requests not yet joined (each with its client), the
    # session with the workers and its step, the alignment periods, what the workers reported.
    waiting: deque[tuple[Generate, bytes]]
    stopping: bool
    session: str
    step: int
    token_period: int
    kv_period: int
    worker_stats: dict[int, WorkerStats]

    # What the engine sends: a request's events to the client that asked, and to the shadow main's
    # tokens (with their KV where due) and its asks for drafts. The workers hear from the exchange.
    def answer(self, client: bytes, event: Token | Done | Failed) -> None: ...
    def tell_shadow(self, msg: Align | DraftAsk) -> None: ...
    @property
    def shadow_serving(self) -> bool: ...
    def drain_inbox(self) -> None: ...
    def note_links(self) -> None: ...
    def wait_for_side_message(self, deadline: float) -> None: ...
    def begin_session(self, first: Generate) -> None: ...
    def begin_step(self) -> None: ...
    def end_session(self) -> None: ...
    def announce_join(self, msg: Generate, joined_step: int, shadow_begin: ShadowBegin) -> None: ...
    def announce_leave(self, request_id: str, joined_step: int, *, last: bool) -> None: ...
    def end_shadow(self, request_id: str) -> ShadowStats | None: ...
