"""Celery tasks of the serving app: thin wrappers that call one service."""

from __future__ import annotations

from celery import shared_task

from . import jobs


@shared_task(acks_late=True)
def run_job_output_task(output_id: int) -> None:
    """One prompt of a job; acknowledged only when done, and harmless to run twice."""
    jobs.run_output(output_id=output_id)
