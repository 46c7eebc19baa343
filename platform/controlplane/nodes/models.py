"""Join tokens (how a box is allowed to join) and nodes (the boxes that joined).

Secrets are never stored: a join token and a node credential are random 256-bit values
kept as their SHA-256 digest, so a leaked database does not let anyone enroll or act as a
node. A short prefix of each join token is kept to tell tokens apart in lists.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone


class JoinToken(models.Model):
    name = models.CharField(max_length=100, blank=True)
    token_hash = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=16)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    max_uses = models.PositiveIntegerField(default=1)
    uses = models.PositiveIntegerField(default=0)
    revoked = models.BooleanField(default=False)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name or 'join token'} ({self.prefix}…)"

    def unusable_reason(self, now=None) -> str:
        """Why this token cannot enroll a node now, or "" if it can."""
        now = now or timezone.now()
        if self.revoked:
            return "the join token was revoked"
        if self.expires_at <= now:
            return "the join token has expired; create a new one in the console"
        if self.uses >= self.max_uses:
            return "the join token was already used; create a new one in the console"
        return ""


# Declarations, one per line: choices alike TaskState's below and other apps' by shape, on purpose.
class NodeStatus(models.TextChoices):
    ENROLLED = "enrolled", "enrolled (agent not connected yet)"
    ONLINE = "online", "online"
    OFFLINE = "offline", "offline"
    DRAINING = "draining", "draining"


class Node(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, unique=True)
    status = models.CharField(max_length=16, choices=NodeStatus.choices, default=NodeStatus.ENROLLED)
    secret_hash = models.CharField(max_length=64)
    # A rotation sent to the agent and not yet confirmed: both credentials work until it is.
    pending_secret_hash = models.CharField(max_length=64, blank=True, default="")
    credential_rotated_at = models.DateTimeField(null=True, blank=True)
    inventory = models.JSONField(default=dict, blank=True)
    address = models.CharField(max_length=255, blank=True, help_text="the address peers should use")
    enrolled_at = models.DateTimeField(auto_now_add=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    connected_at = models.DateTimeField(null=True, blank=True, help_text="when its agent's link last came up")
    join_token = models.ForeignKey(JoinToken, null=True, blank=True, on_delete=models.SET_NULL, related_name="nodes")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def rotation_pending(self) -> bool:
        return bool(self.pending_secret_hash)


class TaskState(models.TextChoices):
    SENT = "sent", "sent to the agent"
    RUNNING = "running", "running"
    DONE = "done", "done"
    FAILED = "failed", "failed"


class NodeTask(models.Model):
    """Work the control plane asked a node's agent to do (today: fetch a shard), and how it went."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="tasks")
    kind = models.CharField(max_length=32)
    params = models.JSONField(default=dict)
    state = models.CharField(max_length=16, choices=TaskState.choices, default=TaskState.SENT)
    done = models.BigIntegerField(default=0)
    total = models.BigIntegerField(default=0)
    detail = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
