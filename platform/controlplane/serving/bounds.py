"""How big each field of a request that travels on toward main may be: every bound declared once.

Each field a client sends that reaches main (as a grammar, a prompt, a sampling option) or
that the web process works through before it does (a chat template, stop sequences) has a
size or count ``Bound`` here, with why that many. The bounds are checked in the web process
before anything is sent on: for ``/v1`` by ``check_openai_request``, the first thing
``openai_protocol.parse_ask`` does after the parameters' names (before a grammar is built or
validated, a model's tokenizer loaded, a prompt rendered or tokenized, a ``Generate``
built); for the chat websocket by ``chat.protocol.parse_client`` and the chat's history by
``check_messages_size``; for ``POST /api/jobs`` by its serializer's fields, derived from these.
A breach under ``/v1`` is a 400 in OpenAI's shape, ``param`` the field as the request has it
(``tools[3].function.parameters``) and ``code`` the bound's, its message naming the field
and the bound. docs/limits.md is rendered from this declaration (``markdown_table``).

Where the numbers come from. OpenAI publishes some of its own: 128 tools, 4 stop sequences,
``n`` up to 128, and for strict structured outputs at most 5,000 object properties in all and
10 levels of nesting (and 120,000 characters of names and enum values, which the bytes bound
here holds well within). A client written against OpenAI stays within those, so they are
taken as they are; the sizes OpenAI leaves open are picked so that a real client's requests
pass with room to spare while a hostile one's cannot cost main, the link or the web process
more than a fixed amount.

Why this is enough for the agent link. A ``Generate`` goes down main's agent link as JSON
(``json.dumps``: ``\\u`` escapes, ``", "`` between items), and a link whose agent announces no
frame limit takes 1 MiB (websockets' default). Its size is the grammar, the prompt's ids and
a few short fields:

- the grammar is made of response_format's schema and each tool's name and parameters, at
  most ``STRUCTURE_BYTES`` (128 KiB) as compact ASCII JSON together, and about 120 bytes of
  wrapping per tool; llguidance writes a character it does not escape in no more bytes than
  its escape. The largest the bounds allow is 147,232 bytes, within main's own cap
  (``MAX_GRAMMAR_BYTES``, 256 KiB, ``inference.wire.grammar``);
- on the link the grammar at most doubles (each ``"`` and ``\\`` escaped once more): schemas
  made of quotes, the worst case, take 277,425 bytes;
- the prompt's ids are bounded by the model's context (checked before a Generate is built),
  at most 8 bytes an id (``"151643, "``): 262,144 bytes at Mixtral's 32,768 tokens.

So the largest Generate the bounds allow for Mixtral is 539,569 bytes, about half of 1 MiB
(``tests/controlplane/test_bounds.py`` builds it and measures it). What bounds the rest is
the model's context: past about 96,000 tokens a full prompt beside the largest structure
could pass 1 MiB; the link's own check on every frame it sends fails that one request with
a clear error, never the link, and an agent that announces a larger frame limit takes it.

``logit_bias`` has no bound: only its neutral ``{}`` is accepted (``parameters``), whose
check is one comparison, and nothing of it travels on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from inference.constants import DEFAULT_MAX_WAITING, MAX_BATCH
from inference.wire.generation import MAX_TOP_LOGPROBS

from .text import InputError

# Where a bound is checked.
CHAT_API = "/v1/chat/completions"
COMPLETIONS_API = "/v1/completions"
CHAT_SOCKET = "chat websocket"
JOBS_API = "POST /api/jobs"

# The codes a refusal under /v1 carries: OpenAI's own for a list or string too long and an
# integer too large, and one for a size that is neither.
LIST_TOO_LONG = "array_above_max_length"
STRING_TOO_LONG = "string_above_max_length"
INTEGER_TOO_LARGE = "integer_above_max_value"
TOO_LARGE = "too_large"


@dataclass(frozen=True)
class Bound:
    """At most ``limit`` ``unit`` in ``fields`` (``[i]``: each item of a list), checked for
    ``where``; ``why`` that many, as the docs say it."""

    fields: tuple[str, ...]
    limit: int
    unit: str  # what is counted, read after a number: "tools", "bytes as compact JSON"
    where: tuple[str, ...]
    why: str
    code: str = TOO_LARGE

    def check(self, size: int, param: str) -> None:
        """Refuse ``size`` past the bound, naming ``param`` (the field as this request has it)."""
        if size > self.limit:
            raise InputError(
                f"{param}: {size} {self.unit}, more than the {self.limit} this server takes",
                param=param,
                code=self.code,
            )


KIB = 1024

MAX_TOKENS = Bound(
    ("max_tokens", "max_completion_tokens"),
    4096,
    "tokens",
    (CHAT_API, COMPLETIONS_API, JOBS_API),
    "a long answer; the model's context bounds prompt and answer together, checked before tokenizing",
    INTEGER_TOO_LARGE,
)
CHOICES = Bound(
    ("n",),
    128,
    "choices",
    (CHAT_API, COMPLETIONS_API),
    "OpenAI's bound; the deployment's `max_per_user` bounds the choices of one request further",
    INTEGER_TOO_LARGE,
)
STOPS = Bound(("stop",), 4, "sequences", (CHAT_API, COMPLETIONS_API), "OpenAI's bound", LIST_TOO_LONG)
STOP_CHARS = Bound(
    ("stop", "stop[i]"),
    1024,
    "characters",
    (CHAT_API, COMPLETIONS_API),
    "a stop sequence is a few characters (a blank line, a role's name, a closing tag); each one is searched for "
    "in the answer after every token and held back while the answer ends in a prefix of it",
    STRING_TOO_LONG,
)
TOP_LOGPROBS = Bound(
    ("top_logprobs",),
    MAX_TOP_LOGPROBS,
    "alternatives per token",
    (CHAT_API,),
    "OpenAI's bound; each token's alternatives travel back on every hop (`inference.wire.generation`, where main "
    "holds a request to the same bound)",
    INTEGER_TOO_LARGE,
)
COMPLETION_LOGPROBS = Bound(
    ("logprobs",),
    5,
    "alternatives per token",
    (COMPLETIONS_API,),
    "OpenAI's bound for the legacy completions",
    INTEGER_TOO_LARGE,
)
MESSAGES = Bound(
    ("messages",),
    2048,
    "messages",
    (CHAT_API, CHAT_SOCKET),
    "rendering a conversation through the chat template costs per message; 2,048 turns of 16 tokens fill "
    "Mixtral's 32k-token context",
    LIST_TOO_LONG,
)
MESSAGES_CHARS = Bound(
    ("messages",),
    1024 * KIB,
    "characters as compact JSON",
    (CHAT_API, CHAT_SOCKET),
    "every message with its content and tool calls, together: about 250,000 tokens of English, past the context "
    "of every model family served (the context check then holds the rendered prompt to the model's own)",
)
TOOL_ARGUMENTS = Bound(
    ("messages[i].tool_calls[j].function.arguments",),
    64 * KIB,
    "characters",
    (CHAT_API,),
    f"a past call's arguments are what the model wrote in an earlier turn, at most `max_tokens` "
    f"({MAX_TOKENS.limit:,} tokens, a few characters each); room for a client that writes its own examples",
    STRING_TOO_LONG,
)
TOOLS = Bound(("tools",), 128, "tools", (CHAT_API,), "OpenAI's bound", LIST_TOO_LONG)
TOOLS_CHARS = Bound(
    ("tools",),
    256 * KIB,
    "characters as compact JSON",
    (CHAT_API,),
    f"names, descriptions and parameters of every tool together, which the chat template writes into the "
    f"prompt: {TOOLS.limit} tools with 2,000-character descriptions fit",
)
SCHEMA_BYTES = Bound(
    ("response_format.json_schema.schema", "tools[i].function.parameters"),
    64 * KIB,
    "bytes as compact JSON",
    (CHAT_API,),
    "a schema real clients send (a Pydantic model of dozens of fields with their descriptions) is a few KB. "
    "Measured as compact ASCII JSON, as the grammar and the agent link carry it: a `const` of 1,500,000 "
    "characters once closed main's agent link, and is now refused before anything is built from it",
)
STRUCTURE_BYTES = Bound(
    ("response_format.json_schema.schema", "tools"),
    128 * KIB,
    "bytes of schemas and tool names as compact JSON",
    (CHAT_API,),
    "what the grammar main gets is made of: the response schema and every tool's name and parameters together. "
    "It keeps the grammar within main's own grammar cap and a `Generate` within half the agent link's default "
    "frame (1 MiB; `controlplane/serving/bounds.py` works it out)",
)
SCHEMA_DEPTH = Bound(
    ("response_format.json_schema.schema", "tools[i].function.parameters"),
    64,
    "levels of nesting",
    (CHAT_API,),
    "OpenAI takes 10 levels of nested objects, each two to four levels of JSON (the object, its `properties`, "
    "an `anyOf` and its list); past any schema OpenAI takes, far below what would exhaust a parser",
)
SCHEMA_PROPERTIES = Bound(
    ("response_format.json_schema.schema", "tools"),
    5000,
    "object properties",
    (CHAT_API,),
    "OpenAI's bound for strict structured outputs, counted over the response schema and every tool's parameters "
    "(one grammar): properties are what makes a schema slow to compile (one of 8,000 stalled main for seconds)",
)
PROMPTS = Bound(
    ("prompt",),
    MAX_BATCH + DEFAULT_MAX_WAITING,
    "prompts",
    (COMPLETIONS_API,),
    "the most generations a deployment's main can hold, running and waiting; the deployment's `max_per_user` "
    "bounds prompts × `n` further",
    LIST_TOO_LONG,
)
PROMPT_CHARS = Bound(
    ("prompt", "prompt[i]", "prompts[i]"),
    1024 * KIB,
    "characters",
    (COMPLETIONS_API, JOBS_API),
    "as a conversation's (`messages`): past the context of every model family served",
    STRING_TOO_LONG,
)
PROMPT_TOKENS = Bound(
    ("prompt", "prompt[i]"),
    256 * KIB,
    "token ids",
    (COMPLETIONS_API,),
    "past the longest context of the families served (DeepSeek-V2's 163,840 tokens); each id is then checked "
    "against the model's vocabulary and the prompt against its context",
    LIST_TOO_LONG,
)
JOB_PROMPTS = Bound(
    ("prompts",),
    100,
    "prompts",
    (JOBS_API,),
    "an evaluation's batch; a user's jobs together hold a bounded number of prompts besides (Jobs, below)",
    LIST_TOO_LONG,
)
CHAT_MESSAGE_CHARS = Bound(
    ("content",),
    20_000,
    "characters",
    (CHAT_SOCKET,),
    "a long message typed or pasted into the chat; longer text goes through jobs or the API",
    STRING_TOO_LONG,
)
CHAT_MAX_TOKENS = Bound(
    ("max_tokens",),
    1024,
    "tokens",
    (CHAT_SOCKET,),
    "a chat answer, read as it streams",
    INTEGER_TOO_LARGE,
)

# Every bound by its name, in the order declared (the docs' table's order).
BOUNDS: dict[str, Bound] = {name: value for name, value in globals().items() if isinstance(value, Bound)}


def compact_json(value: object) -> str:
    """JSON without whitespace and with ``\\u`` escapes: how the grammar and the agent link carry a schema."""
    return json.dumps(value, separators=(",", ":"))


def check_max_tokens(max_new_tokens: int, bound: Bound = MAX_TOKENS) -> None:
    """An answer's token limit: at least one, at most ``bound``'s."""
    if max_new_tokens < 1:
        raise InputError(f"max_tokens must be at least 1, got {max_new_tokens}", param="max_tokens")
    bound.check(max_new_tokens, "max_tokens")


def check_openai_request(body: Mapping[str, object], *, chat: bool) -> None:
    """Refuse the first field of an OpenAI request past its bound.

    Only sizes are checked here, of fields that have the form they should; a field of another
    form is left to the check that reads it (``openai_protocol.parse_ask``), which refuses it.
    """
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if isinstance(stops, list):
        STOPS.check(len(stops), "stop")  # one string is one sequence
        for i, item in enumerate(stops):
            if isinstance(item, str):
                STOP_CHARS.check(len(item), "stop" if isinstance(stop, str) else f"stop[{i}]")
    if chat:
        if isinstance(body.get("messages"), list):
            check_messages_size(body["messages"])
        _check_structure(body.get("response_format"), body.get("tools"))
    else:
        _check_prompts(body.get("prompt"))


def check_messages_size(messages: list) -> None:
    """A conversation's bounds: its messages, their characters, each past call's arguments."""
    MESSAGES.check(len(messages), "messages")
    MESSAGES_CHARS.check(len(json.dumps(messages, separators=(",", ":"), ensure_ascii=False)), "messages")
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for j, call in enumerate(calls if isinstance(calls, list) else []):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if arguments is not None:
                size = len(arguments) if isinstance(arguments, str) else len(compact_json(arguments))
                TOOL_ARGUMENTS.check(size, f"messages[{i}].tool_calls[{j}].function.arguments")


def _check_structure(response_format: object, tools: object) -> None:
    """The schemas a grammar will be built from: each one's size and nesting, then all together."""
    schemas: list[tuple[str, object]] = []  # (param, schema)
    names = 0  # bytes of the tools' names in the grammar
    spec = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if isinstance(spec, dict) and "schema" in spec:
        schemas.append(("response_format.json_schema.schema", spec["schema"]))
    if isinstance(tools, list):
        TOOLS.check(len(tools), "tools")
        TOOLS_CHARS.check(len(json.dumps(tools, separators=(",", ":"), ensure_ascii=False)), "tools")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict):
                names += len(compact_json(function.get("name")))
                if "parameters" in function:
                    schemas.append((f"tools[{i}].function.parameters", function["parameters"]))
    STRUCTURE_BYTES.check(names, "tools")
    total, properties = names, 0
    for param, schema in schemas:
        size = len(compact_json(schema))
        SCHEMA_BYTES.check(size, param)
        total += size
        STRUCTURE_BYTES.check(total, "tools" if param.startswith("tools") else param)
        depth, count = schema_shape(schema)
        SCHEMA_DEPTH.check(depth, param)
        properties += count
        SCHEMA_PROPERTIES.check(properties, param)


