"""The channel layer: channels_redis's, with a receive that waits out a Redis restart, and sends
that wait for Redis when it surely did not take them.

Every agent link, chat page and console is a Channels consumer whose loop waits on the layer's
``receive`` beside its websocket. channels_redis raises from ``receive`` when Redis refuses
connections or is still loading its data (a restart), and the exception ends the consumer and drops
its websocket: under load, with Redis restarted, 10 agent links closed at once and their nodes were
marked offline, main's among them (``benchmarks/results/load-production-run9.json``). Here
``receive`` waits for Redis instead, trying again with backoff (logged once per outage); the
consumer's websocket is served meanwhile (an agent's heartbeats are recorded in its node's row while
Redis is away: ``nodes.liveness``), and the messages Redis kept (appendonly, ``deploy/redis``) are
received after. A message popped whose reply the restart lost is not lost either: channels_redis
pops into a backup queue and puts back what was not taken at the next receive.

A generation's listener (``deployments.generation``) reads with ``receive_or_raise``, as
channels_redis receives, and after an outage asks whether its channel is still in its group
(``in_group``): then Redis kept its data and the events wait there, and it receives on; if not, Redis
came back without its data, the generation's events and main's link's record of it are gone, and
the generation fails as one to ask again. An event lost all the same shows as a gap in the tokens'
indices.

**Sends** go through ``waiting_for_redis``. A send Redis surely did not run, because it refused the
connection or answered that it is still loading, is tried again until it takes it, for up to
``SEND_WAIT_S``: under load, 3 of 172 chat answers failed on the "Connection refused" of the
second a restart takes (``load-restarts-2``). A send whose reply was lost (the connection closed
under it) may have been delivered, and a command delivered twice (a ``Generate``) is not the same
as once: it is tried again only where the caller says a second delivery does no harm
(``repeatable``: joining a group, relaying an event the listener takes once by its index); else its
caller sees the error. One Redis host is assumed (this project's one): with several, a group send
runs one script per host, and a refusal by the second would send the first's part again.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis
from channels_redis.core import RedisChannelLayer as ChannelsRedisLayer

from controlplane.shared_redis import UNREACHABLE

log = logging.getLogger(__name__)

FIRST_WAIT_S, LONGEST_WAIT_S = 0.1, 2.0
SEND_WAIT_S = 10.0  # a restart takes about a second (``load-restarts-*``); loading a large AOF longer

T = TypeVar("T")


def redis_did_not_run_it(exc: BaseException) -> bool:
    """Whether the Redis call that raised ``exc`` surely never ran: the connection was refused (no
    server listening: redis-py raises its ``ConnectionError`` inside the ``OSError`` handler), or
    Redis answered that it is still loading its data."""
    if isinstance(exc, redis.BusyLoadingError | ConnectionRefusedError):
        return True
    refused = isinstance(exc.__context__, OSError) and exc.__context__.errno == errno.ECONNREFUSED
    return isinstance(exc, redis.ConnectionError) and refused


async def waiting_for_redis(
    call: Callable[..., Awaitable[T]], *args, repeatable: bool = False, wait_s: float = SEND_WAIT_S
) -> T:
    """``await call(*args)``, tried again with backoff while Redis is restarting, for up to ``wait_s``:
    after an error Redis surely did not run, or any unreachable Redis when ``repeatable`` (a second
    delivery does no harm). Past ``wait_s``, or on any other error, the error is raised."""
    loop = asyncio.get_running_loop()
    deadline, delay = loop.time() + wait_s, FIRST_WAIT_S
    while True:
        try:
            return await call(*args)
        except UNREACHABLE as exc:
            if not (repeatable or redis_did_not_run_it(exc)) or loop.time() + delay > deadline:
                raise
            log.info("Redis is restarting (%s): %s is tried again in %.1f s", exc, call, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, LONGEST_WAIT_S)


class RedisChannelLayer(ChannelsRedisLayer):
    _waiting = False  # this process is waiting for Redis (one log line per outage)

    async def receive_or_raise(self, channel: str) -> dict:
        """channels_redis's receive: an unreachable Redis is raised."""
        return await super().receive(channel)

    async def in_group(self, group: str, channel: str) -> bool:
        """Whether ``channel`` is in ``group``: no longer, once a Redis came back without its data."""
        connection = self.connection(self.consistent_hash(group))
        return await connection.zscore(self._group_key(group), channel) is not None

    async def receive(self, channel: str) -> dict:
        delay = FIRST_WAIT_S
        while True:
            try:
                message = await super().receive(channel)
            except UNREACHABLE as exc:
                if not RedisChannelLayer._waiting:
                    log.warning("the channel layer cannot reach Redis (%s): waiting for it", exc)
                    RedisChannelLayer._waiting = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, LONGEST_WAIT_S)
                continue
            if RedisChannelLayer._waiting:
                RedisChannelLayer._waiting = False
                log.warning("the channel layer reaches Redis again")
            return message
