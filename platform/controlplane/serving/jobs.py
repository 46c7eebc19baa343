"""Writes of jobs: submit, run one output (from a Celery task), cancel, delete.

Each output is its own Celery task, acknowledged late and idempotent: a worker that stops
mid-job leaves the remaining outputs queued in Redis, and a task that runs twice finds its
output already done (or re-runs it from scratch: outputs are written only when finished).
Redis coming back without its data loses those tasks; the database still has every output,
and ``requeue_unfinished`` (run by Celery beat when that happens) queues them again.

A job runs with its submitter's rights: each prompt, before it starts, checks that the API key
it came with is still live and its owner still active (``stop_reason``), else the job is
cancelled with the reason. Revoking a key or deactivating a user cancels their jobs at once
(``stop_jobs``, from the serving app's signal receivers); the check before each prompt also
catches what sends no signal (a key's expiry, a bulk update).

What a user's jobs store is bounded: an output keeps a summary of its metrics (``results``), and
a job whose prompts would take its owner's stored job output past
``MAX_STORED_JOB_BYTES_PER_USER`` is refused (``JobStorageFull``) until ended jobs are deleted.
"""

from __future__ import annotations

import contextlib
import logging
import uuid

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone
from redis.exceptions import RedisError

from controlplane.accounts.models import ApiKey
from controlplane.accounts.selectors import caller_of
from controlplane.accounts.services import QuotaExceeded, check_quota
from controlplane.database_away import waited_for_the_database
from controlplane.deployments import generation
from controlplane.queueing import queue_task
from controlplane.storable import storable_json, storable_text

from . import metrics
from .bounds import JOB_PROMPTS, PROMPT_CHARS, check_max_tokens
from .completions import (
    ClusterGenerationError,
    ClusterUnavailable,
    CompletionResult,
    build_request,
    complete,
    find_target,
)
from .models import ENDED, Job, JobOutput, JobStatus, OutputStatus
from .results import metrics_summary, stored_bytes
from .selectors import stored_job_bytes
from .text import InputError, Sampling, check_lengths, check_prompt, check_text_fits, encode_prompt

log = logging.getLogger(__name__)

RUN_JOB_OUTPUT_TASK = "controlplane.serving.tasks.run_job_output_task"  # one prompt of a job (queueing.py)


class TooManyActivePrompts(Exception):
    """The user's queued and running jobs already hold as many prompts as one user may have waiting."""

    def __init__(self, active: int, adding: int, limit: int) -> None:
        super().__init__(
            f"your jobs already have {active} prompts queued or running and this one adds {adding}: at most "
            f"{limit} at once per user; submit it when some have finished, or cancel a job"
        )


def active_prompts(owner: AbstractBaseUser) -> int:
    """Prompts of ``owner``'s jobs that are queued or running, in jobs that have not ended."""
    unfinished = JobOutput.objects.filter(job__owner=owner, status__in=(OutputStatus.QUEUED, OutputStatus.RUNNING))
    return unfinished.exclude(job__status__in=ENDED).count()


def _check_active_prompts(owner: AbstractBaseUser, adding: int) -> None:
    limit = settings.MAX_ACTIVE_JOB_PROMPTS_PER_USER
    active = active_prompts(owner)
    if active + adding > limit:
        raise TooManyActivePrompts(active, adding, limit)


class JobStorageFull(Exception):
    """The user's jobs already store so much that this job's prompts would take them past their quota."""

    def __init__(self, stored: int, adding: int, quota: int) -> None:
        super().__init__(
            f"your jobs store {_mib(stored)} of prompts, answers and metrics, and this job's prompts add "
            f"{_mib(adding)}: at most {_mib(quota)} per user; delete ended jobs you no longer need "
            "(DELETE /api/jobs/<id>; cancel a running one first) to make room"
        )
        self.stored, self.adding, self.quota = stored, adding, quota


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _check_storage(owner: AbstractBaseUser, adding: int) -> None:
    quota = settings.MAX_STORED_JOB_BYTES_PER_USER
    stored = stored_job_bytes(owner=owner)
    if stored + adding > quota:
        raise JobStorageFull(stored, adding, quota)


