"""Token usage and the daily quota, as pure decisions: who a generation is counted to, which
UTC day it falls on, and whether a key may start one more.

What counts toward a key's quota: prompt tokens plus completion tokens of every generation made
through that key, on every deployment, within one UTC day. The quota is checked when a
request arrives, before any generation starts: a key whose tokens today have reached its quota
is refused until the next UTC midnight. A generation that starts below the quota runs to its
end and all of it counts, so a day's total may pass the quota by what the last requests used
(each at most its prompt and ``max_tokens`` per choice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

USAGE_WINDOW_DAYS = 30  # what the keys page and the console show besides today


@dataclass(frozen=True)
class Caller:
    """Who a generation's tokens are counted to: a user, and the API key they came with (None: a
    browser session, e.g. the chat or the API called from a logged-in page); and whose prefix-cache
    blocks it may reuse: the shared namespace staff granted that key (``ApiKey.prefix_namespace``),
    else ("") the user's own."""

    user_id: int
    api_key_id: int | None = None
    prefix_namespace: str = ""


def utc_day(now: datetime) -> date:
    """The UTC day ``now`` (an aware datetime) falls on: usage is counted and quotas reset by it."""
    return now.astimezone(UTC).date()


def next_reset(now: datetime) -> datetime:
    """The next UTC midnight after ``now``: when a spent daily quota is whole again."""
    return datetime.combine(utc_day(now) + timedelta(days=1), time(0), tzinfo=UTC)


def window_start(now: datetime, days: int = USAGE_WINDOW_DAYS) -> date:
    """The first UTC day of the last ``days`` days, today included."""
    return utc_day(now) - timedelta(days=days - 1)


class QuotaExceeded(Exception):
    """A key's tokens today have reached its daily quota: no new generation until the next UTC midnight."""

    def __init__(self, *, quota: int, used: int, now: datetime) -> None:
        self.quota, self.used = quota, used
        self.resets_at = next_reset(now)
        self.retry_after_s = max(1, math.ceil((self.resets_at - now).total_seconds()))
        super().__init__(
            f"this API key's daily token quota is spent: {used} of {quota} tokens (prompt and completion) "
            f"used today; it resets at {self.resets_at:%Y-%m-%dT%H:%M:%SZ} (UTC midnight), "
            f"in {self.retry_after_s} s"
        )


def quota_refusal(*, quota: int | None, used: int, now: datetime) -> QuotaExceeded | None:
    """Why a key with daily ``quota`` (None: unlimited) that used ``used`` tokens today may not
    start a generation at ``now``; None when it may."""
    if quota is None or used < quota:
        return None
    return QuotaExceeded(quota=quota, used=used, now=now)
