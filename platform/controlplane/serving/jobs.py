"""Writes of jobs: submit, run one output (from a Celery task), cancel.

Each output is its own Celery task, acknowledged late and idempotent: a worker that stops
mid-job leaves the remaining outputs queued in Redis, and a task that runs twice finds its
output already done (or re-runs it from scratch: outputs are written only when finished).
Redis coming back without its data loses those tasks; the database still has every output,
and ``requeue_unfinished`` (run by Celery beat when that happens) queues them again.
"""

from __future__ import annotations

import contextlib
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
from controlplane.deployments import generation
from controlplane.queueing import queue_task
from controlplane.storable import storable_json, storable_text

from . import metrics
from .bounds import JOB_PROMPTS, PROMPT_CHARS, check_max_tokens
from .completions import ClusterGenerationError, ClusterUnavailable, CompletionResult, complete, find_target
from .models import ENDED, Job, JobOutput, JobStatus, OutputStatus
from .text import InputError, Sampling, check_lengths, check_prompt, check_text_fits, encode_prompt

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
    user's thousands of prompts would hold everyone else's behind them.
    """
    if not prompts:
        raise InputError("a job takes at least one prompt", param="prompts")
    JOB_PROMPTS.check(len(prompts), "prompts")
    for i, prompt in enumerate(prompts):
        PROMPT_CHARS.check(len(prompt), f"prompts[{i}]")
    check_max_tokens(max_tokens)
    check_quota(key=api_key)
    _check_active_prompts(owner, len(prompts))  # before tokenizing them: cheap, and said at once
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
            JobOutput(job=job, index=i, prompt=p, prompt_tokens=n)
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
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
    """
    with transaction.atomic():
        # The job's lock first, then the output's: the order cancel_job takes them in. Locking both
        # at once took the output's first, and a cancel at that moment deadlocked on PostgreSQL.
        job = Job.objects.select_for_update(of=("self",)).filter(outputs__pk=output_id).first()
        output = JobOutput.objects.select_for_update().filter(pk=output_id).first()
        if job is None or output is None or output.status in (OutputStatus.DONE, OutputStatus.CANCELLED):
            return
        if job.status in ENDED:
            return
        output.status, output.request_id = OutputStatus.RUNNING, uuid.uuid4().hex
        output.save(update_fields=["status", "request_id"])
        Job.objects.filter(pk=job.pk, status=JobStatus.QUEUED).update(
            status=JobStatus.RUNNING, started_at=timezone.now()
        )
    sampling = Sampling(job.temperature, job.top_p, job.seed)
    try:
        check_quota(key=job.api_key)
        target = find_target(job.model_name)
        ids = encode_prompt(target.tokenizer, output.prompt)
        caller = caller_of(job.owner_id, job.api_key)
        result = complete(target, ids, job.max_tokens, sampling, caller=caller, request_id=output.request_id)
    except (ClusterUnavailable, ClusterGenerationError, RedisError, OSError) as exc:
        # Redis unreachable (it restarts) is retryable too: the generation's events travel through it.
        retryable = not isinstance(exc, ClusterGenerationError) or exc.retryable
        if retryable and attempt < JOB_RETRIES:
            JobOutput.objects.filter(pk=output.pk, status=OutputStatus.RUNNING).update(
                status=OutputStatus.QUEUED, error=storable_text(f"will try again: {exc}")
            )
            raise RetryLater(RETRY_AFTER_S * 2**attempt) from None
        metrics.record("jobs", ok=False)
        JobOutput.objects.filter(pk=output.pk).exclude(status=OutputStatus.CANCELLED).update(
            status=OutputStatus.FAILED, error=storable_text(str(exc)), finished_at=timezone.now()
        )
    except (InputError, LookupError, QuotaExceeded) as exc:
        metrics.record("jobs", ok=False)
        JobOutput.objects.filter(pk=output.pk).exclude(status=OutputStatus.CANCELLED).update(
            status=OutputStatus.FAILED, error=storable_text(str(exc)), finished_at=timezone.now()
        )
    else:
        metrics.record("jobs", ok=True, prompt_tokens=result.prompt_tokens, metrics=result.metrics)
        record_result(output_id=output.pk, result=result)
    _finish_if_done(job.pk)


def record_result(*, output_id: int, result: CompletionResult) -> None:
    """What the cluster returned for an output: its generated text and metrics made storable."""
    status = OutputStatus.CANCELLED if result.finish_reason == "cancelled" else OutputStatus.DONE
    JobOutput.objects.filter(pk=output_id).update(
        status=status,
        text=storable_text(result.text),
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        metrics=storable_json(result.metrics),
        error="",
        finished_at=timezone.now(),
    )


def cancel_job(*, job: Job) -> Job:
    """Cancel what has not run; a running output stops on the cluster after its current step."""
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.status in ENDED:
            return locked
        locked.outputs.filter(status=OutputStatus.QUEUED).update(status=OutputStatus.CANCELLED)
        running = list(locked.outputs.filter(status=OutputStatus.RUNNING).values_list("request_id", flat=True))
        locked.status, locked.finished_at = JobStatus.CANCELLED, timezone.now()
        locked.save(update_fields=["status", "finished_at"])
        deployment_id = locked.deployment_id
    for request_id in running:
        if deployment_id is not None and request_id:
            with contextlib.suppress(ClusterUnavailable):  # the deployment is gone: nothing runs there
                generation.cancel(deployment_id, request_id)
    return locked


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
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.status in ENDED:
            return
        states = set(job.outputs.values_list("status", flat=True))
        if states & {OutputStatus.QUEUED, OutputStatus.RUNNING}:
            return
        job.status = JobStatus.FAILED if OutputStatus.FAILED in states else JobStatus.SUCCEEDED
        job.finished_at = timezone.now()
        job.save(update_fields=["status", "finished_at"])