def submit_job(
    *,
    owner: AbstractBaseUser,
    model: str,
    prompts: list[str],
    max_tokens: int,
    sampling: Sampling,
    api_key: ApiKey | None = None,
) -> Job:
    """Check every prompt against the model now (clear errors, nothing stored), then queue them.

    ``api_key``: the key it comes with, whose daily token quota must not be spent
    (``QuotaExceeded``; each prompt is held to it again as it starts), and to which its tokens count.

    A user's jobs hold at most ``MAX_ACTIVE_JOB_PROMPTS_PER_USER`` prompts that are queued or
    running (``TooManyActivePrompts``): jobs run from one queue in the order they came, so one
    user's thousands of prompts would hold everyone else's behind them. What they store stays
    within ``MAX_STORED_JOB_BYTES_PER_USER`` with this job's prompts (``JobStorageFull``); the
    answers of jobs already taken are always kept, so it can be passed by those.
    """
    if not prompts:
        raise InputError("a job takes at least one prompt", param="prompts")
    JOB_PROMPTS.check(len(prompts), "prompts")
    for i, prompt in enumerate(prompts):
        PROMPT_CHARS.check(len(prompt), f"prompts[{i}]")
    check_max_tokens(max_tokens)
    check_quota(key=api_key)
    sizes = [stored_bytes(prompt=p) for p in prompts]
    # Before tokenizing them: cheap, and said at once.
    _check_active_prompts(owner, len(prompts))
    _check_storage(owner, sum(sizes))
    target = find_target(model)
    lengths = []
    for i, prompt in enumerate(prompts):
        try:
            check_prompt(prompt)
            check_text_fits(target.tokenizer, [prompt], max_tokens, target.context, param="prompt")
            ids = encode_prompt(target.tokenizer, prompt)
            check_lengths(len(ids), max_tokens, target.context)
        except InputError as exc:
            raise InputError(f"prompts[{i}]: {exc}", param=f"prompts[{i}]", code=exc.code) from None
        lengths.append(len(ids))
    with transaction.atomic():
        # Counted again under a lock on the owner: two submits at once cannot both pass the cap.
        get_user_model().objects.select_for_update().get(pk=owner.pk)
        _check_active_prompts(owner, len(prompts))
        _check_storage(owner, sum(sizes))
        job = Job.objects.create(
            owner=owner,
            api_key=api_key,
            deployment_id=target.deployment_id,
            model_name=target.name,
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
        )
        outputs = JobOutput.objects.bulk_create(
            JobOutput(job=job, index=i, prompt=p, prompt_tokens=n, stored_bytes=size)
            for i, (p, n, size) in enumerate(zip(prompts, lengths, sizes, strict=True))
        )
        ids = [o.pk for o in outputs]
        transaction.on_commit(lambda: [queue_task(RUN_JOB_OUTPUT_TASK, pk) for pk in ids])
    return job


JOB_RETRIES = 5  # a prompt whose cluster is restarting a role is tried again this many times...
RETRY_AFTER_S = 5.0  # ...after 5, 10, 20, 40 and 80 s


class RetryLater(Exception):
    """The cluster could not serve the prompt now but can shortly; the task runs it again after ``after_s``."""

    def __init__(self, after_s: float) -> None:
        super().__init__(f"retry in {after_s:.0f} s")
        self.after_s = after_s


