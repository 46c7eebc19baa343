"""A registered model checkpoint and the state of its role shards."""

from __future__ import annotations

from django.db import models


class ShardStatus(models.TextChoices):
    NONE = "none", "no shards yet"
    BUILDING = "building", "building"
    READY = "ready", "ready"
    FAILED = "failed", "failed"


class ModelArtifact(models.Model):
    name = models.CharField(max_length=100, unique=True)
    path = models.CharField(max_length=1024, help_text="the checkpoint directory on the control plane's host")
    summary = models.JSONField(default=dict, help_text="layers, experts, top-k, sizes, read from config.json")
    total_bytes = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    shard_status = models.CharField(max_length=16, choices=ShardStatus.choices, default=ShardStatus.NONE)
    shard_workers = models.PositiveIntegerField(null=True, blank=True)
    shard_dir = models.CharField(max_length=1024, blank=True)
    shard_done_bytes = models.BigIntegerField(default=0)
    shard_total_bytes = models.BigIntegerField(default=0)
    shard_error = models.TextField(blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def shard_progress(self) -> float:
        return self.shard_done_bytes / self.shard_total_bytes if self.shard_total_bytes else 0.0
