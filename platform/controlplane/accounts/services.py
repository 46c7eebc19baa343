"""Writes of the accounts app: issue and check API keys."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.utils import timezone

from controlplane.nodes.credentials import digest, new_secret

from .models import ApiKey

API_KEY_PREFIX = "odmoe-key-"


def create_api_key(*, user: AbstractBaseUser, name: str = "") -> tuple[ApiKey, str]:
    """A new key for ``user`` and its clear value, shown once and never stored."""
    clear = new_secret(API_KEY_PREFIX)
    key = ApiKey.objects.create(
        user=user, name=name, key_hash=digest(clear), prefix=clear[len(API_KEY_PREFIX) : len(API_KEY_PREFIX) + 6]
    )
    return key, clear


def bearer_key(authorization: str) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header, or None for any other header."""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


def authenticate_api_key(*, key: str) -> ApiKey | None:
    """The live key ``key`` stands for (its user active), or None."""
    found = ApiKey.objects.select_related("user").filter(key_hash=digest(key), revoked=False).first()
    if found is None or not found.user.is_active:
        return None
    ApiKey.objects.filter(pk=found.pk).update(last_used=timezone.now())
    return found
