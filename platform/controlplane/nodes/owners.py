"""Which node was given which generation, kept in Redis: a generation outlives its agent link.

Main's agent keeps a generation's events until the control plane acknowledges them and sends them
again when its link comes back up (``agent.outbox``), to whichever web process the new link lands
on. That process's consumer did not send the ``Generate`` down it, so it asks here: a node may speak
for a generation only if it was given it (``given``, written before the ``Generate`` goes down its
link). The record goes when the generation's end is relayed (``ended``), and expires after
``OWNER_TTL_S`` in any case, so a crash between the two leaves nothing for long.

While Redis cannot be reached, nothing is recorded (a warning says so): the generation is relayed
as long as its link stays up, and cannot be resumed on another link; the channel layer lives in the
same Redis, so nothing could be relayed across processes then anyway.
"""

from __future__ import annotations

import logging

from controlplane.shared_redis import ERRORS, client

log = logging.getLogger(__name__)

OWNER_TTL_S = 24 * 3600  # longer than any generation: its most tokens at a slow box's rate
_KEY = "odmoe:generation:{}:node"


def given(request_id: str, node_id: str, deployment: str) -> None:
    """``request_id``'s ``Generate`` (for ``deployment``'s runtime key) goes down ``node_id``'s link:
    that node speaks for it."""
    try:
        client().set(_KEY.format(request_id), f"{node_id}\n{deployment}", ex=OWNER_TTL_S)
    except ERRORS as exc:
        log.warning("generation %s: which node runs it could not be recorded (%s)", request_id, exc)


class Unreachable(RuntimeError):
    """Redis could not be read: whether a node was given a generation is not known now."""


def owner(request_id: str) -> tuple[str, str] | None:
    """(node id, deployment) of the node given ``request_id`` and not finished with it (None: none);
    ``Unreachable`` when Redis cannot say."""
    try:
        record = client().get(_KEY.format(request_id))
    except ERRORS as exc:
        raise Unreachable(f"generation {request_id}: which node runs it could not be read ({exc})") from None
    if record is None:
        return None
    node_id, _, deployment = record.decode().partition("\n")
    return node_id, deployment


def ended(request_id: str) -> None:
    """``request_id``'s end was relayed: no node speaks for it any more."""
    try:
        client().delete(_KEY.format(request_id))
    except ERRORS as exc:
        log.warning("generation %s: its end could not be recorded (%s)", request_id, exc)
