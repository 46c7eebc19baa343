"""Jobs (batches of prompts run by Celery on a deployment, every output and a summary of its metrics
stored) and the Responses API's stored answers (``previous_response_id``)."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


class JobStatus(models.TextChoices):
    QUEUED = "queued", "queued"
    RUNNING = "running", "running"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed (see its outputs)"
    CANCELLED = "cancelled", "cancelled"


ENDED = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class Job(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    api_key = models.ForeignKey(
        "accounts.ApiKey",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="jobs",
        help_text="the key it was submitted with (empty: a browser session): its tokens count to that key",
    )
    deployment = models.ForeignKey("deployments.Deployment", null=True, on_delete=models.SET_NULL, related_name="jobs")
    model_name = models.CharField(max_length=100, help_text="the deployment's name when the job was submitted")
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.QUEUED)
    max_tokens = models.PositiveIntegerField()
    temperature = models.FloatField(default=1.0)
    top_p = models.FloatField(default=1.0)
    seed = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"job {self.pk} ({self.status})"


# Declarations, one per line: choices alike JobStatus's above and other apps' by shape, on purpose.
class OutputStatus(models.TextChoices):
    QUEUED = "queued", "queued"
    RUNNING = "running", "running"
    DONE = "done", "done"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"


class JobOutput(models.Model):
    """One prompt of a job and what the cluster answered."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="outputs")
    index = models.PositiveIntegerField()
    prompt = models.TextField()
    prompt_tokens = models.PositiveIntegerField(default=0)
    status = models.CharField(max_length=16, choices=OutputStatus.choices, default=OutputStatus.QUEUED)
    request_id = models.CharField(max_length=64, blank=True, help_text="the cluster generation running it")
    text = models.TextField(blank=True)
    token_ids = models.JSONField(default=list, blank=True)
    finish_reason = models.CharField(max_length=16, blank=True)
    metrics = models.JSONField(default=dict, blank=True, help_text="the runtime's summary figures, without per step")
    error = models.TextField(blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    stored_bytes = models.PositiveBigIntegerField(
        default=0, help_text="what its prompt, text, token ids and metrics take: counted to its owner's job storage"
    )

    class Meta:
        ordering = ["job", "index"]
        constraints = [models.UniqueConstraint(fields=["job", "index"], name="one_output_per_index")]

    def __str__(self) -> str:
        return f"output {self.index} of {self.job_id}"


RESPONSE_ID_CHARS = 64  # "resp_" and 32 hex digits, with room


class StoredResponse(models.Model):
    """A Responses API answer kept for ``previous_response_id``: its conversation so far (the input
    items and the answer's output items; not its instructions, which OpenAI does not carry over
    either), for its owner only, at most ``responses_store.MAX_PER_USER`` of them, until it expires."""

    response_id = models.CharField(max_length=RESPONSE_ID_CHARS, primary_key=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="stored_responses")
    items = models.JSONField(help_text="the conversation's input and output items, in order")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()

    class Meta:
        ordering = ["owner", "created_at"]
        indexes = [models.Index(fields=["owner", "created_at"], name="stored_response_by_owner")]

    def __str__(self) -> str:
        return f"{self.response_id} of user {self.owner_id}"
