"""Writes of the artifacts app: register a checkpoint, build its role shards with progress."""

from __future__ import annotations

import time
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction

from inference.checkpoint import Checkpoint, CheckpointError
from inference.sharding import ShardError, build_shards

from .models import ModelArtifact, ShardStatus

PROGRESS_EVERY_S = 0.5  # how often a shard build writes its progress to the database


class ModelError(ValueError):
    """A checkpoint could not be registered or sharded; the message says why."""


def register_model(*, name: str, path: str) -> ModelArtifact:
    """Register the Mixtral checkpoint at ``path`` (a directory on this host)."""
    try:
        checkpoint = Checkpoint(Path(path))
        config = checkpoint.config
        summary = {
            "layers": checkpoint.n_layers,
            "experts": checkpoint.n_experts,
            "top_k": checkpoint.top_k,
            "hidden_size": checkpoint.hidden_size,
            "intermediate_size": config.get("intermediate_size"),
            "vocab_size": config.get("vocab_size"),
            "max_position_embeddings": config.get("max_position_embeddings"),
            "files": len(checkpoint.files()),
        }
        total = sum(checkpoint.nbytes(key) for key in checkpoint)
    except CheckpointError as exc:
        raise ModelError(str(exc)) from None
    try:
        with transaction.atomic():
            return ModelArtifact.objects.create(
                name=name, path=str(checkpoint.path.resolve()), summary=summary, total_bytes=total
            )
    except IntegrityError:
        raise ModelError(f"a model named {name!r} is already registered") from None


def request_shard_build(*, artifact: ModelArtifact, workers: int) -> ModelArtifact:
    """Queue a shard build for ``workers`` workers; it starts once this transaction commits."""
    from .tasks import build_model_shards_task

    if workers < 1:
        raise ModelError(f"at least one worker is needed, got {workers}")
    with transaction.atomic():
        locked = ModelArtifact.objects.select_for_update().get(pk=artifact.pk)
        if locked.shard_status == ShardStatus.BUILDING:
            raise ModelError(f"shards of {locked.name} are already being built; wait for that build to end")
        locked.shard_status = ShardStatus.BUILDING
        locked.shard_workers = workers
        locked.shard_done_bytes = locked.shard_total_bytes = 0
        locked.shard_error = ""
        locked.save()
        transaction.on_commit(lambda: build_model_shards_task.delay(locked.pk, workers))
    return locked


def shard_dir_for(artifact: ModelArtifact, workers: int) -> Path:
    return Path(settings.VAR_DIR) / "shards" / str(artifact.pk) / f"workers-{workers}"


def build_model_shards(*, artifact_id: int, workers: int) -> ModelArtifact:
    """Build the role shards for ``workers`` workers, saving progress as it goes.

    Slow (it reads and hashes the whole model): run it from a background task. A failure
    is recorded on the artifact with its reason, and raised.
    """
    if workers < 1:
        raise ModelError(f"at least one worker is needed, got {workers}")
    artifact = ModelArtifact.objects.get(pk=artifact_id)
    out = shard_dir_for(artifact, workers)
    ModelArtifact.objects.filter(pk=artifact.pk).update(
        shard_status=ShardStatus.BUILDING,
        shard_workers=workers,
        shard_dir=str(out),
        shard_done_bytes=0,
        shard_total_bytes=0,
        shard_error="",
    )
    last_write = 0.0

    def progress(done: int, total: int) -> None:
        nonlocal last_write
        now = time.monotonic()
        if now - last_write >= PROGRESS_EVERY_S or done >= total:
            ModelArtifact.objects.filter(pk=artifact.pk).update(shard_done_bytes=done, shard_total_bytes=total)
            last_write = now

    try:
        build_shards(artifact.path, out, workers=workers, progress=progress)
    except (CheckpointError, ShardError, OSError, ValueError) as exc:
        ModelArtifact.objects.filter(pk=artifact.pk).update(shard_status=ShardStatus.FAILED, shard_error=str(exc))
        raise ModelError(f"building shards of {artifact.name} failed: {exc}") from None
    ModelArtifact.objects.filter(pk=artifact.pk).update(shard_status=ShardStatus.READY)
    artifact.refresh_from_db()
    return artifact
