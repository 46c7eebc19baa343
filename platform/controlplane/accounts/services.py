"""Writes of the accounts app: issue, check and revoke API keys."""

from __future__ import annotations

from datetime import datetime

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Q
from django.utils import timezone

from controlplane.nodes.credentials import digest, new_secret

from .models import ApiKey
from .scopes import ScopeError, allowed_scopes, check_scopes

API_KEY_PREFIX = "odmoe-key-"


def create_api_key(
    *,
    user: AbstractBaseUser,
    name: str = "",
    scopes: list[str] | tuple[str, ...] | None = None,
    expires_at: datetime | None = None,
    within: tuple[str, ...] | None = None,
) -> tuple[ApiKey, str]:
    """A new key for ``user`` and its clear value, shown once and never stored.

    ``scopes`` defaults to every scope the user may hold; ScopeError for scopes the user (or
    the key ``within`` whose scopes bound this one) may not give, ValueError for an expiry in the past.
    """
    chosen = check_scopes(list(allowed_scopes(user) if scopes is None else scopes), user=user, within=within)
    if expires_at is not None and expires_at <= timezone.now():
        raise ValueError("the expiry must be in the future")
    clear = new_secret(API_KEY_PREFIX)
    key = ApiKey.objects.create(
        user=user,
        name=name,
        key_hash=digest(clear),
        prefix=clear[len(API_KEY_PREFIX) : len(API_KEY_PREFIX) + 6],
        scopes=chosen,
        expires_at=expires_at,
    )
    return key, clear


def revoke_api_key(*, key: ApiKey) -> ApiKey:
    """Stop ``key`` working from now on; the row stays, for the record. Revoking twice is a no-op."""
    if not key.revoked:
        key.revoked, key.revoked_at = True, timezone.now()
        key.save(update_fields=["revoked", "revoked_at"])
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


__all__ = ["API_KEY_PREFIX", "ScopeError", "authenticate_api_key", "bearer_key", "create_api_key", "revoke_api_key"]
