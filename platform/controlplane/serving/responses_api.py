"""``POST /v1/responses``: OpenAI's Responses API over the chat path, with what a local model can honour.

A Responses request is read as the chat completions request that asks the same (``chat_body``,
pure): ``instructions`` first as a system message, ``input`` as a string or a list of items
(messages of the user, system, developer and assistant roles with text content, earlier
``function_call`` items and their ``function_call_output``), ``max_output_tokens``,
``temperature``, ``top_p``, ``text.format`` (text, a JSON object or a JSON schema, through the
same grammar path and bounds), function ``tools`` and ``tool_choice``, and the sampling
extensions. That request then takes the chat's own way (``openai_api.read_ask``): the same keys,
scopes, quotas, usage accounting, limits and fair queue, and the same tokens. The answer is drawn
in the Responses shape (``response_object``), whole or as the Responses event stream:
``response.created``, ``response.in_progress``, an output item added, its text deltas (or its
function call's arguments), the item done, and ``response.completed`` (``response.incomplete``
where ``max_output_tokens`` ended it) with usage. A request that may call a tool is held until its
first visible character says whether it is a call, as in the chat's stream; a call goes out whole.

A response is stored for its user unless ``store`` is false (``responses_store``: bounded, expiring),
and ``previous_response_id`` continues a stored one's conversation (not its instructions).

Not served, and refused with a 400 naming the parameter (``parameters.RESPONSES``): built-in
tools (web search, file search, computer use, code interpreter, ...), reasoning controls, stored
conversations (``conversation``) and logprobs.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from channels.db import database_sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from . import responses_store
from .completions import ClusterGenerationError, ClusterUnavailable, CompletionResult
from .models import RESPONSE_ID_CHARS
from .openai_answers import Answer, event_stream, usage_of
from .openai_api import read_ask, read_request
from .openai_errors import error, failure
from .openai_protocol import Ask
from .parameters import RESPONSES, check_parameters
from .structured import tool_calls
from .text import InputError

API = "openai_responses"
# What the chat request is called where a Responses field went into it, for the error's ``param``.
PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
# The Responses parameters the chat request takes as they are.
SAME = ("model", "temperature", "top_p", "tools", "tool_choice", "parallel_tool_calls", "stream", "user")
EXTENSIONS = ("top_k", "min_p", "repetition_penalty")


def chat_body(body: dict, earlier: list[dict] | None = None) -> dict:
    """The chat completions request that asks what the Responses request ``body`` asks, continuing
    the conversation ``earlier`` (a stored response's items) where it names one (pure)."""
    check_parameters(body, RESPONSES, "responses")
    chat: dict = {k: body[k] for k in (*SAME, *EXTENSIONS) if k in body and k != "tools"}
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InputError("instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    messages += _messages(normalized([*(earlier or []), *input_items(body.get("input"))]))
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            message = 'tool_choice must be "auto", "none", "required" or a function by name'
            raise InputError(message, param="tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    text = body.get("text")
    if text is not None:
        chat["response_format"] = _format(text)
    return chat


def input_items(given: object) -> list[dict]:
    """``input`` as a list of items (a string is one user message)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise InputError("input must be a string or a non-empty list of input items", param="input")
    return given


def normalized(items: list) -> list[dict]:
    """Input (or output) items checked and rebuilt from the fields they are read by, and nothing else:
    what a stored response keeps is what the conversation's bounds counted."""
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InputError(f"{where}.role must be user, system, developer or assistant", param=f"{where}.role")
            out.append({"type": "message", "role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            fields = {name: item.get(name) for name in ("call_id", "name", "arguments")}
            for name, value in fields.items():
                if not isinstance(value, str):
                    raise InputError(f"{where}.{name} must be a string", param=f"{where}.{name}")
            out.append({"type": "function_call", **fields})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InputError(f"{where}.call_id must be a string", param=f"{where}.call_id")
            output = _text(item.get("output"), f"{where}.output")
            out.append({"type": "function_call_output", "call_id": item["call_id"], "output": output})
        else:
            raise InputError(
                f"{where} must be a message, a function_call or a function_call_output (not {kind!r:.40})",
                param=where,
            )
    return out


def _messages(items: list[dict]) -> list[dict]:
    """Normalized items as chat messages."""
    messages: list[dict] = []
    for item in items:
        if item["type"] == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": item["content"]})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": item["arguments"]}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _text(content: object, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                message = f"{where}[{j}] must be a text part (images, files and audio are not taken)"
                raise InputError(message, param=f"{where}[{j}]")
            if not isinstance(part.get("text"), str):
                raise InputError(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
            parts.append(part["text"])
        return "".join(parts)
    raise InputError(f"{where} must be a string or a list of text parts", param=where)


def _tools(tools: object) -> list:
    """Function tools as the chat takes them; a built-in tool is refused by name."""
    if not isinstance(tools, list):
        raise InputError("tools must be a list of function tools", param="tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InputError(
                f"tools[{i}]: only function tools are served here; {kind!r:.40} is a built-in tool "
                "(web search, file search, computer use, code interpreter, ...) this server does not run",
                param=f"tools[{i}].type",
                code="unsupported_parameter",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _format(text: object) -> dict:
    """``text.format`` as the chat's ``response_format``."""
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise InputError('text must be an object with "format"', param="text")
    if text.get("verbosity") not in (None, "medium"):
        message = "text.verbosity is not supported (the model has no verbosity setting)"
        raise InputError(message, param="text.verbosity", code="unsupported_parameter")
    shape = text.get("format") or {"type": "text"}
    if not isinstance(shape, dict):
        raise InputError("text.format must be an object", param="text.format")
    if shape.get("type") == "json_schema":
        schema = {k: shape[k] for k in ("name", "schema", "strict", "description") if k in shape}
        return {"type": "json_schema", "json_schema": schema}
    return shape


def response_object(
    ask: Ask, body: dict, response_id: str, created: int, result: CompletionResult | None, output: list[dict]
) -> dict:
    """The Response object: in progress (``result`` None, no output yet), completed or incomplete."""
    status = "in_progress" if result is None else "incomplete" if result.finish_reason == "length" else "completed"
    usage = None
    if result is not None:
        counted = usage_of({0: result}, 1)
        # Main's prefix cache: the prompt's tokens it reused, and those whose KV it kept from this one.
        cached = counted["prompt_tokens_details"]["cached_tokens"]
        written = result.metrics.get("written_prompt_tokens", 0)
        usage = {
            "input_tokens": counted["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "output_tokens": counted["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counted["total_tokens"],
        }
    answer = {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": ask.max_tokens,
        "model": ask.target.name,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": None,
        "store": body.get("store", True) is not False,
        "temperature": body.get("temperature", 1.0),
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": [{"strict": True, **tool} for tool in body.get("tools") or []],
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "metadata": {},
    }
    # What the document types without null is left out where there is none (yet).
    if usage is not None:
        answer["usage"] = usage
    if isinstance(body.get("user"), str):
        answer["user"] = body["user"]
    return answer


def output_items(ask: Ask, result: CompletionResult, item_id: str) -> list[dict]:
    """The answer as output items: its function calls, or one assistant message."""
    calls = tool_calls(result.text) if ask.structure.calls and result.finish_reason == "stop" else None
    if calls:
        return [
            {
                "type": "function_call",
                "id": f"fc_{item_id}_{i}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
            for i, call in enumerate(calls)
        ]
    status = "incomplete" if result.finish_reason == "length" else "completed"
    return [_message(item_id, result.text, status)]


def _message(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": f"msg_{item_id}", "status": status, "role": "assistant", "content": content}


@csrf_exempt
async def responses(request: HttpRequest) -> HttpResponse:
    read = await read_request(request)
    if isinstance(read, HttpResponse):
        return read
    caller, body = read
    store, previous = body.get("store", True), body.get("previous_response_id")
    if store is not None and not isinstance(store, bool):
        return error(400, "store must be true or false", param="store")
    earlier: list[dict] = []
    if previous is not None:
        found = None
        if isinstance(previous, str) and len(previous) <= RESPONSE_ID_CHARS:
            found = await database_sync_to_async(responses_store.earlier_items)(caller.user_id, previous)
        if found is None:
            message = f"no stored response of yours is named {previous!r:.80} (or it expired)"
            return error(404, message, param="previous_response_id", code="previous_response_not_found")
        earlier = found
    try:
        chat = chat_body(body, earlier)
    except InputError as exc:
        return error(400, str(exc), param=exc.param, code=exc.code)
    ask = await read_ask(chat, caller, chat=True)
    if isinstance(ask, HttpResponse):
        return _renamed(ask)
    answer = Answer(ask, chat=True)
    answer.api = API
    kept = [*earlier, *normalized(input_items(body["input"]))] if store is not False else None
    stream = _Stream(ask, body, answer, caller.user_id, kept)
    try:
        if not ask.stream:
            return JsonResponse(await stream.whole())
        first = await answer.start()  # before the headers: a refused generation is a 429, not a broken stream
    except (ClusterUnavailable, ClusterGenerationError) as exc:
        return failure(exc)
    return event_stream(stream.events(first))


def _renamed(response: HttpResponse) -> HttpResponse:
    """An error about the chat request, naming the Responses field it came from."""
    body = json.loads(response.content)
    param = body["error"].get("param")
    if isinstance(param, str):
        for chat_name, name in PARAMS.items():
            if param == chat_name or param.startswith(f"{chat_name}["):
                body["error"]["param"] = name + param.removeprefix(chat_name)
                break
    return JsonResponse(body, status=response.status_code)


class _Stream:
    """One Response, whole or as its event stream."""

    def __init__(self, ask: Ask, body: dict, answer: Answer, user_id: int, kept: list[dict] | None) -> None:
        """``kept``: the conversation to store with the output once it ends (None: not stored)."""
        self.ask, self.body, self.answer = ask, body, answer
        self.user_id, self.kept = user_id, kept
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item = uuid.uuid4().hex
        self.created = int(time.time())
        self.sequence = 0

    async def whole(self) -> dict:
        result = None
        async for _, (_, _, done) in self.answer.run():
            result = done or result
        if result is None:
            raise ClusterGenerationError("the cluster ended the generation without a result")
        output = output_items(self.ask, result, self.item)
        await self._keep(output)
        return self._object(result, output)

    async def _keep(self, output: list[dict]) -> None:
        if self.kept is not None:
            items = [*self.kept, *normalized(output)]
            await database_sync_to_async(responses_store.keep)(self.user_id, self.id, items)

    def _event(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"

    async def events(self, first) -> AsyncIterator[str]:
        pieces = self.answer._pieces
        assert pieces is not None
        pending = self._object(None, [])
        yield self._event("response.created", response=pending)
        yield self._event("response.in_progress", response=pending)
        held = self.ask.structure.calls  # a possible call is held until its first visible character
        text, opened, result = "", False, None
        try:
            _, (piece, _, result) = first
            while result is None:
                text += piece
                if not opened and piece and not (held and text.startswith("<")):
                    for event in self._open():
                        yield event
                    opened, piece = True, text
                if opened and piece:
                    yield self._delta(piece)
                _, (piece, _, result) = await anext(pieces)
        except StopAsyncIteration:
            failure = {"code": "generation_failed", "message": "the cluster ended the generation without a result"}
            yield self._event("error", code=failure["code"], message=failure["message"], param=None)
            return
        except (ClusterUnavailable, ClusterGenerationError) as exc:
            failure = json.loads(failure(exc).content)["error"]
            yield self._event("error", code=failure["code"], message=failure["message"], param=None)
            return
        finally:
            await pieces.aclose()
        items = output_items(self.ask, result, self.item)
        await self._keep(items)
        for event in self._close(items, opened):
            yield event
        done = self._object(result, items)
        ended = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        yield self._event(ended, response=done)

    def _object(self, result: CompletionResult | None, output: list[dict]) -> dict:
        return response_object(self.ask, self.body, self.id, self.created, result, output)

    def _open(self) -> list[str]:
        """A message item and its text part, opened."""
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = _message(self.item, None, "in_progress")
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", item_id=item["id"], output_index=0, content_index=0, part=part),
        ]

    def _delta(self, piece: str) -> str:
        return self._event(
            "response.output_text.delta",
            item_id=f"msg_{self.item}",
            output_index=0,
            content_index=0,
            delta=piece,
            logprobs=[],
        )

    def _close(self, items: list[dict], opened: bool) -> list[str]:
        """Each output item's last events: a message's text and part done, or a call's arguments."""
        events = []
        for index, item in enumerate(items):
            if item["type"] == "function_call":
                where = {"item_id": item["id"], "output_index": index}
                arguments = item["arguments"]
                opening = {**item, "arguments": "", "status": "in_progress"}
                events.append(self._event("response.output_item.added", output_index=index, item=opening))
                events.append(self._event("response.function_call_arguments.delta", **where, delta=arguments))
                done = {"name": item["name"], "arguments": arguments}
                events.append(self._event("response.function_call_arguments.done", **where, **done))
            else:
                part = item["content"][0]
                if not opened:  # held as a possible call, and text after all: all of it at once
                    events += self._open()
                    if part["text"]:
                        events.append(self._delta(part["text"]))
                where = {"item_id": item["id"], "output_index": index, "content_index": 0}
                events.append(self._event("response.output_text.done", **where, text=part["text"], logprobs=[]))
                events.append(self._event("response.content_part.done", **where, part=part))
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events
