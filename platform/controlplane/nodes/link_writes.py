"""The agent links' background writes (heartbeats, role states, task progress), on a few
threads of this web process that keep their database connection from one write to the next.

They are the web process's most frequent database work: every agent's heartbeat is two writes
(its liveness, then what its roles report), every few seconds, with or without traffic. With
``CONN_MAX_AGE`` 0, the default under ASGI (``config.settings.base``), each would open a
connection and close it again; on SQLite that was a fifth of the web process's CPU time while
the demo cluster served 8 chats at once (Django registers its SQL functions and runs the
``init_command`` on every connection). Requests keep the default: they run on threads of
their own, where a kept connection would never be used again. These threads are few and
live as long as the process, so each keeps one connection; a connection that failed is
replaced, and with health checks on, one the server dropped is too.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.db import connections

THREADS = 4  # one write per link at a time; writes of many links go on side by side

_executor = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="link-writes")


async def write(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """``fn(**kwargs)`` on a link-writes thread, awaited."""
    return await asyncio.get_running_loop().run_in_executor(_executor, functools.partial(_on_kept, fn, kwargs))


def _on_kept(fn: Callable[..., Any], kwargs: dict) -> Any:
    for connection in connections.all(initialized_only=True):
        connection.close_if_unusable_or_obsolete()  # a broken one goes; the next query checks health again
    try:
        return fn(**kwargs)
    finally:
        for connection in connections.all(initialized_only=True):
            connection.close_at = None  # kept for this thread's next write, whatever CONN_MAX_AGE says
