"""Reads of the accounts app: who a generation is for, the tokens spent per key, per user and
deployment, and per series for Prometheus (``usage.py`` says what counts)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Max, Q, Sum
from django.utils import timezone

from .models import ApiKey, TokenUsage
from .usage import USAGE_WINDOW_DAYS, Caller, utc_day, window_start


def caller_of(user_id: int, key: ApiKey | None) -> Caller:
    """Who a generation is for: ``user_id``, through ``key`` (None: a browser session), with the
    prefix-cache namespace staff granted that key."""
    return Caller(user_id, key.pk if key else None, key.prefix_namespace if key else "")


# Dataclass fields, declarations one per line: alike tools/train_demo.py's Shape by shape only.
@dataclass(frozen=True)
class Spent:
    """Tokens spent today (UTC) and over the last ``USAGE_WINDOW_DAYS`` days, today included."""

    prompt_today: int = 0
    completion_today: int = 0
    prompt_window: int = 0
    completion_window: int = 0

    @property
    def today(self) -> int:
        return self.prompt_today + self.completion_today

    @property
    def window(self) -> int:
        return self.prompt_window + self.completion_window


def _spent_by(rows, *group: str, now: datetime) -> dict[tuple, Spent]:
    today = utc_day(now)
    sums = (
        rows.filter(day__gte=window_start(now))
        .values(*group)
        .annotate(
            prompt_today=Sum("prompt_tokens", filter=Q(day=today), default=0),
            completion_today=Sum("completion_tokens", filter=Q(day=today), default=0),
            prompt_window=Sum("prompt_tokens", default=0),
            completion_window=Sum("completion_tokens", default=0),
        )
        .order_by(*group)
    )
    return {
        tuple(s[g] for g in group): Spent(
            s["prompt_today"], s["completion_today"], s["prompt_window"], s["completion_window"]
        )
        for s in sums
    }


def key_usage(*, keys: Iterable[ApiKey], now: datetime | None = None) -> dict[int, Spent]:
    """Each of ``keys`` (by id) with what it spent today and in the window; a key that spent nothing is left out."""
    ids = [k.pk for k in keys]
    spent = _spent_by(TokenUsage.objects.filter(api_key_id__in=ids), "api_key_id", now=now or timezone.now())
    return {key_id: s for (key_id,), s in spent.items()}


@dataclass(frozen=True)
class UserDeploymentUsage:
    username: str
    deployment: str
    spent: Spent


def usage_by_user_and_deployment(*, now: datetime | None = None) -> list[UserDeploymentUsage]:
    """What each user spent on each deployment in the window (keys and sessions together), most first."""
    spent = _spent_by(TokenUsage.objects.all(), "user__username", "deployment", now=now or timezone.now())
    rows = [UserDeploymentUsage(user, deployment, s) for (user, deployment), s in spent.items()]
    return sorted(rows, key=lambda r: (-r.spent.window, r.username, r.deployment))


@dataclass(frozen=True)
class UsageSeries:
    """All the tokens one (user, key, deployment) ever spent: one Prometheus series per kind."""

    username: str
    key_id: int | None
    key_prefix: str
    deployment: str
    prompt_tokens: int
    completion_tokens: int
    generations: int


def usage_series(*, now: datetime | None = None, active_days: int = USAGE_WINDOW_DAYS) -> list[UsageSeries]:
    """Every (user, key, deployment) that spent tokens in the last ``active_days`` days, with its
    totals since its first day: totals only grow, as Prometheus counters must; one idle longer than
    that drops out (its series ends), which bounds the series by the keys in use, not by all ever made."""
    since = window_start(now or timezone.now(), active_days)
    totals = (
        TokenUsage.objects.values("user__username", "api_key_id", "api_key__prefix", "deployment")
        .annotate(
            last=Max("day"),
            prompt=Sum("prompt_tokens"),
            completion=Sum("completion_tokens"),
            generations=Sum("generations"),
        )
        .filter(last__gte=since)
        .order_by("user__username", "api_key_id", "deployment")
    )
    return [
        UsageSeries(
            t["user__username"],
            t["api_key_id"],
            t["api_key__prefix"] or "",
            t["deployment"],
            t["prompt"],
            t["completion"],
            t["generations"],
        )
        for t in totals
    ]
