"""Which chat answers are being written now, so that one whose writer died is not left "being
written" forever.

An answer is stored as ``streaming`` when its question arrives, and the web process that streams
it saves what it has every ``TOUCH_S`` (the partial answer survives that process) and notes the
moment in Redis (``KEY``: answer id -> Unix time). A web process that crashes or is killed
mid-answer stops touching it. ``settle_interrupted`` (Celery beat, every 15 s:
``CELERY_BEAT_SCHEDULE``) turns each ``streaming`` answer untouched for ``STALE_S`` into a failed
one that says why, its partial
text kept, and the question before it kept as it was: the conversation reads as it was left and
can go on. While Redis cannot be read nothing is settled (an answer still being written must not
be taken for an orphan).
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import timedelta

from django.utils import timezone

from controlplane.shared_redis import ERRORS, client

from .models import Message, MessageStatus

log = logging.getLogger(__name__)

KEY = "odmoe:chat:writing"
TOUCH_S = 2.0  # how often a writer saves its partial answer and says it is still writing
STALE_S = 30.0  # an answer untouched this long has lost its writer
INTERRUPTED = "the server process writing this answer stopped before it was done; ask again to get a whole answer"


def touch(answer_id: int) -> None:
    """The answer is being written now (from its writer, every ``TOUCH_S``)."""
    try:
        client().zadd(KEY, {str(answer_id): time.time()})
    except ERRORS as exc:  # nothing is settled while Redis is away, so nothing is lost either
        log.warning("cannot note chat answer %s as being written (%s)", answer_id, exc)


def done(answer_id: int) -> None:
    """The answer ended (complete, stopped or failed): no longer being written."""
    try:
        client().zrem(KEY, str(answer_id))
    except ERRORS as exc:
        log.warning("cannot note chat answer %s as written (%s)", answer_id, exc)


def settle_interrupted() -> list[int]:
    """Every answer left ``streaming`` by a writer that stopped, failed with ``INTERRUPTED``; their ids."""
    cutoff = time.time() - STALE_S
    candidates = list(
        Message.objects.filter(
            status=MessageStatus.STREAMING, created_at__lt=timezone.now() - timedelta(seconds=STALE_S)
        ).values_list("pk", flat=True)
    )
    if not candidates:
        return []
    try:
        moments = client().zmscore(KEY, [str(pk) for pk in candidates])
    except ERRORS as exc:
        log.warning("cannot tell which chat answers are still being written (%s): none settled now", exc)
        return []
    orphans = [pk for pk, at in zip(candidates, moments, strict=True) if at is None or at < cutoff]
    Message.objects.filter(pk__in=orphans, status=MessageStatus.STREAMING).update(
        status=MessageStatus.FAILED, error=INTERRUPTED
    )
    if orphans:
        log.warning("chat answers whose writer stopped, now failed: %s", ", ".join(map(str, orphans)))
        with contextlib.suppress(*ERRORS):  # they are no longer streaming: a stale entry is never read again
            client().zrem(KEY, *[str(pk) for pk in orphans])
    return orphans