def schema_shape(schema: object) -> tuple[int, int]:
    """(levels of JSON nesting, object properties) of a JSON schema.

    Properties are the entries of every ``properties`` mapping, wherever it is (``$defs``,
    ``items``, ``anyOf``...); a property that is itself named ``properties`` counts once.
    Walked without recursion: the schema's size is checked first, its depth is what is measured.
    """
    deepest, properties = 0, 0
    stack: list[tuple[object, int, bool]] = [(schema, 1, False)]  # (node, its depth, a properties mapping)
    while stack:
        node, depth, mapping = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            if mapping:
                properties += len(node)
            for key, value in node.items():
                stack.append((value, depth + 1, not mapping and key == "properties" and isinstance(value, dict)))
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((item, depth + 1, False) for item in node)
    return deepest, properties


def _check_prompts(prompt: object) -> None:
    """``/v1/completions``' prompts: how many, and each one's characters or token ids."""
    if isinstance(prompt, str):
        PROMPT_CHARS.check(len(prompt), "prompt")
        return
    if not isinstance(prompt, list) or not prompt:
        return
    if all(isinstance(p, int) for p in prompt):  # one prompt of token ids
        PROMPT_TOKENS.check(len(prompt), "prompt")
        return
    PROMPTS.check(len(prompt), "prompt")
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            PROMPT_CHARS.check(len(item), f"prompt[{i}]")
        elif isinstance(item, list):
            PROMPT_TOKENS.check(len(item), f"prompt[{i}]")


def markdown_table() -> str:
    """Every bound: the fields it holds, how many, where it is checked, its code under /v1, and why."""
    rows = ["| field | at most | checked for | `code` under `/v1` | why |", "|---|---|---|---|---|"]
    for bound in BOUNDS.values():
        fields = ", ".join(f"`{f}`" for f in bound.fields)
        where = ", ".join(bound.where)
        code = f"`{bound.code}`" if {CHAT_API, COMPLETIONS_API} & set(bound.where) else ""
        why = bound.why.replace("|", "\\|")
        rows.append(f"| {fields} | {bound.limit:,} {bound.unit} | {where} | {code} | {why} |")
    return "\n".join(rows) + "\n"
