"""API keys: random 256-bit values kept only as their SHA-256, with a prefix to tell them apart,
each with scopes (``scopes.py``), an optional expiry, and revocation that keeps the row."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from .scopes import USER_SCOPES


def default_scopes() -> list[str]:
    return list(USER_SCOPES)


class ApiKey(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16)
    key_hash = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=default_scopes, help_text="what the key may do (accounts/scopes.py)")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="empty: the key does not expire")
    last_used = models.DateTimeField(null=True, blank=True)
    revoked = models.BooleanField(default=False)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.user} {self.prefix}…"

    @property
    def expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()

    @property
    def state(self) -> str:
        """``active``, ``expired`` or ``revoked``."""
        if self.revoked:
            return "revoked"
        return "expired" if self.expired else "active"

    def allows(self, scope: str) -> bool:
        return scope in self.scopes
