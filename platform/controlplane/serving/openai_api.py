"""The OpenAI-compatible API under ``/v1``: models, chat completions and completions.

Requests and answers follow OpenAI's shapes, so the official ``openai`` client works
unchanged: ``Authorization: Bearer KEY`` (keys from ``manage.py create_api_key``), a model is
a deployment by name, ``stream: true`` answers with server-sent events ending in
``data: [DONE]``, errors come as ``{"error": {"message", "type", "param", "code"}}`` with
the matching status. Temperature 0 is greedy; ``stop`` sequences end the answer (and the
generation on the cluster) as soon as one appears. A client that disconnects mid-stream
stops the generation too. ``n`` choices per prompt, and for ``/v1/completions`` a list of
prompts, run at once in the deployment's batch, each choice a generation of its own (with a
seed, choice ``j`` samples with ``seed + j``). A user's generations past main's batch wait in
its queue, in fair turns with other users', up to the deployment's ``max_per_user`` running
and waiting at once: past it a request is a 429 ``too_many_generations`` (and one that asks for
more choices than that is a 400), while a deployment whose batch and queue are full answers 429
``deployment_busy``, both with ``Retry-After``. Calls count against the REST API's throttles.

Every body parameter is honoured or refused with a 400 that names it (``parameters``: one
declaration per endpoint, which the docs' table is rendered from). Logprobs come in OpenAI's
shapes (``logprobs``), streamed with the text they belong to; ``echo`` on ``/v1/completions``
puts the prompt first (with ``max_tokens: 0``, the prompt alone: main generates one token for
it, as vLLM does, and the answer leaves it out). A ``/v1/completions`` prompt may be token ids
(a list of ints, or a list of such lists), as evaluation harnesses send them: each id is checked
against the model's vocabulary and main gets the ids as they are, never decoded and encoded
again (which need not give the same ids back); its text (for ``echo``) is their decoding.

The API in modules by job, as vLLM's OpenAI server is: this one holds the views and who may call
them (an API key with the ``inference`` scope, or a browser session with its CSRF token, counted
against the REST API's throttles); ``openai_protocol`` reads and checks a request into an ``Ask``,
``openai_answers`` runs its choices and writes the answer whole or as server-sent events, and
``openai_errors`` holds OpenAI's error shape.
"""

from __future__ import annotations

import dataclasses
import json
import math

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.contrib.auth.models import AnonymousUser
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.authentication import SessionAuthentication
from rest_framework.exceptions import AuthenticationFailed, PermissionDenied

from controlplane.accounts.authentication import ApiKeyAuthentication
from controlplane.accounts.scopes import Scope
from controlplane.accounts.selectors import caller_of
from controlplane.accounts.services import QuotaExceeded, check_quota
from controlplane.accounts.usage import Caller
from controlplane.deployments.models import Deployment, DeploymentStatus
from controlplane.throttles import throttle_wait

from .completions import (
    ClusterGenerationError,
    ClusterUnavailable,
    ModelNotFound,
)
from .openai_answers import Answer, event_stream
from .openai_errors import error, failure, quota_exceeded
from .openai_protocol import Ask, parse_ask
from .text import (
    InputError,
)


class _Refused(Exception):
    def __init__(self, response: JsonResponse) -> None:
        self.response = response


async def _user(request: HttpRequest):
    """(The caller, their API key or None): an API key's user (the key holding the ``inference``
    scope), or a logged-in browser session with a valid CSRF token (DRF's SessionAuthentication
    checks it: another site's page must not spend a logged-in user's generations); raises _Refused
    with the 401, 403 or 429 to answer otherwise. Every call counts against the REST API's throttles (the same rates),
    refused ones too: a caller without a valid key counts by its address, as an anonymous one, so
    guessing keys is throttled like any other anonymous call."""
    user, auth, refusal = await _identify(request)
    wait = await sync_to_async(throttle_wait, thread_sensitive=False)(request, user, auth)
    if wait is not None:
        seconds = max(1, math.ceil(wait))
        message = f"too many requests: this caller's API calls are past their rate; try again in {seconds} s"
        raise _Refused(error(429, message, kind="rate_limit_error", code="rate_limit_exceeded", retry_after=seconds))
    if refusal is not None:
        raise _Refused(refusal)
    return user, auth


