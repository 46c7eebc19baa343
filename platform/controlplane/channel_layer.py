"""The channel layer: channels_redis's, with a receive that waits out a Redis restart.

Every agent link, chat page and console is a Channels consumer whose loop waits on the layer's
``receive`` beside its websocket. channels_redis raises from ``receive`` when Redis refuses
connections or is still loading its data (a restart), and the exception ends the consumer and drops
its websocket: under load, with Redis restarted, 10 agent links closed at once and their nodes were
marked offline, main's among them (``benchmarks/results/load-production-run9.json``). Here
``receive`` waits for Redis instead, trying again with backoff (logged once per outage); the
consumer's websocket is served meanwhile (an agent's heartbeats are recorded in its node's row while
Redis is away: ``nodes.liveness``), and the messages Redis kept (appendonly, ``deploy/redis``) are
received after.

A generation's listener (``deployments.generation``) is not a consumer and does not wait: it reads
with ``receive_or_raise``, as channels_redis receives, since an outage may have lost its events (a
Redis that came back empty holds no group), and its generation fails retryably (a job asks again).

Sends are not tried again: a send whose reply the restart lost may have been delivered, and a
command delivered twice (a ``Generate``) is not the same as once. Its caller sees the error.
"""

from __future__ import annotations

import asyncio
import logging

from channels_redis.core import RedisChannelLayer as ChannelsRedisLayer

from controlplane.shared_redis import UNREACHABLE

log = logging.getLogger(__name__)

FIRST_WAIT_S, LONGEST_WAIT_S = 0.1, 2.0


class RedisChannelLayer(ChannelsRedisLayer):
    _waiting = False  # this process is waiting for Redis (one log line per outage)

    async def receive_or_raise(self, channel: str) -> dict:
        """channels_redis's receive: an unreachable Redis is raised."""
        return await super().receive(channel)

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
