"""When each node was last heard, kept where it is cheap: Redis, not the node's row.

Every agent heartbeats every few seconds, so a database write per heartbeat was most of what a
heartbeat cost the web process. The moment each heartbeat arrives is kept in one Redis sorted set
instead (``HEARD_KEY``: node id -> Unix time), written by each web process in one batch a second
(``heard``, on the agent links' event loop). The node's row (``last_seen``, the inventory,
``online``) is written when its link comes up and then at most every ``ROW_REFRESH_S``
(``nodes.consumers``), so what the console shows of a node is at most that old.

Offline detection (``services.expire_silent_nodes``, Celery beat) reads both: a node is silent when
neither its sorted-set entry nor its row is within the timeout. A node with no entry (Redis
restarted, or this process could not reach it) is judged by its row alone, allowing for the row's
coarser clock (``ROW_REFRESH_S`` more), so no live node is taken for a silent one while the set
fills again. While Redis cannot be written, each link writes its node's row at every heartbeat, as
before (``writable``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from controlplane.nodes import link_writes
from controlplane.shared_redis import ERRORS, client

log = logging.getLogger(__name__)

HEARD_KEY = "odmoe:nodes:heard"
FLUSH_S = 1.0  # how long a heartbeat's moment waits to go to Redis with the others
ROW_REFRESH_S = 30.0  # the most a node's row (last_seen, inventory) lags its agent's heartbeats

_pending: dict[str, float] = {}  # node id -> when it was last heard, not yet in Redis
_flusher: asyncio.Task | None = None
_failing = False


def heard(node_id: str) -> None:
    """Node ``node_id``'s agent was heard now (on the event loop; in Redis within ``FLUSH_S``)."""
    global _flusher
    _pending[node_id] = time.time()
    if _flusher is None or _flusher.done():
        _flusher = asyncio.get_running_loop().create_task(_flush_soon())


def writable() -> bool:
    """Whether the last batch reached Redis (if not, each heartbeat writes its node's row)."""
    return not _failing


async def _flush_soon() -> None:
    global _failing
    await asyncio.sleep(FLUSH_S)
    batch = dict(_pending)
    _pending.clear()
    try:
        await link_writes.write(store, batch=batch)
    except ERRORS as exc:
        if not _failing:
            log.warning("liveness cannot reach Redis (%s): each heartbeat writes its node's row", exc)
        _failing = True
    else:
        _failing = False


def store(*, batch: dict[str, float]) -> None:
    """The moments in ``batch`` into the sorted set (a later moment never goes back)."""
    client().zadd(HEARD_KEY, batch, gt=True)


def heard_at(node_ids: list[str]) -> dict[str, float]:
    """When each of ``node_ids`` was last heard, for those the sorted set holds ({} without Redis)."""
    if not node_ids:
        return {}
    try:
        scores = client().zmscore(HEARD_KEY, node_ids)
    except ERRORS as exc:
        log.warning("liveness cannot read Redis (%s): nodes are judged by their rows", exc)
        return {}
    return {node_id: score for node_id, score in zip(node_ids, scores, strict=True) if score is not None}


def forget(node_id: str) -> None:
    """A removed node leaves the sorted set (it would only take room there)."""
    try:
        client().zrem(HEARD_KEY, node_id)
    except ERRORS as exc:
        log.warning("liveness cannot reach Redis to forget node %s (%s)", node_id, exc)
