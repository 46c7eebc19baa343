"""Celery tasks of the deployments app: thin wrappers that call one service."""

from __future__ import annotations

from celery import shared_task

from . import lifecycle


@shared_task(acks_late=True)
def push_deployment_task(deployment_id: int, epoch: int) -> None:
    """Build shards if needed and send each node its role; a rerun (or a stale epoch) is harmless."""
    lifecycle.push_deployment(deployment_id=deployment_id, epoch=epoch)
