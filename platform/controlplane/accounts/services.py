"""Writes of the accounts app: issue, check and revoke API keys; count the tokens each spends
and hold a key to its daily quota (``usage.py`` says what counts)."""

from __future__ import annotations

import re
from datetime import datetime

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import F, Q, Sum
from django.utils import timezone

from controlplane.names import NAME_PATTERN, NAME_RULE
from controlplane.nodes.credentials import digest, new_secret

from . import signals
from .models import ApiKey, TokenUsage
from .scopes import ScopeError, allowed_scopes, check_scopes
from .usage import Caller, QuotaExceeded, quota_refusal, utc_day

API_KEY_PREFIX = "odmoe-key-"
MAX_DAILY_TOKEN_QUOTA = 10**15  # far above any day's work; below PositiveBigIntegerField's bound


def create_api_key(
    *,
    user: AbstractBaseUser,
    name: str = "",
    scopes: list[str] | tuple[str, ...] | None = None,
    expires_at: datetime | None = None,
    within: tuple[str, ...] | None = None,
    daily_token_quota: int | None = None,
    prefix_namespace: str = "",
) -> tuple[ApiKey, str]:
    """A new key for ``user`` and its clear value, shown once and never stored.

    ``scopes`` defaults to every scope the user may hold; ScopeError for scopes the user (or
    the key ``within`` whose scopes bound this one) may not give, ValueError for an expiry in the
    past, a quota below 1 (``daily_token_quota``: tokens per UTC day; None: unlimited) or a
    ``prefix_namespace`` that is no name (``ApiKey.prefix_namespace``: only staff grant one, so no
    API a user calls passes it).
    """
    chosen = check_scopes(list(allowed_scopes(user) if scopes is None else scopes), user=user, within=within)
    if expires_at is not None and expires_at <= timezone.now():
        raise ValueError("the expiry must be in the future")
    if daily_token_quota is not None and not 1 <= daily_token_quota <= MAX_DAILY_TOKEN_QUOTA:
        raise ValueError(f"the daily token quota must be from 1 to {MAX_DAILY_TOKEN_QUOTA} (or none: unlimited)")
    if prefix_namespace and not re.fullmatch(NAME_PATTERN, prefix_namespace):
        raise ValueError(f"the prefix namespace must be {NAME_RULE}")
    clear = new_secret(API_KEY_PREFIX)
    key = ApiKey.objects.create(
        user=user,
        name=name,
        key_hash=digest(clear),
        prefix=clear[len(API_KEY_PREFIX) : len(API_KEY_PREFIX) + 6],
        scopes=chosen,
        expires_at=expires_at,
        daily_token_quota=daily_token_quota,
        prefix_namespace=prefix_namespace,
    )
    return key, clear


def revoke_api_key(*, key: ApiKey) -> ApiKey:
    """Stop ``key`` working from now on, and what it queued (``signals.api_key_revoked``); the row
    stays, for the record. Revoking twice is a no-op."""
    if not key.revoked:
        key.revoked, key.revoked_at = True, timezone.now()
        key.save(update_fields=["revoked", "revoked_at"])
        signals.api_key_revoked.send(sender=ApiKey, key_id=key.pk)
    return key


def bearer_key(authorization: str) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header, or None for any other header."""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


def authenticate_api_key(*, key: str) -> ApiKey | None:
    """The live key ``key`` stands for (not revoked, not expired, its user active), or None."""
    now = timezone.now()
    found = (
        ApiKey.objects.select_related("user")
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now), key_hash=digest(key), revoked=False)
        .first()
    )
    if found is None or not found.user.is_active:
        return None
    ApiKey.objects.filter(pk=found.pk).update(last_used=now)
    return found


def record_usage(
    *, caller: Caller, deployment: str, prompt_tokens: int, completion_tokens: int, now: datetime | None = None
) -> None:
    """Add one generation's tokens to its caller's row for ``deployment`` and today (UTC).

    Race-free without a lock: the row grows by an UPDATE with F() expressions (the database adds);
    the day's first generation creates it, and when another creates it at the same moment the
    unique constraint refuses the second INSERT, which then adds to the row that won.
    """
    if prompt_tokens < 0 or completion_tokens < 0:
        raise ValueError(f"token counts cannot be negative: {prompt_tokens} prompt, {completion_tokens} completion")
    row = {
        "user_id": caller.user_id,
        "api_key_id": caller.api_key_id,
        "deployment": deployment,
        "day": utc_day(now or timezone.now()),
    }
    added = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "generations": 1}
    grow = {name: F(name) + value for name, value in added.items()}
    with transaction.atomic():
        if TokenUsage.objects.filter(**row).update(**grow):
            return
        try:
            with transaction.atomic():  # a savepoint: PostgreSQL's transaction survives the refused INSERT
                TokenUsage.objects.create(**row, **added)
                return
        except IntegrityError:
            pass
        if not TokenUsage.objects.filter(**row).update(**grow):
            raise RuntimeError(f"the usage row {row} was neither created nor found")


def tokens_today(*, key: ApiKey, now: datetime | None = None) -> int:
    """Prompt and completion tokens ``key`` used today (UTC), on every deployment."""
    totals = TokenUsage.objects.filter(api_key=key, day=utc_day(now or timezone.now())).aggregate(
        prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens")
    )
    return (totals["prompt"] or 0) + (totals["completion"] or 0)


def check_quota(*, key: ApiKey | None, now: datetime | None = None) -> None:
    """Raise QuotaExceeded when ``key`` may not start a generation now; a session (no key) or a key
    without a quota always may."""
    if key is None or key.daily_token_quota is None:
        return
    now = now or timezone.now()
    refusal = quota_refusal(quota=key.daily_token_quota, used=tokens_today(key=key, now=now), now=now)
    if refusal is not None:
        raise refusal


__all__ = [
    "API_KEY_PREFIX",
    "QuotaExceeded",
    "ScopeError",
    "authenticate_api_key",
    "bearer_key",
    "check_quota",
    "create_api_key",
    "record_usage",
    "revoke_api_key",
    "tokens_today",
]
