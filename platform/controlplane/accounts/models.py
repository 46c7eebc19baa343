"""API keys: random 256-bit values kept only as their SHA-256, with a prefix to tell them apart,
each with scopes (``scopes.py``), an optional expiry, an optional daily token quota, an optional
shared prefix-cache namespace that only staff grant, and revocation that keeps the row; and the
tokens each user and key spent, per deployment and day (``usage.py`` says what counts)."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from controlplane.names import NAME_PATTERN, NAME_RULE

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
    daily_token_quota = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="prompt and completion tokens the key may use per UTC day; empty: unlimited",
    )
    # Granted by staff only (the admin, create_api_key): no API or page a key's user sees sets it.
    prefix_namespace = models.CharField(
        max_length=100,
        blank=True,
        default="",
        validators=[RegexValidator(NAME_PATTERN, f"use {NAME_RULE}")],
        help_text=(
            "a prefix-cache namespace shared with every key that names the same one, for a common "
            "system prompt: each can tell from cached_tokens what the others' prompts began with; "
            "empty: the key's user's own"
        ),
    )

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


class TokenUsage(models.Model):
    """The tokens one user spent on one deployment on one UTC day, through one API key (or none: a
    browser session). One row per (user, key, deployment, day), grown in place by
    ``services.record_usage``; the deployment is kept by name, so its usage outlives it."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="token_usage")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE, related_name="usage")
    deployment = models.CharField(max_length=100, help_text="the deployment's name")
    day = models.DateField(help_text="UTC")
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    generations = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["-day", "deployment"]
        # NULLs are distinct in a unique index (PostgreSQL 15's NULLS NOT DISTINCT is not SQLite's):
        # rows with a key and rows without one are held unique by one partial index each.
        constraints = [
            models.UniqueConstraint(
                fields=["user", "api_key", "deployment", "day"],
                condition=models.Q(api_key__isnull=False),
                name="one_usage_row_per_key_deployment_day",
            ),
            models.UniqueConstraint(
                fields=["user", "deployment", "day"],
                condition=models.Q(api_key__isnull=True),
                name="one_usage_row_per_session_deployment_day",
            ),
        ]
        indexes = [models.Index(fields=["day"], name="token_usage_day")]

    def __str__(self) -> str:
        return f"{self.user_id} {self.api_key_id} {self.deployment} {self.day}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
