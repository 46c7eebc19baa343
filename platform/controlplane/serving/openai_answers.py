"""The OpenAI API's answers: a request's choices run at once on the cluster, given back whole or
as server-sent events, in OpenAI's chat or completions shape.

Each choice is a generation of its own (``Choice``), with its stop sequences (the cluster is stopped
as soon as one appears) and its logprobs, streamed with the text they belong to. ``Answer`` runs
them at once; the first failure of any ends the response (the others are stopped), before the
headers as an error answer, mid-stream as an error event (``openai_errors``). A client that goes
away stops its generations too. ``event_stream`` frames the events for a proxy not to buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from django.http import StreamingHttpResponse

from controlplane.deployments import generation

from . import metrics
from .completions import (
    ClusterGenerationError,
    ClusterUnavailable,
    CompletionResult,
    TextDelta,
    astream,
    build_request,
    new_request_id,
)
from .logprobs import Scored, chat_logprobs, legacy_logprobs, prompt_tokens
from .openai_errors import failure
from .openai_protocol import Ask
from .stops import StopScanner
from .structured import tool_calls
from .text import (
    Sampling,
)

Piece = tuple[str, list[Scored], CompletionResult | None]


class Choice:
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
            request = build_request(
                self.prompt_ids,
                ask.max_tokens,
                self.sampling,
                self.request_id,
                ask.caller,
                logprobs=ask.logprobs,
                prompt_logprobs=ask.echo and ask.logprobs is not None,
                grammar=ask.structure.grammar,
            )
            async for item in astream(ask.target, request, caller=ask.caller):
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


class Answer:
    """One response in OpenAI's shape, whole or as a stream of chunks, of one or more choices."""

    def __init__(self, ask: Ask, chat: bool) -> None:
        self.ask, self.chat = ask, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.api = "openai_chat" if chat else "openai_completions"
        texts = ask.texts or [""] * len(ask.prompts)
        starts = ask.starts or [None] * len(ask.prompts)
        self.choices = [
            Choice(i, ids, sampling, ask.stops, texts[i // ask.n], starts[i // ask.n])
            for i, ids, sampling in ask.choices()
        ]
        self._pieces: AsyncIterator[tuple[int, Piece]] | None = None

    async def run(self) -> AsyncIterator[tuple[int, Piece]]:
        """(choice, (text piece, its logprobs, None)) as the choices run at once, and (choice,
        ("", [], result)) as each ends.

        The first failure of any choice ends the response (the others are stopped on the cluster).
        """
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
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
                    yield sse(self._chunk(choice.index, {"role": "assistant", "content": ""}, None))
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
                        yield sse(self._chunk(index, delta, None, self._logprobs(hold.tokens + tokens)))
                        yield sse(self._chunk(index, {}, reason))
                        continue
                if result is None:
                    delta = {"content": piece} if self.chat else piece
                    yield sse(self._chunk(index, delta, None, self._logprobs(tokens)))
                    continue
                results[index] = result
                yield sse(self._chunk(index, {} if self.chat else "", result.finish_reason))
        except StopAsyncIteration:
            if self.ask.include_usage:
                yield sse({**self._chunk_base(), "choices": [], "usage": usage_of(results, self.ask.n)})
        except (ClusterUnavailable, ClusterGenerationError) as exc:
            yield sse(json.loads(failure(exc).content))  # OpenAI's error shape, mid-stream
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
        usage = usage_of(dict(enumerate(results)), self.ask.n)
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


def usage_of(results: dict[int, CompletionResult], n: int) -> dict:
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


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingHttpResponse:
    """Server-sent events as they come: never cached, never buffered by a proxy (nginx)."""
    response = StreamingHttpResponse(events, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response