async def _identify(request: HttpRequest) -> tuple[object, object, JsonResponse | None]:
    """(who calls, their API key or None, the refusal to answer or None), by the REST API's own
    authentication classes (``DEFAULT_AUTHENTICATION_CLASSES``): an API key, else a logged-in
    session held to its CSRF token. On the plain request: DRF's ``Request`` would parse the body to
    look for a form's CSRF token."""
    try:
        found = await database_sync_to_async(ApiKeyAuthentication().authenticate)(request)
    except AuthenticationFailed:
        return AnonymousUser(), None, _unauthenticated()
    if found is not None:
        user, key = found
        if not key.allows(Scope.INFERENCE):
            message = f"this API key lacks the '{Scope.INFERENCE}' scope (it has: {', '.join(key.scopes)})"
            return user, key, error(403, message, kind="permission_error", code="insufficient_scope")
        return user, key, None
    user = await request.auser()
    if not user.is_authenticated:
        return user, None, _unauthenticated()
    try:
        SessionAuthentication().enforce_csrf(request)
    except PermissionDenied as exc:
        return user, None, error(403, str(exc.detail), kind="permission_error", code="csrf_failed")
    return user, None, None


def _unauthenticated() -> JsonResponse:
    response = error(
        401,
        "invalid or missing API key (Authorization: Bearer KEY)",
        kind="authentication_error",
        code="invalid_api_key",
    )
    response["WWW-Authenticate"] = "Bearer"
    return response


# The views are CSRF-exempt for Django's middleware, which would refuse API-key callers (no cookie,
# no token); ``_user`` holds session callers to the token, as DRF does.
@csrf_exempt
async def models(request: HttpRequest) -> HttpResponse:
    refused = await _refused_get(request)
    if refused is not None:
        return refused

    def listing() -> list[dict]:
        ready = Deployment.objects.filter(status=DeploymentStatus.READY).order_by("name")
        return [_model_object(d) for d in ready]

    return JsonResponse({"object": "list", "data": await database_sync_to_async(listing)()})


async def model(request: HttpRequest, name: str) -> HttpResponse:
    """``GET /v1/models/{model}``: one of the models ``/v1/models`` lists, or a 404 naming it."""
    refused = await _refused_get(request)
    if refused is not None:
        return refused

    def found() -> dict | None:
        deployment = Deployment.objects.filter(status=DeploymentStatus.READY, name=name).first()
        return None if deployment is None else _model_object(deployment)

    answer = await database_sync_to_async(found)()
    if answer is None:
        return error(404, f"no ready deployment is named {name!r:.100}", param="model", code="model_not_found")
    return JsonResponse(answer)


async def _refused_get(request: HttpRequest) -> HttpResponse | None:
    """The answer to a read that is not a GET or has no valid key; None to go on."""
    if request.method != "GET":
        return error(405, "use GET", code="method_not_allowed")
    try:
        await _user(request)
    except _Refused as refused:
        return refused.response
    return None


def _model_object(deployment: Deployment) -> dict:
    """A ready deployment as OpenAI's model object."""
    created = int(deployment.created_at.timestamp())
    return {"id": deployment.name, "object": "model", "created": created, "owned_by": "odmoe"}


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _serve(request, chat=True)


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    return await _serve(request, chat=False)


async def read_request(request: HttpRequest) -> tuple[Caller, dict] | HttpResponse:
    """A POST's caller (its key checked, its quota not spent) and its JSON object body, or the
    error answer (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``)."""
    if request.method != "POST":
        return error(405, "use POST", code="method_not_allowed")
    try:
        user, key = await _user(request)
        await database_sync_to_async(check_quota, thread_sensitive=False)(key=key)
    except _Refused as refused:
        return refused.response
    except QuotaExceeded as exc:
        return quota_exceeded(exc)
    try:
        body = json.loads(request.body or b"null")
        json.dumps(body, ensure_ascii=False).encode()  # UnicodeEncodeError for a lone surrogate ("\\ud800"): no text
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # bad JSON, huge integers, deep nesting
        return error(400, f"the request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return error(400, "the request body must be a JSON object")
    return caller_of(user.pk, key), body


async def read_ask(body: dict, caller: Caller, *, chat: bool) -> Ask | HttpResponse:
    """A chat or completions request read and checked for ``caller``, or the error answer."""
    try:
        ask = await database_sync_to_async(parse_ask, thread_sensitive=False)(body, chat)
    except InputError as exc:
        return error(400, str(exc), param=exc.param, code=exc.code)
    except ModelNotFound as exc:
        return error(404, str(exc), param="model", code="model_not_found")
    except ClusterUnavailable as exc:
        return error(503, str(exc), kind="server_error", code="model_not_ready")
    return dataclasses.replace(ask, caller=caller)


async def _serve(request: HttpRequest, *, chat: bool) -> HttpResponse:
    read = await read_request(request)
    if isinstance(read, HttpResponse):
        return read
    ask = await read_ask(read[1], read[0], chat=chat)
    if isinstance(ask, HttpResponse):
        return ask
    answer = Answer(ask, chat)
    try:
        if not ask.stream:
            return JsonResponse(await answer.whole())
        # The first piece before the headers: a refused generation is a 429, not a broken stream.
        first = await answer.start()
    except (ClusterUnavailable, ClusterGenerationError) as exc:
        return failure(exc)
    return event_stream(answer.events(first))
