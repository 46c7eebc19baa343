"""Celery tasks of the artifacts app: thin wrappers that call one service."""

from __future__ import annotations

import logging

from celery import shared_task

from . import services

log = logging.getLogger(__name__)


@shared_task(acks_late=True)
def build_model_shards_task(artifact_id: int, workers: int, expert_codec: str = "none") -> None:
    """Build the role shards; idempotent (a rerun reuses or rebuilds the same folder).

    ``expert_codec`` defaults for a task queued before the build took one."""
    try:
        services.build_model_shards(artifact_id=artifact_id, workers=workers, expert_codec=expert_codec)
    except services.ModelError as exc:
        # Recorded on the model by the service; retrying would fail the same way.
        log.warning("%s", exc)


@shared_task(acks_late=True)
def download_model_task(artifact_id: int) -> None:
    """Download a Hub repo and register it; idempotent (a rerun resumes the same folder)."""
    try:
        services.download_model(artifact_id=artifact_id)
    except services.ModelError as exc:
        # Recorded on the model by the service; a retry is the admin's call (register it again).
        log.warning("%s", exc)
