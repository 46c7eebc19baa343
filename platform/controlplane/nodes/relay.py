"""A generation's events from main's agent link to whoever streams them: inside this process
when it can, through the channel layer when it must.

Main's events (``Token``, ``Done``, ``Failed``) arrive on the agent link of main's node
(``consumers.AgentConsumer``) and go to the caller streaming that generation
(``deployments.generation.astream``). Under ``manage.py up`` there is one web process, and under
N web workers one request in N lands in the process that holds main's link: there the link hands
each event, as the struct it already parsed and checked, to the caller's queue, with no trip
through Redis and no encoding; elsewhere it sends it to the channel-layer group
``generation.<request_id>`` as before. A generation's events all go the same way: where its
caller listens is fixed before its request goes out (``listening``), and a link relays only
generations it was given (``owners``). The channel-layer copy leaves out the step report, which
only the console's live view reads (``cluster.step``).

A restarting Redis is waited for (``channel_layer.waiting_for_redis``): an event sent twice is taken
once, by its index, so a send whose reply was lost is sent again. Meanwhile the link reads no more
of its agent's frames; past the wait the error ends the link, and the agent sends again what was
not acknowledged on its next one.

A link that closes tells each of its open generations' callers so (``pause``): its agent keeps the
events it could not send and sends them again on its next link, so the caller waits on, and a
timeout meanwhile is one the same request may retry.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
from channels.layers import BaseChannelLayer

from controlplane.channel_layer import waiting_for_redis
from controlplane.nodes.groups import generation_group
from inference.wire.generation import Done, Failed, Token

Event = Token | Done | Failed
PAUSED = "generation.paused"  # the channel-layer message ``pause`` sends


@dataclass(frozen=True)
class LinkPaused:
    """What a caller's queue gets when main's link closed mid-generation (``pause``)."""

    request_id: str


# request id -> (the listener's event loop, its queue): callers streaming in this process.
_listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}


@contextlib.contextmanager
def listening(request_id: str) -> Iterator[asyncio.Queue]:
    """The queue this process's agent links hand ``request_id``'s events to while the block runs
    (it runs on the event loop that reads the queue). Events that come through the channel layer
    are the caller's to put in the same queue."""
    if request_id in _listeners:
        raise ValueError(f"generation {request_id} already has a listener in this process")
    inbox: asyncio.Queue = asyncio.Queue()
    _listeners[request_id] = (asyncio.get_running_loop(), inbox)
    try:
        yield inbox
    finally:
        del _listeners[request_id]


async def relay(layer: BaseChannelLayer, event: Event) -> None:
    """Hand ``event`` to its generation's caller: straight to its queue when it listens in this
    process, else to the generation's channel-layer group."""
    if _hand(event.request_id, event):
        return
    if isinstance(event, Token) and event.step is not None:
        event = msgspec.structs.replace(event, step=None)
    message = {"type": "generation.event", "event": event.to_json()}
    await waiting_for_redis(layer.group_send, generation_group(event.request_id), message, repeatable=True)


async def pause(layer: BaseChannelLayer, request_id: str) -> None:
    """Tell ``request_id``'s caller that main's link closed before its end: the rest comes when the
    agent is linked again."""
    if not _hand(request_id, LinkPaused(request_id)):
        message = {"type": PAUSED, "request_id": request_id}
        await waiting_for_redis(layer.group_send, generation_group(request_id), message, repeatable=True)


def _hand(request_id: str, item: Event | LinkPaused) -> bool:
    """Put ``item`` in the queue of ``request_id``'s caller if it listens in this process."""
    listener = _listeners.get(request_id)
    if listener is None:
        return False
    loop, inbox = listener
    if loop is asyncio.get_running_loop():
        inbox.put_nowait(item)
    else:  # a synchronous caller streams on an event loop of its own (generation.stream)
        with contextlib.suppress(RuntimeError):  # its loop closed: nobody listens any more
            loop.call_soon_threadsafe(inbox.put_nowait, item)
    return True
