"""What the OpenAI API's own renderers draw, against OpenAI's published schemas, in ``make check``.

The live check (``check_answers_keep_to_openais_schema`` and ``check_responses_api`` in
``test_serving_e2e.py``, marked slow) sends every kind of answer through a served cluster. This
one runs the same renderers (``openai_answers.Answer``, ``responses_api``) on answers made of a real
tiny checkpoint's tokenizer and tokens, one text piece after another as a generation brings them,
so that a field a strict client needs cannot go missing between two runs of the full suite.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from controlplane.serving.completions import CompletionResult, Target
from controlplane.serving.logprobs import Scored
from controlplane.serving.openai_answers import Answer
from controlplane.serving.openai_errors import error
from controlplane.serving.openai_protocol import Ask
from controlplane.serving.responses_api import _Stream, output_items, response_object
from controlplane.serving.structured import CALL_CLOSE, CALL_OPEN, Structure, read_structure
from controlplane.serving.text import Sampling, tokenizer_for
from inference.wire.generation import TokenLogprob
from tests.controlplane import openai_schema

PICK = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def target(tiny_model: Path) -> Target:
    return Target(1, "tiny", str(tiny_model), 256, 4, tokenizer_for(str(tiny_model)).vocab_size)


def _pieces(target: Target, text: str, *, reason: str = "stop") -> tuple[list[tuple], CompletionResult]:
    """``text`` as a generation brings it: a piece per token with its logprob, then the result."""
    tokenizer = target.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, offset = [], 0
    for token in ids:
        piece = tokenizer.decode([token])
        logprob = TokenLogprob(token, -0.5, [(token, -0.5), ((token + 1) % 64, -1.5)])
        pieces.append((0, (piece, [Scored(token, logprob, offset)], None)))
        offset += len(piece)
    result = CompletionResult("".join(p[1][0] for p in pieces), ids, reason, 5, {"cached_prompt_tokens": 0})
    return [*pieces, (0, ("", [], result))], result


def _streamed(answer, pieces: list[tuple], events) -> list[str]:
    async def feed():
        for piece in pieces[1:]:
            yield piece

    async def run() -> list[str]:
        answer._pieces = feed()
        return [event async for event in events(pieces[0])]

    return asyncio.run(run())


def _data(events: list[str]) -> list[dict]:
    lines = [line.removeprefix("data: ") for event in events for line in event.split("\n") if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


@pytest.mark.parametrize("logprobs", [None, 2])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_chat_and_completions_whole_and_streamed(target: Target, chat: bool, logprobs: int | None) -> None:
    ask = Ask(target, [[1, 2, 3]], 1, 8, Sampling(), [], True, True, logprobs=logprobs)
    pieces, result = _pieces(target, "Hello there, experts.")
    answer = Answer(ask, chat)
    whole = answer._object([result], {0: [s for _, (_, scored, _) in pieces for s in scored]})
    openai_schema.conforms("CreateChatCompletionResponse" if chat else "CreateCompletionResponse", whole)
    streaming = Answer(ask, chat)
    chunks = _data(_streamed(streaming, pieces, streaming.events))
    assert chunks[-1]["usage"]["completion_tokens"] == len(result.token_ids)
    for chunk in chunks:
        if chat:
            openai_schema.conforms("CreateChatCompletionStreamResponse", chunk)
        else:  # OpenAI's API, like this one, sends null until a choice's last chunk (test_serving_e2e)
            for choice in chunk["choices"]:
                choice["finish_reason"] = choice["finish_reason"] or "stop"
            openai_schema.conforms("CreateCompletionResponse", chunk)


def test_a_tool_call_whole_and_streamed(target: Target) -> None:
    body = {"tools": [PICK], "tool_choice": "required"}
    ask = Ask(target, [[1, 2, 3]], 1, 40, Sampling(), [], True, False, structure=read_structure(body))
    pieces, result = _pieces(target, f'{CALL_OPEN}{{"name": "pick", "arguments": {{}}}}{CALL_CLOSE}')
    whole = Answer(ask, True)._object([result], {0: []})
    assert whole["choices"][0]["message"]["tool_calls"]
    openai_schema.conforms("CreateChatCompletionResponse", whole)
    answer = Answer(ask, True)
    for chunk in _data(_streamed(answer, pieces, answer.events)):
        openai_schema.conforms("CreateChatCompletionStreamResponse", chunk)


@pytest.mark.parametrize("kind", ["text", "cut", "call"])
def test_responses_whole_and_streamed(target: Target, kind: str) -> None:
    structure = read_structure({"tools": [PICK], "tool_choice": "required"}) if kind == "call" else Structure()
    ask = Ask(target, [[1, 2, 3]], 1, 8, Sampling(), [], True, False, structure=structure)
    text = f'{CALL_OPEN}{{"name": "pick", "arguments": {{}}}}{CALL_CLOSE}' if kind == "call" else "Experts, on demand."
    pieces, result = _pieces(target, text, reason="length" if kind == "cut" else "stop")
    tools = [{"type": "function", "name": "pick", "parameters": PICK["function"]["parameters"]}]
    body = {"model": "tiny", "input": "Hi", "instructions": "Be brief."} | ({"tools": tools} if kind == "call" else {})
    whole = response_object(ask, body, "resp_1", 0, result, output_items(ask, result, "1"))
    assert whole["status"] == ("incomplete" if kind == "cut" else "completed")
    openai_schema.conforms("Response", whole)
    stream = _Stream(ask, body, Answer(ask, True), 1, None)
    events = _data(_streamed(stream.answer, pieces, stream.events))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == f"response.{whole['status']}"
    for event in events:
        openai_schema.conforms("ResponseStreamEvent", event)


def test_error_bodies() -> None:
    for answer in (
        error(400, "bad", param="top_k", code="unsupported_parameter"),
        error(404, "none", param="model", code="model_not_found"),
        error(503, "later", kind="server_error", code="model_not_ready"),
    ):
        openai_schema.conforms("ErrorResponse", json.loads(answer.content))
