"""Celery tasks of the serving app: thin wrappers that call one service."""

from __future__ import annotations

import logging

import redis
from celery import shared_task
from django.conf import settings

from controlplane.database_away import AWAY

from . import jobs

log = logging.getLogger(__name__)

# Set in Redis by the first check after Redis starts: missing, Redis lost what it held (queued tasks too).
BROKER_MARK = "odmoe:broker-mark"


@shared_task(bind=True, acks_late=True, max_retries=jobs.JOB_RETRIES)
def run_job_output_task(self, output_id: int) -> None:
    """One prompt of a job; acknowledged only when done, harmless to run twice, and run again
    later when the cluster is restarting a role, or the database is away past its writes' wait (a
    task that raised is acknowledged all the same, and its prompt would never end)."""
    try:
        jobs.run_output(output_id=output_id, attempt=self.request.retries)
    except jobs.RetryLater as later:
        raise self.retry(countdown=later.after_s) from None
    except AWAY as exc:
        log.warning("job output %s: the database is away (%s); it runs again", output_id, exc)
        raise self.retry(countdown=jobs.RETRY_AFTER_S * 2**self.request.retries) from None


@shared_task
def recover_lost_jobs_task() -> int:
    """Periodic (Celery beat): when Redis came back empty, queue every unfinished job output again."""
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    try:
        if not client.set(BROKER_MARK, "1", nx=True):
            return 0  # the mark is still there: so is every task queued before
    finally:
        client.close()
    count = jobs.requeue_unfinished()
    if count:
        log.warning("Redis came back without its data: %d job outputs queued again", count)
    return count
