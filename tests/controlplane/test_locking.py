"""Row locks taken in one order: services that lock the same rows never deadlock on PostgreSQL.

SQLite runs one writing transaction at a time (``BEGIN IMMEDIATE``), so an order in which two
services take their locks never mattered there; PostgreSQL locks rows, and two transactions
that take the same two locks in opposite orders deadlock (one of them fails after a second).
"""

from __future__ import annotations

import threading
import time

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, connections, transaction

from controlplane.serving.jobs import cancel_job, run_output
from controlplane.serving.models import Job, JobOutput, JobStatus, OutputStatus


def wait_until_another_transaction_waits_for_a_lock(timeout_s: float = 10) -> None:
    """On PostgreSQL, until some other session waits for a row lock; SQLite has no row locks to wait on."""
    if connection.vendor != "postgresql":
        time.sleep(0.5)
        return
    deadline = time.monotonic() + timeout_s
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted AND pid <> pg_backend_pid()")
            if cursor.fetchone()[0]:
                return
            time.sleep(0.02)
    raise AssertionError("the output's run never waited for the job's lock")


@pytest.mark.django_db(transaction=True)
def test_an_output_that_starts_while_its_job_is_cancelled_neither_deadlocks_nor_runs() -> None:
    owner = get_user_model().objects.create_user("alice")
    job = Job.objects.create(owner=owner, model_name="gone", max_tokens=4)
    output = JobOutput.objects.create(job=job, index=0, prompt="hello")
    failures: list[BaseException] = []

    def start_output() -> None:  # what the Celery task does, on a thread (and connection) of its own
        try:
            run_output(output_id=output.pk)
        except BaseException as exc:
            failures.append(exc)
        finally:
            connections.close_all()

    runner = threading.Thread(target=start_output)
    try:
        # The administrator's cancel holds the job's lock (cancel_job locks the job, then its outputs)
        # while the output's task starts and waits for it.
        with transaction.atomic():
            Job.objects.select_for_update().get(pk=job.pk)
            runner.start()
            wait_until_another_transaction_waits_for_a_lock()
            cancel_job(job=job)
    except BaseException as exc:
        failures.append(exc)
    runner.join(timeout=30)
    assert not runner.is_alive() and not failures, failures
    output.refresh_from_db()
    assert (Job.objects.get(pk=job.pk).status, output.status) == (JobStatus.CANCELLED, OutputStatus.CANCELLED)
