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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.contrib.auth.models import AnonymousUser
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.authentication import CSRFCheck

from controlplane.accounts.scopes import Scope
from controlplane.accounts.selectors import caller_of
from controlplane.accounts.services import QuotaExceeded, authenticate_api_key, bearer_key, check_quota
from controlplane.accounts.usage import Caller
from controlplane.deployments import generation
from controlplane.deployments.models import Deployment, DeploymentStatus
from controlplane.throttles import throttle_wait

from . import metrics
from .bounds import CHOICES, STOPS, check_max_tokens, check_openai_request
from .completions import (
    ClusterBusy,
    ClusterGenerationError,
    ClusterUnavailable,
    CompletionResult,
    ModelNotFound,
    RequestTooLarge,
    Target,
    TextDelta,
    TooManyGenerations,
    astream,
    find_target,
    new_request_id,
)
from .knobs import check_knobs
from .logprobs import Scored, chat_logprobs, chat_top_logprobs, completion_logprobs, legacy_logprobs, prompt_tokens
from .parameters import CHAT, COMPLETIONS, check_parameters
from .stops import StopScanner
from .structured import Structure, conversation, read_structure, tool_calls
from .text import (
    MAX_SEED,
    InputError,
    Sampling,
    chat_text,
    check_lengths,
    check_prompt,
    check_sampling,
    check_text_fits,
    check_token_ids,
    decode_with_starts,
    encode_chat_text,
    encode_prompt,
    prompt_list,
)

DEFAULT_MAX_TOKENS = 256


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


class _Refused(Exception):
    def __init__(self, response: JsonResponse) -> None:
        self.response = response


