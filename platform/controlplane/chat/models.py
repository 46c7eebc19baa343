"""Conversations in the chat UI, kept per user, with every answer's figures."""

from __future__ import annotations

from django.conf import settings
from django.db import models

TITLE_CHARS = 60


class Conversation(models.Model):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="conversations")
    title = models.CharField(max_length=TITLE_CHARS + 1)
    # Declarations, one per line: alike deployments/models.py's Deployment by shape, on purpose.
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-updated_at"]

    def __str__(self) -> str:
        return self.title


# Declarations, one per line: choices alike artifacts', nodes' and serving's models, on purpose.
class MessageStatus(models.TextChoices):
    COMPLETE = "complete", "complete"
    STREAMING = "streaming", "being written"
    STOPPED = "stopped", "stopped by the user"
    FAILED = "failed", "failed"


class Message(models.Model):
    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="messages")
    role = models.CharField(max_length=16, choices=[("user", "user"), ("assistant", "assistant")])
    content = models.TextField(blank=True)
    status = models.CharField(max_length=16, choices=MessageStatus.choices, default=MessageStatus.COMPLETE)
    model_name = models.CharField(max_length=100, blank=True)
    metrics = models.JSONField(default=dict, blank=True, help_text="TTFT, tok/s, recall of an answer")
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"{self.role}: {self.content[:40]}"
