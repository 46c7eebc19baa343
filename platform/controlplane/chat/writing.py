"""Which chat answers are being written now, and by whom: one writer at a time (its lease), a
writer that died replaced, and an answer whose writer died and that no page came back for not left
"being written" forever.

Each answer has one writer (``chat.writer``), which holds its lease (``claim``, renewed every
``TOUCH_S``, lapsing ``LEASE_S`` after its holder stopped): a page that follows an answer whose
lease lapsed claims it and writes the rest in its own process. Each page following an answer says so
(``watch``, lapsing after ``settings.CHAT_RESUME_GRACE_S``): a writer whose answer nobody has watched
that long stops the generation, as a closed page did at once before.

An answer is stored as ``streaming`` when its question arrives, and the web process that streams
it saves what it has every ``TOUCH_S`` (the partial answer survives that process) and notes the
moment in Redis (``KEY``: answer id -> Unix time). A web process that crashes or is killed
mid-answer stops touching it. ``services.settle_interrupted`` (Celery beat, every 15 s:
``CELERY_BEAT_SCHEDULE``) turns each ``streaming`` answer untouched for ``STALE_S`` (``orphans``:
no page came back to take it over) into a failed one that says why, its text so far kept, and the
question before it kept as it was: the conversation reads as it was left and can go on. While Redis
cannot be read nothing is settled (an answer still being written must not be taken for an orphan).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from controlplane.shared_redis import ERRORS, client

from .models import Message, MessageStatus

log = logging.getLogger(__name__)

KEY = "odmoe:chat:writing"
TOUCH_S = 2.0  # how often a writer saves its partial answer and says it is still writing
STALE_S = 30.0  # an answer untouched this long has lost its writer
LEASE_S = 3 * TOUCH_S  # a writer that has not renewed its lease this long is taken for dead
_LEASE = "odmoe:chat:answer:{}:writer"
_WATCHED = "odmoe:chat:answer:{}:watched"
# Compare-and-act on a lease: only its holder renews or releases it.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
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


def claim(answer_id: int, holder: str) -> bool:
    """Whether ``holder`` now writes the answer (False: a writer holds it)."""
    return bool(client().set(_LEASE.format(answer_id), holder, nx=True, px=int(LEASE_S * 1000)))


def renew(answer_id: int, holder: str) -> bool:
    """Whether ``holder`` still writes the answer, its lease renewed (False: it lapsed, another may write)."""
    return bool(client().eval(_RENEW, 1, _LEASE.format(answer_id), holder, int(LEASE_S * 1000)))


def release(answer_id: int, holder: str) -> None:
    """``holder`` writes the answer no more: a follower may take it over at once."""
    client().eval(_RELEASE, 1, _LEASE.format(answer_id), holder)


def watch(answer_id: int) -> None:
    """A page shows the answer now (from each page following it, every ``TOUCH_S``)."""
    client().set(_WATCHED.format(answer_id), 1, px=int(settings.CHAT_RESUME_GRACE_S * 1000))


def watched(answer_id: int) -> bool:
    """Whether a page showed the answer within ``settings.CHAT_RESUME_GRACE_S``."""
    return bool(client().exists(_WATCHED.format(answer_id)))


def orphans() -> list[int]:
    """The answers left ``streaming`` by a writer that stopped: untouched for ``STALE_S``."""
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
    stale = [pk for pk, at in zip(candidates, moments, strict=True) if at is None or at < cutoff]
    if not stale:
        return []
    try:  # a writer that holds its lease is alive, whatever its last touch says
        with client().pipeline() as pipe:
            for pk in stale:
                pipe.exists(_LEASE.format(pk))
            held = pipe.execute()
    except ERRORS as exc:
        log.warning("cannot tell which chat answers have a writer (%s): none settled now", exc)
        return []
    return [pk for pk, leased in zip(stale, held, strict=True) if not leased]
