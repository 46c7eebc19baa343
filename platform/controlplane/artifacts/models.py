"""A registered model checkpoint (a directory, or a Hub repo downloaded first) and the state of its role shards."""

from __future__ import annotations

from django.db import models

from inference.constants import EXPERT_CODECS


# Declarations, one per line: choices and fields alike nodes', chat's and deployments' models
# by shape, on purpose.
class ShardStatus(models.TextChoices):
    NONE = "none", "no shards yet"
    BUILDING = "building", "building"
    READY = "ready", "ready"
    FAILED = "failed", "failed"


class ModelStatus(models.TextChoices):
    DOWNLOADING = "downloading", "downloading from the Hugging Face Hub"
    READY = "ready", "registered"
    FAILED = "failed", "failed to download or register"


class ModelArtifact(models.Model):
    name = models.CharField(max_length=100, unique=True)
    path = models.CharField(max_length=1024, help_text="the checkpoint directory on the control plane's host")
    status = models.CharField(max_length=16, choices=ModelStatus.choices, default=ModelStatus.READY)
    repo_id = models.CharField(max_length=200, blank=True, help_text="the Hugging Face Hub repo it was downloaded from")
    revision = models.CharField(max_length=255, blank=True, help_text="the Hub revision asked for (default: main)")
    download_done_bytes = models.BigIntegerField(default=0)
    download_total_bytes = models.BigIntegerField(default=0)
    error = models.TextField(blank=True, help_text="why the download or the registration failed")
    summary = models.JSONField(default=dict, help_text="layers, experts, top-k, sizes, read from config.json")
    total_bytes = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    shard_status = models.CharField(max_length=16, choices=ShardStatus.choices, default=ShardStatus.NONE)
    shard_workers = models.PositiveIntegerField(null=True, blank=True)
    shard_shadow_dtypes = models.JSONField(
        default=list, blank=True, help_text="shadow dtypes whose shard the set holds pre-converted (shadow-<dtype>)"
    )
    shard_expert_codec = models.CharField(
        max_length=16,
        choices=[(c, c) for c in EXPERT_CODECS],
        default="none",
        help_text="how the set's worker shards store the experts; each codec's set has its own folder",
    )
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

    @property
    def download_progress(self) -> float:
        return self.download_done_bytes / self.download_total_bytes if self.download_total_bytes else 0.0
