"""The pauses answers were carried across, kept so the console shows them and Prometheus times them.

An answer pauses and goes on, whole, when:

- main's process exits mid-answer and its agent carries the answer to the restarted main
  (``agent.migration``; the answer's metrics: ``main_restarts``);
- main's agent link closes and the agent sends the rest on its next link (``generation.astream``;
  ``link``);
- the web process writing a chat answer stops and another takes it over (``chat.writer``).

One row per pause (``AnswerPause``): its cause, the tokens the answer had, how long the caller
waited, how it went on. What main's agent reports is a peer's word: only well-formed figures are
kept, at most ``MAX_PER_ANSWER`` a cause. Rows older than ``KEEP_DAYS`` go as new ones come.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import timedelta

from channels.db import database_sync_to_async
from django.db import DatabaseError
from django.utils import timezone

from controlplane.serving import metrics as served

from .models import AnswerPause, Deployment, PauseCause

log = logging.getLogger(__name__)

KEEP_DAYS = 30
MAX_PER_ANSWER = 16  # a deployment carries an answer across at most MAX_MIGRATIONS_LIMIT restarts
RECENT = 20  # the console's list
MAX_PAUSE_MS = 24 * 3600 * 1000.0


@dataclass(frozen=True)
class Pause:
    cause: str
    at_token: int | None
    paused_ms: float | None
    detail: str = ""


def of_answer(metrics: dict) -> list[Pause]:
    """The pauses a finished answer's metrics tell of (none when they tell of none, or nothing readable)."""
    found: list[Pause] = []
    restarts = metrics.get("main_restarts")
    if isinstance(restarts, dict):
        replay = restarts.get("replay")
        detail = f"replay: {replay}" if replay in ("prefill", "exact") else ""
        found += _paired(PauseCause.MAIN_RESTART, restarts.get("resumed_at"), restarts.get("paused_ms"), detail)
    link = metrics.get("link")
    if isinstance(link, dict):
        resent = _count(link.get("resent_tokens"))
        detail = f"{resent} token(s) sent again" if resent else ""
        found += _paired(PauseCause.MAIN_LINK, link.get("paused_at"), link.get("paused_ms"), detail)
    return found


def _paired(cause: str, at_tokens: object, paused_ms: object, detail: str) -> list[Pause]:
    at_tokens = at_tokens if isinstance(at_tokens, list) else []
    paused_ms = paused_ms if isinstance(paused_ms, list) else []
    count = min(max(len(at_tokens), len(paused_ms)), MAX_PER_ANSWER)
    return [Pause(cause, _count(_item(at_tokens, i)), _milliseconds(_item(paused_ms, i)), detail) for i in range(count)]


def _item(values: list, index: int) -> object:
    return values[index] if index < len(values) else None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else None


def _milliseconds(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value) if 0 <= value <= MAX_PAUSE_MS else None


def record(deployment_id: int | None, request_id: str, pauses: list[Pause]) -> None:
    """Keep ``pauses`` of one answer (and time them for Prometheus); older rows go."""
    if not pauses:
        return
    name = Deployment.objects.filter(pk=deployment_id).values_list("name", flat=True).first() or ""
    AnswerPause.objects.bulk_create(
        AnswerPause(
            deployment_id=deployment_id if name else None,
            deployment_name=name,
            request_id=request_id[:64],
            cause=p.cause,
            at_token=p.at_token,
            paused_ms=p.paused_ms,
            detail=p.detail[:100],
        )
        for p in pauses
    )
    for p in pauses:
        if p.paused_ms is not None:
            served.PAUSES.labels(p.cause).observe(p.paused_ms / 1000)
    AnswerPause.objects.filter(created_at__lt=timezone.now() - timedelta(days=KEEP_DAYS)).delete()


async def note(deployment_id: int, request_id: str, metrics: dict) -> None:
    """Keep the pauses a finished answer's metrics tell of (a database write only when there are some).
    The answer is whole whatever becomes of its record: a database error is logged, not raised."""
    await keep(deployment_id, request_id, of_answer(metrics))


async def keep(deployment_id: int, request_id: str, pauses: list[Pause]) -> None:
    if not pauses:
        return
    try:
        await database_sync_to_async(record, thread_sensitive=False)(deployment_id, request_id, pauses)
    except DatabaseError:
        log.exception("the pauses of %s could not be kept", request_id)


def recent() -> list[dict]:
    """The latest pauses, newest first, for the console."""
    return [
        {
            "at": p.created_at.isoformat(),
            "deployment": p.deployment_name,
            "request_id": p.request_id,
            "cause": p.cause,
            "cause_label": PauseCause(p.cause).label,
            "at_token": p.at_token,
            "paused_ms": p.paused_ms,
            "detail": p.detail,
        }
        for p in AnswerPause.objects.all()[:RECENT]
    ]
