"""A generation's listener ends without losing what its pop took for another channel
(``generation.stop_listening``).

Each process's consumers and generation listeners share one pop from Redis at a time, and a receive
cancelled during its pop loses what the pop took, though it was for another channel of the process:
a ``Generate`` for main's agent link, another request's events (channels_redis#366). Every
generation's listener used to be cancelled at the generation's end.

The window is short (the pop's answer read, its backup not yet written), so the tests widen it:
writing the backup waits a moment, and the listener is ended in that moment, as a generation's end
can end it at any point of its pop.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis.asyncio
from channels_redis.core import RedisChannelLayer

from controlplane.deployments.generation import _from_layer, stop_listening

DELIVERY_S = 3.0  # how long a receive waits for a message sent to it: far past a pop on loopback
MESSAGE = {"type": "agent.command", "command": {"type": "generate"}}


@pytest.fixture
def slow_backups(monkeypatch) -> asyncio.Event:
    """Writing a popped message's backup (channels_redis's ``<channel>$inflight``) waits 0.3 s; the
    event is set when a backup begins, that is once a message has been popped."""
    popped = asyncio.Event()
    zadd = redis.asyncio.Redis.zadd

    async def slow_zadd(self, name, *args, **kwargs):
        if str(name).endswith("$inflight"):
            popped.set()
            await asyncio.sleep(0.3)
        return await zadd(self, name, *args, **kwargs)

    monkeypatch.setattr(redis.asyncio.Redis, "zadd", slow_zadd)
    return popped


async def cancel(layer, channel: str, listener: asyncio.Task) -> None:
    """How a generation's end stopped its listener before."""
    listener.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await listener


async def _end_a_listener_as_it_pops_another_channels_message(redis_url: str, popped, end) -> dict | None:
    """A generation's listener, popping for its process, is ended just after the pop took a message
    for the process's other channel (a consumer's): what that channel's receive gets (None: nothing)."""
    layer = RedisChannelLayer(hosts=[redis_url])
    try:
        channel, consumer = await layer.new_channel(), await layer.new_channel()
        listener = asyncio.ensure_future(_from_layer(layer, channel, "generation.test", asyncio.Queue()))
        await asyncio.sleep(0.2)  # it holds the process's receive lock, blocked in the pop
        await layer.send(consumer, MESSAGE)
        await asyncio.wait_for(popped.wait(), DELIVERY_S)
        await end(layer, channel, listener)  # its generation ended
        assert listener.done()
        try:
            return await asyncio.wait_for(layer.receive(consumer), DELIVERY_S)
        except TimeoutError:
            return None
    finally:
        await layer.flush()
        await layer.close_pools()


def test_a_generations_end_stops_its_listener_and_the_message_its_pop_took_arrives(
    redis_url: str, slow_backups: asyncio.Event
) -> None:
    got = asyncio.run(_end_a_listener_as_it_pops_another_channels_message(redis_url, slow_backups, stop_listening))
    assert got == MESSAGE


def test_cancelling_the_listener_as_before_loses_that_message(redis_url: str, slow_backups: asyncio.Event) -> None:
    """Why the listener is never cancelled mid-pop, kept honest: when channels_redis stops losing the
    message, this fails, and stop_listening may go back to a cancel."""
    assert asyncio.run(_end_a_listener_as_it_pops_another_channels_message(redis_url, slow_backups, cancel)) is None
