"""Celery tasks of the chat app."""

from __future__ import annotations

from celery import shared_task

from . import services


@shared_task
def settle_interrupted_answers_task() -> list[int]:
    """Periodic (Celery beat): answers whose writing web process stopped are failed, saying why."""
    return services.settle_interrupted()