async def _user(request: HttpRequest):
    """(The caller, their API key or None): an API key's user (the key holding the ``inference``
    scope), or a logged-in browser session with a valid CSRF token (as DRF's SessionAuthentication
    asks: another site's page must not spend a logged-in user's generations); raises _Refused with the 401, 403 or
    429 to answer otherwise. Every call counts against the REST API's throttles (the same rates),
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
    """(who calls, their API key or None, the refusal to answer or None)."""
    key = bearer_key(request.headers.get("Authorization", ""))
    if key:
        found = await database_sync_to_async(authenticate_api_key)(key=key)
        if found is None:
            return AnonymousUser(), None, _unauthenticated()
        if not found.allows(Scope.INFERENCE):
            message = f"this API key lacks the '{Scope.INFERENCE}' scope (it has: {', '.join(found.scopes)})"
            return found.user, found, error(403, message, kind="permission_error", code="insufficient_scope")
        return found.user, found, None
    user = await request.auser()
    if not user.is_authenticated:
        return user, None, _unauthenticated()
    check = CSRFCheck(lambda _: None)
    check.process_request(request)  # reads the CSRF cookie, as DRF's SessionAuthentication does
    reason = check.process_view(request, None, (), {})
    if reason:
        return user, None, error(403, f"CSRF Failed: {reason}", kind="permission_error", code="csrf_failed")
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


@dataclass(frozen=True)
class Ask:
    """A validated request: where it goes, what it asks."""

    target: Target
    prompts: list[list[int]]  # token ids of each prompt (chat: the one conversation)
    n: int  # choices per prompt
    max_tokens: int
    sampling: Sampling
    stops: list[str]
    stream: bool
    include_usage: bool
    caller: Caller | None = None  # who asks: main shares its batch fairly between users; usage counts to them
    logprobs: int | None = None  # each token's logprob and this many alternatives (None: no logprobs)
    echo: bool = False  # the prompt first (``texts``)
    prompt_only: bool = False  # echo with max_tokens 0: the generated token is left out
    texts: list[str] = dataclasses.field(default_factory=list)  # each prompt's text (completions)
    structure: Structure = dataclasses.field(default_factory=Structure)  # chat: its grammar, the tools it may call
    # Token-id prompts: where each token starts in its text (text prompts: the tokenizer's offsets, for echo).
    starts: list[list[int]] = dataclasses.field(default_factory=list)

    def choices(self) -> list[tuple[int, list[int], Sampling]]:
        """(index, prompt ids, sampling) of every choice, prompt after prompt, ``n`` each (choice
        ``i`` is of prompt ``i // n``)."""
        out = []
        for p, prompt_ids in enumerate(self.prompts):
            for j in range(self.n):
                seed = self.sampling.seed
                if seed is None or j == 0:
                    sampling = self.sampling
                else:
                    sampling = dataclasses.replace(self.sampling, seed=(seed + j) % (MAX_SEED + 1))
                out.append((p * self.n + j, prompt_ids, sampling))
        return out


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
        return _quota_exceeded(exc)
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
        ask = await database_sync_to_async(_parse, thread_sensitive=False)(body, chat)
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
    answer = _Answer(ask, chat)
    try:
        if not ask.stream:
            return JsonResponse(await answer.whole())
        # The first piece before the headers: a refused generation is a 429, not a broken stream.
        first = await answer.start()
    except (ClusterUnavailable, ClusterGenerationError) as exc:
        return _failure(exc)
    return event_stream(answer.events(first))


def event_stream(events: AsyncIterator[str]) -> StreamingHttpResponse:
    """Server-sent events as they come: never cached, never buffered by a proxy (nginx)."""
    response = StreamingHttpResponse(events, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


def _quota_exceeded(exc: QuotaExceeded) -> JsonResponse:
    """429 until UTC midnight; ``x-should-retry: false`` keeps OpenAI's clients from retrying in seconds."""
    response = error(429, str(exc), kind="insufficient_quota", code="quota_exceeded", retry_after=exc.retry_after_s)
    response["x-should-retry"] = "false"
    return response


def _failure(exc: ClusterUnavailable | ClusterGenerationError) -> JsonResponse:
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


def _parse(body: dict, chat: bool) -> Ask:
    check_parameters(body, CHAT if chat else COMPLETIONS, "chat completions" if chat else "completions")
    check_openai_request(body, chat=chat)  # every field's size, before anything is built from it
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InputError("model is required (a deployment name; GET /v1/models lists them)", param="model")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InputError("n must be an integer of at least 1", param="n")
    CHOICES.check(n, "n")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise InputError("max_tokens must be an integer", param="max_tokens")
    sampling = check_sampling(body.get("temperature", 1.0), body.get("top_p", 1.0), body.get("seed"))
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InputError(f"stop must be a string or a list of at most {STOPS.limit} strings", param="stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InputError("stream must be true or false", param="stream")
    include_usage = _include_usage(body.get("stream_options"), stream)
    if chat:
        logprobs, echo = chat_top_logprobs(body.get("logprobs"), body.get("top_logprobs")), False
    else:
        logprobs, echo = completion_logprobs(body.get("logprobs")), body.get("echo") or False
        if not isinstance(echo, bool):
            raise InputError("echo must be true or false", param="echo")
    # echo with max_tokens 0 (log-likelihood of the prompt alone): main generates one token, left out.
    prompt_only = echo and max_tokens == 0
    if prompt_only:
        max_tokens = 1
    elif max_tokens == 0:
        message = "max_tokens must be at least 1 (0 only with echo: the prompt alone, for its logprobs)"
        raise InputError(message, param="max_tokens")
    check_max_tokens(max_tokens)
    target = find_target(model)
    # More choices than one user may have in main at once could never all run: refused now.
    limit = target.max_per_user
    if n > limit:
        raise InputError(
            f"n must be from 1 to {limit}, the generations one user may have on this deployment at once",
            param="n",
        )
    tokenizer = target.tokenizer
    vocab = tokenizer.vocab_size if target.vocab is None else min(target.vocab, tokenizer.vocab_size)
    sampling = dataclasses.replace(sampling, **check_knobs(body, vocab))
    texts: list[str] = []
    starts: list[list[int]] = []
    # Text that cannot fit the context is refused from its length before it is tokenized: a
    # conversation's as the chat template writes it, with its tools and past calls.
    structure = Structure()
    if chat:
        structure = read_structure(body)
        messages, tools = conversation(body.get("messages"), structure.tools, tokenizer.template_reads_tools)
        text = chat_text(tokenizer, messages, tools)
        check_text_fits(tokenizer, [text], max_tokens, target.context, param="messages")
        prompts = [encode_chat_text(tokenizer, text)]
    else:
        given = prompt_list(body.get("prompt"))
        if len(given) * n > limit:
            raise InputError(
                f"{len(given)} prompts × n={n} are more than the {limit} generations one user may have "
                "on this deployment at once",
                param="prompt",
            )
        if isinstance(given[0], list):  # token ids: main gets them as they are
            check_token_ids(given, vocab)
            prompts = [list(ids) for ids in given]
            for prompt_ids in prompts:  # a prompt that cannot fit is refused before it is decoded
                check_lengths(len(prompt_ids), max_tokens, target.context)
            decoded = [decode_with_starts(tokenizer, ids) for ids in prompts]
            texts, starts = [text for text, _ in decoded], [where for _, where in decoded]
        else:
            texts, prompts = given, []
            for text in texts:
                check_prompt(text)
                check_text_fits(tokenizer, [text], max_tokens, target.context, param="prompt")
                prompts.append(encode_prompt(tokenizer, text))
    for prompt_ids in prompts:
        check_lengths(len(prompt_ids), max_tokens, target.context)
    return Ask(
        target,
        prompts,
        n,
        max_tokens,
        sampling,
        stops,
        stream,
        include_usage,
        "",
        logprobs,
        echo,
        prompt_only,
        texts,
        structure,
        starts,
    )


def _include_usage(options: object, stream: bool) -> bool:
    """``stream_options``: ``include_usage`` alone, and only with ``stream``."""
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InputError('stream_options must be an object, e.g. {"include_usage": true}', param="stream_options")
    if not stream:
        raise InputError("stream_options is only taken with stream: true", param="stream_options")
    for name in options:
        if name != "include_usage":
            raise InputError(
                f"stream_options.{name:.60} is not supported (include_usage is)",
                param=f"stream_options.{name:.60}",
                code="unsupported_parameter",
            )
    include_usage = options.get("include_usage", False)
    if include_usage is not None and not isinstance(include_usage, bool):
        raise InputError("stream_options.include_usage must be true or false", param="stream_options.include_usage")
    return bool(include_usage)


Piece = tuple[str, list[Scored], CompletionResult | None]


class _Choice:
    """One choice of a response: a generation of its own, with its stop sequences.

    Its text pieces carry the logprobs of the tokens they hold (where asked for): a token's
    logprobs go out with the first piece after it was generated, so a piece's logprobs may run
    ahead of its text while a stop sequence holds text back; they end with the token that
    completed a stop sequence.
    """

    def __init__(
        self,
        index: int,
        prompt_ids: list[int],
        sampling: Sampling,
        stops: list[str],
        text: str,
        starts: list[int] | None = None,
    ) -> None:
        self.index, self.prompt_ids, self.sampling = index, prompt_ids, sampling
        self.scanner = StopScanner(stops)
        self.request_id = new_request_id()
        self.prompt_text = text  # completions: the prompt, for echo and text offsets
        self.prompt_starts = starts  # a token-id prompt's offsets in its text (None: the tokenizer's, from the text)

    async def run(self, ask: Ask, api: str) -> AsyncIterator[Piece]:
        """Visible text pieces with their tokens' logprobs, then ("", [], result) at the end; stops
        the cluster on a stop sequence."""
        scanner = self.scanner
        finished = False
        echoed = ""
        scored: list[Scored] = []  # logprobs not yet handed out
        try:
            async for item in astream(
                ask.target,
                self.prompt_ids,
                ask.max_tokens,
                self.sampling,
                request_id=self.request_id,
                caller=ask.caller,
                logprobs=ask.logprobs,
                prompt_logprobs=ask.echo and ask.logprobs is not None,
                grammar=ask.structure.grammar,
            ):
                if ask.echo and not echoed:  # the prompt first, with its logprobs (they come with the first token)
                    echoed = self.prompt_text
                    yield echoed, self._echoed(ask, item), None
                if isinstance(item, TextDelta):
                    if ask.prompt_only:
                        continue
                    was_stopped = scanner.stopped
                    if item.logprob is not None and not was_stopped:
                        scored.append(Scored(item.token_id, item.logprob, len(self.prompt_text) + item.offset))
                    piece = scanner.feed(item.text)
                    if piece:
                        yield piece, scored, None
                        scored = []
                    if scanner.stopped and not was_stopped:
                        await generation.acancel(ask.target.deployment_id, self.request_id)
                else:
                    tail = scanner.finish()
                    if tail or scored:
                        yield tail, scored, None
                    finished = True
                    metrics.record(api, ok=True, prompt_tokens=item.prompt_tokens, metrics=item.metrics)
                    reason = "stop" if scanner.stopped or item.finish_reason != "length" else "length"
                    tokens = [] if ask.prompt_only else item.token_ids
                    if ask.prompt_only:  # max_tokens 0 it was: the limit ended it, whatever main sampled
                        reason = "length"
                    text = echoed + scanner.visible
                    yield "", [], CompletionResult(text, tokens, reason, item.prompt_tokens, item.metrics)
        except (ClusterUnavailable, ClusterGenerationError):
            metrics.record(api, ok=False)
            raise
        finally:
            if not finished:  # the client went away (or a failure): stop the work on the cluster
                with contextlib.suppress(Exception):  # best effort on the way out
                    await generation.acancel(ask.target.deployment_id, self.request_id)

    def _echoed(self, ask: Ask, first: TextDelta | CompletionResult) -> list[Scored]:
        """The echoed prompt's tokens with their logprobs, where asked for."""
        if ask.logprobs is None:
            return []
        entries = first.prompt_logprobs if isinstance(first, TextDelta) else None
        if entries is None:
            raise ClusterGenerationError("main sent no logprobs for the prompt")
        starts = self.prompt_starts
        if starts is None:  # a text prompt: its ids are the tokenizer's, with the tokenizer's offsets
            starts = ask.target.tokenizer.encode_with_offsets(self.prompt_text)[1]
        try:
            return prompt_tokens(self.prompt_ids, starts, entries)
        except ValueError as exc:
            raise ClusterGenerationError(str(exc)) from None


_DONE = object()


@dataclass
class _Held:
    """A streamed choice that may be a tool call, until its first visible text says which it is."""

    pieces: list[str] = dataclasses.field(default_factory=list)
    tokens: list[Scored] = dataclasses.field(default_factory=list)
    text: bool | None = None  # True: text, streamed as it comes


class _Answer:
    """One response in OpenAI's shape, whole or as a stream of chunks, of one or more choices."""

    def __init__(self, ask: Ask, chat: bool) -> None:
        self.ask, self.chat = ask, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.api = "openai_chat" if chat else "openai_completions"
        texts = ask.texts or [""] * len(ask.prompts)
        starts = ask.starts or [None] * len(ask.prompts)
        self.choices = [
            _Choice(i, ids, sampling, ask.stops, texts[i // ask.n], starts[i // ask.n])
            for i, ids, sampling in ask.choices()
        ]
        self._pieces: AsyncIterator[tuple[int, Piece]] | None = None

    async def run(self) -> AsyncIterator[tuple[int, Piece]]:
        """(choice, (text piece, its logprobs, None)) as the choices run at once, and (choice,
        ("", [], result)) as each ends.

        The first failure of any choice ends the response (the others are stopped on the cluster).
        """
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                async for piece in choice.run(self.ask, self.api):
                    await queue.put((choice.index, piece))
            except (ClusterUnavailable, ClusterGenerationError) as exc:
                await queue.put(exc)
            finally:
                await queue.put(_DONE)

        tasks = [asyncio.create_task(pump(choice)) for choice in self.choices]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def start(self) -> tuple[int, Piece]:
        """Run the choices and wait for the first piece (raises as ``run`` does)."""
        self._pieces = self.run()
        try:
            return await anext(self._pieces)
        except StopAsyncIteration:
            raise ClusterGenerationError("the cluster ended the generation without a result") from None
        except BaseException:
            await self._pieces.aclose()
            raise

    async def whole(self) -> dict:
        results: dict[int, CompletionResult] = {}
        scored: dict[int, list[Scored]] = {i: [] for i in range(len(self.choices))}
        async for index, (_, tokens, result) in self.run():
            scored[index] += tokens
            if result is not None:
                results[index] = result
        if len(results) != len(self.choices):
            raise ClusterGenerationError("the cluster ended a generation without a result")
        return self._object([results[i] for i in range(len(self.choices))], scored)

    async def events(self, first: tuple[int, Piece]) -> AsyncIterator[str]:
        assert self._pieces is not None, "start() first"
        results: dict[int, CompletionResult] = {}
        # An answer that may be a tool call is held (with its logprobs) until its first character
        # says which it is: a call starts with "<" (text under tool_choice "auto" never does) and goes
        # out whole at its end; text is streamed from there on.
        held = {c.index: _Held() for c in self.choices} if self.chat and self.ask.structure.calls else {}
        try:
            if self.chat:
                for choice in self.choices:
                    yield _sse(self._chunk(choice.index, {"role": "assistant", "content": ""}, None))
            pending = [first]
            while True:
                if not pending:
                    pending.append(await anext(self._pieces))
                index, (piece, tokens, result) = pending.pop()
                hold = held.get(index)
                if hold is not None and hold.text is None:
                    if result is None:
                        hold.pieces.append(piece)
                        hold.tokens += tokens
                        if "".join(hold.pieces).startswith("<"):  # a call: held to its end
                            continue
                        if not "".join(hold.pieces):  # nothing visible yet: still undecided
                            continue
                        hold.text, piece, tokens = True, "".join(hold.pieces), hold.tokens
                    else:
                        results[index] = result
                        message, reason = self._message(result)
                        delta = {k: v for k, v in message.items() if k != "role" and v is not None}
                        if "tool_calls" in delta:
                            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
                        yield _sse(self._chunk(index, delta, None, self._logprobs(hold.tokens + tokens)))
                        yield _sse(self._chunk(index, {}, reason))
                        continue
                if result is None:
                    delta = {"content": piece} if self.chat else piece
                    yield _sse(self._chunk(index, delta, None, self._logprobs(tokens)))
                    continue
                results[index] = result
                yield _sse(self._chunk(index, {} if self.chat else "", result.finish_reason))
        except StopAsyncIteration:
            if self.ask.include_usage:
                yield _sse({**self._chunk_base(), "choices": [], "usage": _usage(results, self.ask.n)})
        except (ClusterUnavailable, ClusterGenerationError) as exc:
            yield _sse(json.loads(_failure(exc).content))  # OpenAI's error shape, mid-stream
        finally:
            await self._pieces.aclose()
        yield "data: [DONE]\n\n"

    def _chunk_base(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.ask.target.name}

    def _chunk(self, index: int, delta, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        if self.chat:
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        return {**self._chunk_base(), "choices": [choice]}

    def _message(self, result: CompletionResult) -> tuple[dict, str]:
        """A chat choice's message and finish reason: a tool call where the answer is a whole one."""
        calls = tool_calls(result.text) if self.ask.structure.calls and result.finish_reason == "stop" else None
        if calls:
            return {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": result.text, "refusal": None}, result.finish_reason

    def _logprobs(self, tokens: list[Scored]) -> dict | None:
        """A choice's (or a chunk's) ``logprobs`` object in the endpoint's shape; None where not asked for."""
        if self.ask.logprobs is None:
            return None
        tokenizer = self.ask.target.tokenizer
        if self.chat:
            return chat_logprobs(tokenizer, tokens)
        return legacy_logprobs(tokenizer, tokens, self.ask.logprobs)

    def _object(self, results: list[CompletionResult], scored: dict[int, list[Scored]]) -> dict:
        usage = _usage(dict(enumerate(results)), self.ask.n)
        base = {"id": self.id, "created": self.created, "model": self.ask.target.name, "usage": usage}
        if self.chat:
            choices = []
            for i, r in enumerate(results):
                message, reason = self._message(r)
                choices.append(
                    {"index": i, "message": message, "finish_reason": reason, "logprobs": self._logprobs(scored[i])}
                )
            return {**base, "object": "chat.completion", "choices": choices}
        choices = [
            {"index": i, "text": r.text, "finish_reason": r.finish_reason, "logprobs": self._logprobs(scored[i])}
            for i, r in enumerate(results)
        ]
        return {**base, "object": "text_completion", "choices": choices}


def _usage(results: dict[int, CompletionResult], n: int) -> dict:
    """Every choice's completion tokens; each prompt's tokens once, however many (``n``) choices it has."""
    completion = sum(len(r.token_ids) for r in results.values())
    prompts = [r for index, r in results.items() if index % n == 0]
    prompt = sum(r.prompt_tokens for r in prompts)
    # Of the prompt tokens, those whose KV main's prefix cache held (inference.runtime.prefix_cache).
    cached = sum(r.metrics.get("cached_prompt_tokens", 0) for r in prompts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
