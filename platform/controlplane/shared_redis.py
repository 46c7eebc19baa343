"""This process's plain connection to the control plane's Redis (``REDIS_URL``), for the small
shared records kept there: when each node was last heard (``nodes.liveness``) and which chat answers
are being written (``chat.writing``). A Redis that stalls without refusing costs a call a second,
not its whole wait."""

from __future__ import annotations

import redis
from django.conf import settings

_clients: dict[str, redis.Redis] = {}

ERRORS = (redis.RedisError, OSError)  # what a call may raise when Redis is down or restarting
# What a restarting Redis raises (``BusyLoadingError`` is a ``ConnectionError``): worth waiting out,
# unlike its refusals (``ResponseError``).
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)


def client() -> redis.Redis:
    """The connection to the configured ``REDIS_URL`` (one pool per URL: tests point it elsewhere)."""
    url = settings.REDIS_URL
    if url not in _clients:
        _clients[url] = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    return _clients[url]
