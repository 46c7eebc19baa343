"""Structured output and tool calls: what a chat request asks for, as a grammar for main, and
the answer read back into OpenAI's shapes.

``response_format`` ``json_object`` (any JSON object) and ``json_schema`` (the schema, always
enforced, ``strict`` or not) and ``tools`` with ``tool_choice`` become one grammar in
llguidance's form, carried by ``Generate.grammar``: main masks every token the grammar does not
allow before sampling (``inference.runtime.engine.grammar``), so the answer keeps to it whatever
the model's weights. JSON is written compact (no whitespace between tokens): free whitespace
would let a model pad an answer until its token limit.

A tool call is written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the
Hermes format that Qwen's and others' templates use), its ``arguments`` kept to the function's
``parameters`` schema: ``tool_choice`` ``"required"`` or a named function allows exactly one
call; ``"auto"`` a call or text (which then does not start with ``<``; or, with a
``response_format`` JSON, the JSON); ``"none"`` no call. The tools reach the model through its
chat template's ``tools`` where the template reads them, and otherwise as a system message
(``tool_system_message``, documented in docs/using/openai-api.md); a tool loop's turns (an
assistant message with ``tool_calls``, a ``tool`` message with the result) go to a template that
reads tools as they are, and to one that does not as plain turns (``conversation``). The
answer is read back with
``tool_calls``: one whose text is a whole call becomes ``message.tool_calls`` with
``finish_reason: "tool_calls"``; anything else stays text.

Grammars are compiled here, before the request goes anywhere, under the grammar limits main
compiles them under (``inference.wire.grammar``): a schema llguidance cannot compile, or one past
a limit, is a 400 naming the parameter (and the limit), so what main would refuse never leaves
the web process. Each distinct grammar is compiled once per web process (its verdict kept by its
digest, the last ``CHECKED_GRAMMARS``); main compiles it again for the model's tokenizer.
Before any of this the request's schemas and tools are held to their size bounds
(``bounds.check_openai_request``), so what is built here stays within main's grammar cap and
the agent link's frame.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import llguidance

from inference.wire.grammar import BYTE_TOKENIZER, Compiled, CompiledGrammars, compile_grammar, digest

from .bounds import TOOLS, compact_json
from .text import InputError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
INVALID_SCHEMA = "invalid_schema"
COMPACT = {"whitespace_flexible": False}  # JSON without free whitespace (llguidance's options)
CHECKED_GRAMMARS = 1024  # grammars whose verdict a web process keeps (a digest and a sentence each)
_CHECKED = CompiledGrammars(max_entries=CHECKED_GRAMMARS)  # verdicts only: no matcher is kept here


@dataclass(frozen=True)
class Structure:
    """What a request asks of the answer's shape.

    ``grammar``: llguidance's grammar for main ("" for free text); ``tools``: the functions, in
    OpenAI's ``{"type": "function", "function": {...}}`` form; ``calls``: whether the answer
    may be a tool call (``tool_choice`` is not ``"none"``).
    """

    grammar: str = ""
    tools: list[dict] = field(default_factory=list)
    calls: bool = False


def read_structure(body: dict) -> Structure:
    """The structure ``response_format``, ``tools`` and ``tool_choice`` ask for (400 if they are wrong)."""
    schema = _response_schema(body.get("response_format"))
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    if choice == "none" or not tools:
        grammar = _json_grammar(schema, "response_format") if schema is not None else ""
        return Structure(grammar, tools, False)
    functions = [t["function"] for t in tools]
    if isinstance(choice, dict):
        functions = [f for f in functions if f["name"] == choice["function"]["name"]]
    # Compact JSON in the grammar, as the bounds measured it (bounds.STRUCTURE_BYTES).
    call = f'"{CALL_OPEN}" %json {compact_json(_call_schema(functions))} "{CALL_CLOSE}"'
    if choice == "auto":
        other = 'TEXT\nTEXT: /[^<][\\s\\S]*/ | ""'
        if schema is not None:
            other = f"%json {compact_json({**schema, 'x-guidance': COMPACT})}"
        lark = f"start: call | {other}\ncall: {call}\n"
    else:
        lark = f"start: {call}\n"
    grammar = llguidance.grammar_from("lark", lark)
    _check(grammar, "tools")
    return Structure(grammar, tools, True)


def _response_schema(response_format: object) -> dict | None:
    """The JSON schema ``response_format`` asks the answer to keep to (None: free text)."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise InputError(
            'response_format must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
            param="response_format",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InputError("response_format.json_schema needs a name and a schema", param="response_format.json_schema")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise InputError("response_format.json_schema.schema must be a JSON schema object", param="response_format")
    return schema


