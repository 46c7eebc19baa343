"""The OpenAI API's error answers: OpenAI's error shape, and the status each failure answers with.

``{"error": {"message", "type", "param", "code"}}`` with the matching status; a 429 or 503 says
when to ask again (``Retry-After``). Shared by the views (``openai_api``, ``responses_api``) and
the answers, which send the same object as an event when a stream fails mid-way (``openai_answers``).
"""

from __future__ import annotations

from django.http import JsonResponse

from controlplane.accounts.services import QuotaExceeded

from .completions import (
    ClusterBusy,
    ClusterGenerationError,
    ClusterUnavailable,
    RequestTooLarge,
    TooManyGenerations,
)

RETRY_AFTER_S = 5  # what a 503 asks a client to wait: a restarting role is back in seconds


def error(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    param=None,
    code=None,
    retry_after: int | None = None,
) -> JsonResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    response = JsonResponse(body, status=status)
    if status in (429, 503):
        response["Retry-After"] = str(retry_after or (RETRY_AFTER_S if status == 503 else 1))
    return response


def quota_exceeded(exc: QuotaExceeded) -> JsonResponse:
    """429 until UTC midnight; ``x-should-retry: false`` keeps OpenAI's clients from retrying in seconds."""
    response = error(429, str(exc), kind="insufficient_quota", code="quota_exceeded", retry_after=exc.retry_after_s)
    response["x-should-retry"] = "false"
    return response


def failure(exc: ClusterUnavailable | ClusterGenerationError) -> JsonResponse:
    """The answer to a generation the cluster refused or could not finish."""
    if isinstance(exc, TooManyGenerations):
        return error(429, str(exc), kind="rate_limit_error", code="too_many_generations")
    if isinstance(exc, ClusterBusy):
        return error(429, f"the deployment is busy: {exc}", kind="rate_limit_error", code="deployment_busy")
    if isinstance(exc, RequestTooLarge):
        return error(400, str(exc), code="request_too_large")
    if isinstance(exc, ClusterUnavailable):
        return error(503, str(exc), kind="server_error", code="model_not_ready")
    if exc.retryable:
        return error(503, f"the cluster could not finish: {exc}", kind="server_error", code="model_restarting")
    return error(502, f"the cluster could not finish: {exc}", kind="server_error", code="generation_failed")
