"""The OpenAI-compatible API under ``/v1``: models, chat completions and completions.

Requests and answers follow OpenAI's shapes, so the official ``openai`` client works
unchanged: ``Authorization: Bearer KEY`` (keys from ``manage.py create_api_key``), a model is
a deployment by name, ``stream: true`` answers with server-sent events ending in
``data: [DONE]``, errors come as ``{"error": {"message", "type", "param", "code"}}`` with
the matching status. Temperature 0 is greedy; ``stop`` sequences end the answer (and the
generation on the cluster) as soon as one appears. A client that disconnects mid-stream
stops the generation too.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from channels.db import database_sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from controlplane.accounts.scopes import Scope
from controlplane.accounts.services import authenticate_api_key, bearer_key
from controlplane.deployments import generation
from controlplane.deployments.models import Deployment, DeploymentStatus
from controlplane.throttles import GenerationSlot, TooManyGenerations

from . import metrics
from .completions import (
    ClusterGenerationError,
    ClusterUnavailable,
    CompletionResult,
    ModelNotFound,
    Target,
    TextDelta,
    astream,
    find_target,
    new_request_id,
)
from .stops import StopScanner
from .text import InputError, check_lengths, check_sampling, encode_chat, encode_prompt

DEFAULT_MAX_TOKENS = 256
MAX_STOPS = 4


RETRY_AFTER_S = 5  # what a 503 asks a client to wait: a restarting role is back in seconds


def error(status: int, message: str, *, kind: str = "invalid_request_error", param=None, code=None) -> JsonResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    response = JsonResponse(body, status=status)
    if status in (429, 503):
        response["Retry-After"] = str(RETRY_AFTER_S if status == 503 else 1)
    return response


class _Refused(Exception):
    def __init__(self, response: JsonResponse) -> None:
        self.response = response


async def _user(request: HttpRequest):
    """The caller: an API key's user (the key holding the ``inference`` scope), or a logged-in
    browser session; raises _Refused with the 401 or 403 to answer otherwise."""
    key = bearer_key(request.headers.get("Authorization", ""))
    if key:
        found = await database_sync_to_async(authenticate_api_key)(key=key)
        if found is None:
            raise _Refused(_unauthenticated())
        if not found.allows(Scope.INFERENCE):
            message = f"this API key lacks the '{Scope.INFERENCE}' scope (it has: {', '.join(found.scopes)})"
            raise _Refused(error(403, message, kind="permission_error", code="insufficient_scope"))
        return found.user
    user = await request.auser()
    if not user.is_authenticated:
        raise _Refused(_unauthenticated())
    return user


def _unauthenticated() -> JsonResponse:
    response = error(
        401,
        "invalid or missing API key (Authorization: Bearer KEY)",
        kind="authentication_error",
        code="invalid_api_key",
    )
    response["WWW-Authenticate"] = "Bearer"
    return response


@csrf_exempt
async def models(request: HttpRequest) -> HttpResponse:
    if request.method != "GET":
        return error(405, "use GET", code="method_not_allowed")
    try:
        await _user(request)
    except _Refused as refused:
        return refused.response

    def listing() -> list[dict]:
        ready = Deployment.objects.filter(status=DeploymentStatus.READY).order_by("name")
        return [
            {"id": d.name, "object": "model", "created": int(d.created_at.timestamp()), "owned_by": "odmoe"}
            for d in ready
        ]

    return JsonResponse({"object": "list", "data": await database_sync_to_async(listing)()})


@dataclass(frozen=True)
class Ask:
    """A validated request: where it goes, what it asks."""

    target: Target
    prompt_ids: list[int]
    max_tokens: int
    sampling: object
    stops: list[str]
    stream: bool
    include_usage: bool


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _serve(request, chat=True)


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    return await _serve(request, chat=False)


async def _serve(request: HttpRequest, *, chat: bool) -> HttpResponse:
    if request.method != "POST":
        return error(405, "use POST", code="method_not_allowed")
    try:
        user = await _user(request)
    except _Refused as refused:
        return refused.response
    try:
        body = json.loads(request.body or b"null")
        json.dumps(body, ensure_ascii=False).encode()  # UnicodeEncodeError for a lone surrogate ("\\ud800"): no text
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # bad JSON, huge integers, deep nesting
        return error(400, f"the request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return error(400, "the request body must be a JSON object")
    try:
        ask = await database_sync_to_async(_parse, thread_sensitive=False)(body, chat)
    except InputError as exc:
        return error(400, str(exc), param=exc.param, code=exc.code)
    except ModelNotFound as exc:
        return error(404, str(exc), param="model", code="model_not_found")
    except ClusterUnavailable as exc:
        return error(503, str(exc), kind="server_error", code="model_not_ready")
    try:
        slot = await GenerationSlot.take(user.pk)
    except TooManyGenerations as exc:
        return error(429, str(exc), kind="rate_limit_error", code="too_many_generations")
    answer = _Answer(ask, chat, slot)
    if ask.stream:
        response = StreamingHttpResponse(answer.events(), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
        return response
    try:
        return JsonResponse(await answer.whole())
    except ClusterUnavailable as exc:
        return error(503, str(exc), kind="server_error", code="model_not_ready")
    except ClusterGenerationError as exc:
        if exc.retryable:
            return error(503, f"the cluster could not finish: {exc}", kind="server_error", code="model_restarting")
        return error(502, f"the cluster could not finish: {exc}", kind="server_error", code="generation_failed")


def _parse(body: dict, chat: bool) -> Ask:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InputError("model is required (a deployment name; GET /v1/models lists them)", param="model")
    if body.get("n", 1) != 1:
        raise InputError("only n=1 is supported", param="n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise InputError("max_tokens must be an integer", param="max_tokens")
    sampling = check_sampling(body.get("temperature", 1.0), body.get("top_p", 1.0), body.get("seed"))
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) for s in stops):
        raise InputError(f"stop must be a string or a list of at most {MAX_STOPS} strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InputError("stream must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InputError('stream_options must be an object, e.g. {"include_usage": true}', param="stream_options")
    target = find_target(model)
    tokenizer = target.tokenizer
    if chat:
        prompt_ids = encode_chat(tokenizer, body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        prompt_ids = encode_prompt(tokenizer, prompt)
    check_lengths(len(prompt_ids), max_tokens, target.context)
    return Ask(target, prompt_ids, max_tokens, sampling, stops, stream, bool(options.get("include_usage")))


class _Answer:
    """One response in OpenAI's shape, whole or as a stream of chunks."""

    def __init__(self, ask: Ask, chat: bool, slot: GenerationSlot) -> None:
        self.ask, self.chat, self.slot = ask, chat, slot
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.request_id = new_request_id()
        self.api = "openai_chat" if chat else "openai_completions"

    async def run(self) -> AsyncIterator[tuple[str, CompletionResult | None]]:
        """Visible text pieces, then ("", result) at the end; stops the cluster on a stop sequence."""
        scanner = StopScanner(self.ask.stops)
        ask = self.ask
        finished = False
        try:
            async for item in astream(
                ask.target, ask.prompt_ids, ask.max_tokens, ask.sampling, request_id=self.request_id
            ):
                if isinstance(item, TextDelta):
                    was_stopped = scanner.stopped
                    piece = scanner.feed(item.text)
                    if piece:
                        yield piece, None
                    if scanner.stopped and not was_stopped:
                        await generation.acancel(ask.target.deployment_id, self.request_id)
                else:
                    tail = scanner.finish()
                    if tail:
                        yield tail, None
                    finished = True
                    metrics.record(self.api, ok=True, prompt_tokens=item.prompt_tokens, metrics=item.metrics)
                    reason = "stop" if scanner.stopped or item.finish_reason != "length" else "length"
                    yield (
                        "",
                        CompletionResult(scanner.visible, item.token_ids, reason, item.prompt_tokens, item.metrics),
                    )
        except (ClusterUnavailable, ClusterGenerationError):
            metrics.record(self.api, ok=False)
            raise
        finally:
            await self.slot.release()
            if not finished:  # the client went away (or a failure): stop the work on the cluster
                with contextlib.suppress(Exception):  # best effort on the way out
                    await generation.acancel(ask.target.deployment_id, self.request_id)

    async def whole(self) -> dict:
        async for _, result in self.run():
            if result is not None:
                return self._object(result)
        raise ClusterGenerationError("the cluster ended the generation without a result")

    async def events(self) -> AsyncIterator[str]:
        try:
            if self.chat:
                yield _sse(self._chunk({"role": "assistant", "content": ""}, None))
            async for piece, result in self.run():
                if result is None:
                    yield _sse(self._chunk({"content": piece} if self.chat else piece, None))
                    continue
                yield _sse(self._chunk({} if self.chat else "", result.finish_reason))
                if self.ask.include_usage:
                    yield _sse({**self._chunk_base(), "choices": [], "usage": _usage(result)})
        except (ClusterUnavailable, ClusterGenerationError) as exc:
            yield _sse(
                {"error": {"message": str(exc), "type": "server_error", "param": None, "code": "generation_failed"}}
            )
        yield "data: [DONE]\n\n"

    def _chunk_base(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.ask.target.name}

    def _chunk(self, delta, finish_reason: str | None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish_reason, "logprobs": None}
        return {**self._chunk_base(), "choices": [choice]}

    def _object(self, result: CompletionResult) -> dict:
        base = {"id": self.id, "created": self.created, "model": self.ask.target.name, "usage": _usage(result)}
        if self.chat:
            message = {"role": "assistant", "content": result.text}
            choice = {"index": 0, "message": message, "finish_reason": result.finish_reason, "logprobs": None}
            return {**base, "object": "chat.completion", "choices": [choice]}
        choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
        return {**base, "object": "text_completion", "choices": [choice]}


def _usage(result: CompletionResult) -> dict:
    completion = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
    }


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
