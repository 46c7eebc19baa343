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
generations sent down that link (a link that closes fails its open ones). The channel-layer copy
leaves out the step report, which only the console's live view reads (``cluster.step``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import msgspec
from channels.layers import BaseChannelLayer

from controlplane.nodes.groups import generation_group
from inference.wire.generation import Done, Failed, Token

Event = Token | Done | Failed

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
    listener = _listeners.get(event.request_id)
    if listener is not None:
        loop, inbox = listener
        if loop is asyncio.get_running_loop():
            inbox.put_nowait(event)
        else:  # a synchronous caller streams on an event loop of its own (generation.stream)
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody listens any more
                loop.call_soon_threadsafe(inbox.put_nowait, event)
        return
    if isinstance(event, Token) and event.step is not None:
        event = msgspec.structs.replace(event, step=None)
    await layer.group_send(generation_group(event.request_id), {"type": "generation.event", "event": event.to_json()})
