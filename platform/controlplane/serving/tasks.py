"""Celery tasks of the serving app: thin wrappers that call one service."""

from __future__ import annotations

from celery import shared_task

from . import jobs


@shared_task(bind=True, acks_late=True, max_retries=jobs.JOB_RETRIES)
def run_job_output_task(self, output_id: int) -> None:
    """One prompt of a job; acknowledged only when done, harmless to run twice, and run again
    later when the cluster is restarting a role."""
    try:
        jobs.run_output(output_id=output_id, attempt=self.request.retries)
    except jobs.RetryLater as later:
        raise self.retry(countdown=later.after_s) from None