def _tools(tools: object) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list) or not 1 <= len(tools) <= TOOLS.limit:
        raise InputError(f"tools must be a list of 1 to {TOOLS.limit} tools", param="tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InputError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', param=f"tools[{i}]")
        name = function.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise InputError(f"tools[{i}].function.name must be a name of its own", param=f"tools[{i}].function.name")
        names.add(name)
        if not isinstance(function.get("parameters", {}), dict):
            raise InputError(f"tools[{i}].function.parameters must be a JSON schema", param=f"tools[{i}]")
    return tools


def _tool_choice(choice: object, tools: list[dict]) -> str | dict:
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise InputError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise InputError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise InputError(f"tool_choice names {name!r:.60}, which is not one of the tools", param="tool_choice")
    return choice


def _call_schema(functions: list[dict]) -> dict:
    """The JSON of one call of any of ``functions``: its name, and arguments that keep to its parameters."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    one = options[0] if len(options) == 1 else {"anyOf": options}
    return {**one, "x-guidance": COMPACT}


def _json_grammar(schema: dict, param: str) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT)
    except ValueError as exc:
        raise InputError(f"{param}: the schema cannot be used: {exc}", param=param, code=INVALID_SCHEMA) from None
    _check(grammar, param)
    return grammar


def _check(grammar: str, param: str) -> None:
    """A 400 naming ``param`` unless ``grammar`` compiles under main's grammar limits.

    Compiled once per distinct grammar (``_CHECKED``); a compile takes up to seconds for the
    largest grammars the limits admit, here in the request's worker thread (llguidance lets go
    of the GIL), never on the event loop.
    """
    key = digest(grammar)
    checked = _CHECKED.get(key)
    if checked is None:
        _, problem = compile_grammar(grammar, BYTE_TOKENIZER)
        checked = Compiled(None, problem, 0)
        _CHECKED.put(key, checked)
    if checked.problem:
        raise InputError(f"{param}: the schema cannot be used: {checked.problem}", param=param, code=INVALID_SCHEMA)


def tool_system_message(tools: list[dict]) -> str:
    """The tools, for a chat template that does not read ``tools``: a system message's text."""
    lines = [
        "You may call one of these functions. To call one, answer with nothing but",
        f'{CALL_OPEN}{{"name": <the function\'s name>, "arguments": <its arguments as a JSON object>}}{CALL_CLOSE}',
        "Functions (JSON, one a line):",
    ]
    lines += [_compact(t["function"]) for t in tools]
    return "\n".join(lines)


def _compact(value: object) -> str:
    """JSON as the grammar has the model write it: no whitespace between tokens."""
    return json.dumps(value, separators=(",", ":"))


def with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation with the tools in its system message (the first one, or a new one first)."""
    text = tool_system_message(tools)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def conversation(messages: object, tools: list[dict], reads_tools: bool) -> tuple[object, list[dict] | None]:
    """The conversation and tools to render: a tool loop's turns for the template.

    For a template that reads tools, the messages as they are (a call's ``arguments``, a JSON
    string in OpenAI's shape, as the object templates expect) and the tools; for one that does
    not, plain turns (an assistant's calls written as the model writes them, a ``tool``
    message as a user turn ``<tool_response>...</tool_response>``) with the tools in the system
    message. Anything else is left for ``text.check_messages`` to refuse.
    """
    if not isinstance(messages, list):
        return messages, tools or None
    turns = [_turn(m, i, reads_tools) if isinstance(m, dict) else m for i, m in enumerate(messages)]
    if reads_tools or not tools:
        return turns, tools or None
    return with_tools(turns, tools), None


def _turn(message: dict, i: int, reads_tools: bool) -> dict:
    if message.get("role") == "tool" and not reads_tools:
        content = message.get("content")
        if not isinstance(content, str):
            raise InputError(f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        return {"role": "user", "content": f"<tool_response>{content}</tool_response>"}
    if message.get("role") != "assistant" or message.get("tool_calls") is None:
        return message
    calls = message["tool_calls"]
    if not isinstance(calls, list) or not calls:
        raise InputError(f"messages[{i}].tool_calls must be a non-empty list", param=f"messages[{i}].tool_calls")
    read = [_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(calls)]
    if reads_tools:
        given = [
            {**c, "function": {**c["function"], "arguments": args}} for c, (_, args) in zip(calls, read, strict=True)
        ]
        return {**message, "tool_calls": given}
    written = "".join(f"{CALL_OPEN}{_compact({'name': n, 'arguments': a})}{CALL_CLOSE}" for n, a in read)
    return {"role": "assistant", "content": (message.get("content") or "") + written}


def _call(call: object, param: str) -> tuple[str, object]:
    """A past call's function name and its arguments (parsed from their JSON string)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InputError(f"{param} must be {{id, type: function, function: {{name, arguments}}}}", param=param)
    arguments = function.get("arguments", "{}")
    try:
        return function["name"], json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise InputError(f"{param}.function.arguments must be a JSON string", param=param) from None


def tool_calls(text: str) -> list[dict] | None:
    """The answer's tool calls in OpenAI's shape, if it is a whole call (None: it is text)."""
    body = text  # as the grammar has it: a call is the whole answer, nothing around it (text never starts "<")
    if not (body.startswith(CALL_OPEN) and body.endswith(CALL_CLOSE)):
        return None
    try:
        call = json.loads(body[len(CALL_OPEN) : -len(CALL_CLOSE)])
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    function = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}]