def run_output(*, output_id: int, attempt: int = 0) -> None:
    """Generate one output of a job (what the Celery task does); a finished one is left as it is.

    A cluster that is restarting a role (a retryable failure, or a deployment not serving for
    now) gets the prompt again later: ``RetryLater``, up to ``JOB_RETRIES`` times; nothing is lost.
    A prompt that starts after its key's daily token quota is spent fails, saying when it resets.
    Its writes after the generation wait out a PostgreSQL restart (``waited_for_the_database``); the
    database away before it started is the task's to try again.
    """
    with transaction.atomic():
        # The job's lock first, then the output's: the order cancel_job takes them in. Locking both
        # at once took the output's first, and a cancel at that moment deadlocked on PostgreSQL.
        locked_jobs = Job.objects.select_for_update(of=("self",)).select_related("owner", "api_key")
        job = locked_jobs.filter(outputs__pk=output_id).first()
        output = JobOutput.objects.select_for_update().filter(pk=output_id).first()
        if job is None or output is None or output.status in (OutputStatus.DONE, OutputStatus.CANCELLED):
            return
        if job.status in ENDED:
            return
        reason = stop_reason(job)
        if reason:
            running = _cancel_locked(job, reason)
        else:
            output.status, output.request_id = OutputStatus.RUNNING, uuid.uuid4().hex
            output.save(update_fields=["status", "request_id"])
            Job.objects.filter(pk=job.pk, status=JobStatus.QUEUED).update(
                status=JobStatus.RUNNING, started_at=timezone.now()
            )
    if reason:
        _cancel_on_cluster(job.deployment_id, running)
        return
    sampling = Sampling(job.temperature, job.top_p, job.seed)
    try:
        check_quota(key=job.api_key)
        target = find_target(job.model_name)
        ids = encode_prompt(target.tokenizer, output.prompt)
        caller = caller_of(job.owner_id, job.api_key)
        request = build_request(ids, job.max_tokens, sampling, output.request_id, caller)
        result = complete(target, request, caller=caller)
    except (ClusterUnavailable, ClusterGenerationError, RedisError, OSError) as exc:
        # Redis unreachable (it restarts) is retryable too: the generation's events travel through it.
        retryable = not isinstance(exc, ClusterGenerationError) or exc.retryable
        if retryable and attempt < JOB_RETRIES:
            waited_for_the_database(_queue_again, output.pk, f"will try again: {exc}")
            raise RetryLater(RETRY_AFTER_S * 2**attempt) from None
        metrics.record("jobs", ok=False)
        waited_for_the_database(_fail, output.pk, str(exc))
    except (InputError, LookupError, QuotaExceeded) as exc:
        metrics.record("jobs", ok=False)
        waited_for_the_database(_fail, output.pk, str(exc))
    else:
        metrics.record("jobs", ok=True, prompt_tokens=result.prompt_tokens, metrics=result.metrics)
        # PostgreSQL restarting now would lose the answer the cluster just gave: its write waits.
        waited_for_the_database(record_result, output_id=output.pk, result=result)
    waited_for_the_database(_finish_if_done, job.pk)


def _queue_again(output_id: int, why: str) -> None:
    JobOutput.objects.filter(pk=output_id, status=OutputStatus.RUNNING).update(
        status=OutputStatus.QUEUED, error=storable_text(why)
    )


def _fail(output_id: int, error: str) -> None:
    JobOutput.objects.filter(pk=output_id).exclude(status=OutputStatus.CANCELLED).update(
        status=OutputStatus.FAILED, error=storable_text(error), finished_at=timezone.now()
    )


def record_result(*, output_id: int, result: CompletionResult) -> None:
    """What the cluster returned for an output: its generated text, and the bounded summary of its
    metrics (``results``), made storable. A cancelled one keeps the error its cancel wrote (why)."""
    prompt = JobOutput.objects.filter(pk=output_id).values_list("prompt", flat=True).first()
    if prompt is None:
        return  # its job was deleted (cancelled, then deleted while this prompt ran)
    cancelled = result.finish_reason == "cancelled"
    why = {} if cancelled else {"error": ""}
    text, summary = storable_text(result.text), storable_json(metrics_summary(result.metrics))
    JobOutput.objects.filter(pk=output_id).update(
        status=OutputStatus.CANCELLED if cancelled else OutputStatus.DONE,
        text=text,
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        metrics=summary,
        stored_bytes=stored_bytes(prompt=prompt, text=text, token_ids=result.token_ids, metrics=summary),
        finished_at=timezone.now(),
        **why,
    )


def stop_reason(job: Job) -> str:
    """Why ``job``'s prompts may run no more, or "" while they may: they run with the rights of the
    key they were submitted with (none: a browser session) and of its owner."""
    if not job.owner.is_active:
        return "cancelled: the account that submitted this job was deactivated"
    key = job.api_key
    if key is not None and key.state != "active":
        done = "was revoked" if key.revoked else "has expired"
        return f"cancelled: the API key this job was submitted with ({key.prefix}…) {done}"
    return ""


