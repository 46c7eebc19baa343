"""The engine's two sides: what it serves (``Served``), and the role around it (``Host``).

The engine (``engine.Engine``) is main's batch and its step; it never imports a role. What comes
in reaches it through its own methods (``submit``, ``cancel``, ``predicted``, ``drafted``,
``realign``); what goes out leaves through the host: a request's ``Token``, ``Done`` and
``Failed`` to its client (``answer``), main's tokens and asks for drafts to the shadow
(``tell_shadow``), and the session's news to the workers (``announce_join``, ``announce_leave``).
The experts of each layer come from the exchange it is given (``LayerServer``). Main's role
(``inference.runtime.roles.main.MainRole``) is the host that runs it: it keeps the sockets, the
peers' health and the session with the workers, and calls ``Engine.step`` from its one loop. A
different host and exchange (a test's, in one process) can drive the same engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from inference.modelio.families.base import Family
    from inference.policies.placement import Placement
    from inference.runtime.engine.sequence import Sequence
    from inference.settings import DeploymentSettings
    from inference.wire import runtime as wire


@dataclass(frozen=True)
class Served:
    """What the engine serves, fixed from the start: the deployment's settings, main's part of the
    model on its device, the family's layout, where the experts live, and the prerouter's heads
    (None unless the strategy uses them)."""

    settings: DeploymentSettings
    model: PreTrainedModel
    family: Family
    device: torch.device
    placement: Placement
    prerouter: torch.nn.Module | None = None


class LayerServer(Protocol):
    """The expert exchange: one MoE layer's experts for the whole batch, each sequence's summed
    expert output [T, H] in batch order (``exchange.Exchange``, over the workers)."""

    def serve_layer(self, layer: int, batch: list[Sequence]) -> list[torch.Tensor]: ...


class Host(Protocol):
    """Main's side of the engine: its links to the clients, the shadow and the workers."""

    @property
    def stopping(self) -> bool:
        """Whether main was told to stop (a wait for the shadow ends)."""
        ...

    @property
    def shadow_serving(self) -> bool:
        """Whether a shadow follows the sequences now (there is one, and it is not lost)."""
        ...

    def answer(self, client: bytes, event: wire.Token | wire.Done | wire.Failed) -> None:
        """A request's event to the client that sent it."""

    def tell_shadow(self, msg: wire.Align | wire.DraftAsk) -> None:
        """Main's token (and KV where due), or an ask for drafts, to the shadow."""

    def note_links(self) -> None:
        """Act on the peers' links now (a lost shadow stops being asked)."""

    def wait_for_side_message(self, deadline: float) -> None:
        """The next message before ``deadline`` handled (drafts reach the engine through it)."""

    def begin_step(self) -> None:
        """A pass over the batch begins: the session's step moves on."""

    def announce_join(self, msg: wire.Generate, pieces: int, shadow_begin: wire.ShadowBegin) -> int:
        """A request joins the batch and prefills in ``pieces`` steps: a session is begun if none
        runs, the workers and the shadow told; the session step of its first token."""
        ...

    def announce_leave(self, request_id: str, joined_step: int, *, last: bool) -> dict[int, wire.WorkerStats]:
        """A sequence left; the last one ends the session: its workers' statistics ({} otherwise)."""
        ...

    def end_shadow(self, request_id: str) -> wire.ShadowStats | None:
        """The shadow told a sequence ended: its statistics for it, if they come in time."""
        ...
