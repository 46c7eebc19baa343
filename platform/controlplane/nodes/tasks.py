"""Celery tasks of the nodes app."""

from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings

from . import services

log = logging.getLogger(__name__)


@shared_task
def expire_silent_nodes_task() -> list[str]:
    """Periodic (Celery beat): nodes whose agent fell silent turn offline."""
    names = services.expire_silent_nodes(timeout_s=settings.NODE_HEARTBEAT_TIMEOUT_S)
    if names:
        log.warning("no heartbeat for %ss: %s now offline", settings.NODE_HEARTBEAT_TIMEOUT_S, ", ".join(names))
    return names