def cancel_job(*, job: Job, reason: str = "") -> Job:
    """Cancel what has not run; a running output stops on the cluster after its current step.
    ``reason``: why, written to each output it cancels (empty: the user asked)."""
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.status in ENDED:
            return locked
        running = _cancel_locked(locked, reason)
    _cancel_on_cluster(locked.deployment_id, running)
    return locked


class JobNotEnded(Exception):
    """A job that is queued or running cannot be deleted: its prompts still write to it."""

    def __init__(self, job: Job) -> None:
        super().__init__(
            f"job {job.pk} is {job.status}: cancel it first (POST /api/jobs/{job.pk}/cancel), then delete it"
        )


def delete_job(*, job: Job) -> None:
    """Delete an ended job and its outputs, freeing what they took of its owner's job storage
    (``JobNotEnded`` while it runs). A prompt of a cancelled job still running on the cluster ends
    there and its result is dropped."""
    with transaction.atomic():
        locked = Job.objects.select_for_update().filter(pk=job.pk).first()
        if locked is None:
            return
        if locked.status not in ENDED:
            raise JobNotEnded(locked)
        locked.delete()


def stop_jobs(*, owner_id: int | None = None, api_key_id: int | None = None) -> int:
    """Cancel every job not ended, of ``owner_id`` or submitted with ``api_key_id``, that may run no
    more (``stop_reason``, read now), with that reason; returns how many. What runs on a cluster
    Redis cannot reach now is left to end: the check before each prompt stops the rest."""
    unended = Job.objects.exclude(status__in=ENDED).select_related("owner", "api_key")
    if owner_id is not None:
        unended = unended.filter(owner_id=owner_id)
    if api_key_id is not None:
        unended = unended.filter(api_key_id=api_key_id)
    stopped = 0
    for job in unended:
        reason = stop_reason(job)
        if not reason:
            continue
        try:
            cancel_job(job=job, reason=reason)
        except (RedisError, OSError) as exc:
            log.warning("job %s cancelled, but its running prompts could not be stopped now: %s", job.pk, exc)
        stopped += 1
    return stopped


def _cancel_locked(job: Job, reason: str) -> list[str]:
    """Cancel ``job`` (its row locked by the caller); returns its running outputs' request ids."""
    outputs = job.outputs.all()
    outputs.filter(status=OutputStatus.QUEUED).update(status=OutputStatus.CANCELLED, error=reason)
    running = outputs.filter(status=OutputStatus.RUNNING)
    ids = list(running.values_list("request_id", flat=True))
    running.update(error=reason)  # kept when their result comes back cancelled
    job.status, job.finished_at = JobStatus.CANCELLED, timezone.now()
    job.save(update_fields=["status", "finished_at"])
    return ids


def _cancel_on_cluster(deployment_id: int | None, request_ids: list[str]) -> None:
    for request_id in request_ids:
        if deployment_id is not None and request_id:
            with contextlib.suppress(ClusterUnavailable):  # the deployment is gone: nothing runs there
                generation.cancel(deployment_id, request_id)


def requeue_unfinished() -> int:
    """Queue again every output of a running job that is not finished: after Redis came back empty
    (restarted without its data), their tasks are gone. One that still runs somewhere runs twice, harmlessly."""
    unfinished = JobOutput.objects.filter(status__in=(OutputStatus.QUEUED, OutputStatus.RUNNING)).exclude(
        job__status__in=ENDED
    )
    ids = list(unfinished.values_list("pk", flat=True))
    for pk in ids:
        queue_task(RUN_JOB_OUTPUT_TASK, pk)
    return len(ids)


def _finish_if_done(job_id: uuid.UUID) -> None:
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        if job is None or job.status in ENDED:  # None: deleted once cancelled
            return
        states = set(job.outputs.values_list("status", flat=True))
        if states & {OutputStatus.QUEUED, OutputStatus.RUNNING}:
            return
        job.status = JobStatus.FAILED if OutputStatus.FAILED in states else JobStatus.SUCCEEDED
        job.finished_at = timezone.now()
        job.save(update_fields=["status", "finished_at"])
