"""Reads of jobs: the jobs a user may see with their outputs counted, a job's outputs, what a user's jobs store."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Count, Q, QuerySet, Sum

from .models import Job, JobOutput, OutputStatus

# The count of a job's outputs in each state, read with the job (``job.outputs_<state>``).
OUTPUT_COUNTS = {f"outputs_{s.value}": Count("outputs", filter=Q(outputs__status=s.value)) for s in OutputStatus}


def visible_jobs(*, user: AbstractBaseUser) -> QuerySet[Job]:
    """The jobs ``user`` may see (their own; staff: everyone's), each with its outputs counted by
    state and the bytes they store (``stored_bytes``)."""
    jobs = Job.objects.select_related("owner")
    if not user.is_staff:
        jobs = jobs.filter(owner=user)
    # One annotate: every aggregate over the same join of the outputs, so none counts a row twice.
    return jobs.annotate(
        **OUTPUT_COUNTS, prompts=Count("outputs"), stored_bytes=Sum("outputs__stored_bytes", default=0)
    )


def job_outputs(*, job: Job) -> QuerySet[JobOutput]:
    return job.outputs.order_by("index")


def stored_job_bytes(*, owner: AbstractBaseUser) -> int:
    """What ``owner``'s jobs store (``JobOutput.stored_bytes``), for their quota."""
    return JobOutput.objects.filter(job__owner=owner).aggregate(total=Sum("stored_bytes", default=0))["total"]
