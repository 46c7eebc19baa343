"""The request bounds (``controlplane.serving.bounds``): each one refused past its limit and taken
at it, naming its field, before anything is built from the request; the prompt's length counted
as the chat template writes it; the largest generation the bounds allow measured against the
agent link's frame; and docs/limits.md rendered from the declarations."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.test import Client

from controlplane import limits_page
from controlplane.accounts.services import create_api_key
from controlplane.serving import bounds
from controlplane.serving.bounds import BOUNDS, compact_json

pytestmark = pytest.mark.django_db(transaction=True)

CHAT, COMPLETIONS, JOBS, SOCKET = bounds.CHAT_API, bounds.COMPLETIONS_API, bounds.JOBS_API, bounds.CHAT_SOCKET
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions", JOBS: "/api/jobs"}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def fresh_counts():
    cache.clear()  # the throttles' counts
    yield
    cache.clear()


@pytest.fixture
def key() -> str:
    _, secret = create_api_key(user=get_user_model().objects.create_user("user"))
    return secret


def _post(where: str, key: str, body: dict):
    return Client().post(
        PATHS[where], json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
    )


def _described(size: int) -> dict:
    """A schema of ``size`` bytes as compact JSON: a description padded to it."""
    return {"description": "a" * (size - len(compact_json({"description": ""})))}


def _nested(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth - 1):
        schema = {"items": schema}
    return schema


def _chars(size: int, make: Callable[[str], object]) -> object:
    """``make(pad)`` with its pad making it ``size`` characters of compact JSON (as written)."""
    overhead = len(json.dumps(make(""), separators=(",", ":"), ensure_ascii=False))
    return make("a" * (size - overhead))


def _tool(name: str, **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


def _call(arguments: str) -> list[dict]:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}]


def _structure(size: int) -> list[dict]:
    """Two tools whose names and parameters make ``size`` bytes of compact JSON, neither schema past its own bound."""
    first = bounds.SCHEMA_BYTES.limit
    names = len(compact_json("a")) + len(compact_json("b"))
    return [_tool("a", parameters=_described(first)), _tool("b", parameters=_described(size - names - first))]


@dataclass(frozen=True)
class Case:
    """A request that puts ``size`` of what one bound counts in its field, where it is checked."""

    where: str
    body: Callable[[int], dict]
    param: str


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


CASES: dict[str, Case] = {
    "MAX_TOKENS": Case(CHAT, lambda n: {"messages": HI, "max_tokens": n}, "max_tokens"),
    "CHOICES": Case(CHAT, lambda n: {"messages": HI, "n": n}, "n"),
    "STOPS": Case(COMPLETIONS, lambda n: {"prompt": "hi", "stop": ["a"] * n}, "stop"),
    "STOP_CHARS": Case(COMPLETIONS, lambda n: {"prompt": "hi", "stop": ["b", "a" * n]}, "stop[1]"),
    "TOP_LOGPROBS": Case(CHAT, lambda n: {"messages": HI, "logprobs": True, "top_logprobs": n}, "top_logprobs"),
    "COMPLETION_LOGPROBS": Case(COMPLETIONS, lambda n: {"prompt": "hi", "logprobs": n}, "logprobs"),
    "MESSAGES": Case(CHAT, lambda n: {"messages": HI * n}, "messages"),
    "MESSAGES_CHARS": Case(
        CHAT, lambda n: {"messages": _chars(n, lambda pad: [{"role": "user", "content": pad}])}, "messages"
    ),
    "TOOL_ARGUMENTS": Case(
        CHAT, lambda n: {"messages": _call("a" * n)}, "messages[1].tool_calls[0].function.arguments"
    ),
    "TOOLS": Case(CHAT, lambda n: {"messages": HI, "tools": [_tool(f"f{i}") for i in range(n)]}, "tools"),
    "TOOLS_CHARS": Case(
        CHAT, lambda n: {"messages": HI, "tools": _chars(n, lambda pad: [_tool("f", description=pad)])}, "tools"
    ),
    "SCHEMA_BYTES": Case(
        CHAT, lambda n: {"messages": HI, **_schema(_described(n))}, "response_format.json_schema.schema"
    ),
    "STRUCTURE_BYTES": Case(CHAT, lambda n: {"messages": HI, "tools": _structure(n)}, "tools"),
    "SCHEMA_DEPTH": Case(
        CHAT, lambda n: {"messages": HI, "tools": [_tool("f", parameters=_nested(n))]}, "tools[0].function.parameters"
    ),
    "SCHEMA_PROPERTIES": Case(
        CHAT,
        lambda n: {"messages": HI, **_schema({"properties": {f"p{i}": {} for i in range(n)}})},
        "response_format.json_schema.schema",
    ),
    "PROMPTS": Case(COMPLETIONS, lambda n: {"prompt": ["hi"] * n}, "prompt"),
    "PROMPT_CHARS": Case(COMPLETIONS, lambda n: {"prompt": ["hi", "a" * n]}, "prompt[1]"),
    "PROMPT_TOKENS": Case(COMPLETIONS, lambda n: {"prompt": [1] * n}, "prompt"),
    "JOB_PROMPTS": Case(JOBS, lambda n: {"prompts": ["hi"] * n}, "prompts"),
    "CHAT_MESSAGE_CHARS": Case(SOCKET, lambda n: {"content": "a" * n}, "content"),
    "CHAT_MAX_TOKENS": Case(SOCKET, lambda n: {"content": "hi", "max_tokens": n}, "max_tokens"),
}


def test_every_declared_bound_has_a_case_here() -> None:
    assert set(CASES) == set(BOUNDS)
    for name, case in CASES.items():
        assert case.where in BOUNDS[name].where, name


def _chat_socket(message: dict) -> dict:
    """The first event the chat answers ``message`` with."""
    from asgiref.sync import async_to_sync
    from channels.testing import WebsocketCommunicator

    from controlplane.chat.consumers import ChatConsumer

    async def talk() -> dict:
        comm = WebsocketCommunicator(ChatConsumer.as_asgi(), "/ws/chat/")
        comm.scope["user"], _ = await get_user_model().objects.aget_or_create(username="chatter")
        assert (await comm.connect())[0]
        await comm.send_json_to({"type": "send", "conversation": None, **message})
        first = await comm.receive_json_from(timeout=10)
        if first["type"] == "conversation":  # taken: wait for the answer (none: no deployment is ready)
            while (await comm.receive_json_from(timeout=10))["type"] != "done":
                pass
        await comm.disconnect()
        return first

    return async_to_sync(talk)()


@pytest.mark.parametrize("name", list(CASES))
def test_a_field_past_its_bound_is_refused_naming_it_and_one_at_its_bound_is_not(name: str, key: str, settings) -> None:
    """At the bound, the request gets past every bound (to the deployment it names, which does not
    exist: 404; the chat, none ready: the message is taken); one more and it is refused, naming the
    field and the bound, with nothing stored."""
    from channels.layers import channel_layers

    from controlplane.chat.models import Conversation
    from controlplane.serving.models import Job

    bound, case = BOUNDS[name], CASES[name]
    if case.where == SOCKET:
        settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
        channel_layers.backends.clear()
        try:
            assert _chat_socket(case.body(bound.limit))["type"] == "conversation"
            Conversation.objects.all().delete()
            refused = _chat_socket(case.body(bound.limit + 1))
        finally:
            channel_layers.backends.clear()
        assert refused["type"] == "error" and str(bound.limit) in refused["detail"], refused
        assert not Conversation.objects.exists()
        return
    if case.where == JOBS:
        assert _post(JOBS, key, {"model": "m", **case.body(bound.limit)}).status_code == 404  # no such deployment
        refused = _post(JOBS, key, {"model": "m", **case.body(bound.limit + 1)})
        assert refused.status_code == 400 and case.param in refused.json(), refused.content
        assert str(bound.limit) in json.dumps(refused.json()) and not Job.objects.exists()
        return
    within = _post(case.where, key, {"model": "m", **case.body(bound.limit)})
    assert within.status_code == 404 and within.json()["error"]["code"] == "model_not_found", within.content[:300]
    refused = _post(case.where, key, {"model": "m", **case.body(bound.limit + 1)})
    assert refused.status_code == 400, refused.content[:300]
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == case.param, error
    assert case.param in error["message"] and str(bound.limit) in error["message"], error


@pytest.mark.parametrize(
    ("field", "value"),
    [("prompts", ["a" * (bounds.PROMPT_CHARS.limit + 1)]), ("max_tokens", bounds.MAX_TOKENS.limit + 1)],
)
def test_a_job_past_a_bound_is_a_400_naming_the_field_and_no_job_is_made(field: str, value: object, key: str) -> None:
    from controlplane.serving.models import Job

    body = {"model": "m", "prompts": ["hi"], field: value}
    refused = _post(JOBS, key, body)
    assert refused.status_code == 400 and set(refused.json()) == {field}, refused.content[:300]
    assert not Job.objects.exists()


def _ready(model_dir: Path):
    from controlplane.artifacts.services import register_model
    from controlplane.deployments.models import Deployment, DeploymentStatus

    model = register_model(name=model_dir.parent.name, path=str(model_dir))
    return Deployment.objects.create(name="d", model=model, status=DeploymentStatus.READY)


def test_a_schema_of_a_million_and_a_half_characters_is_a_400_before_anything_is_sent(tiny_model, key) -> None:
    """It used to travel inside a Generate down main's agent link and close it (1009) for every user.
    The deployment is ready but has no main: a request that gets past the bounds goes on toward the
    cluster and is answered 503; this one is refused first, naming the schema and the bound."""
    _ready(tiny_model)

    def ask(schema: dict):
        return _post(CHAT, key, {"model": "d", "messages": HI, "max_tokens": 4, **_schema(schema)})

    huge = ask({"const": "x" * 1_500_000})
    assert huge.status_code == 400, huge.content[:300]
    error = huge.json()["error"]
    assert error["param"] == "response_format.json_schema.schema" and error["code"] == "too_large", error
    assert str(bounds.SCHEMA_BYTES.limit) in error["message"]
    small = ask({"const": "x"})
    assert small.status_code == 503 and small.json()["error"]["code"] == "model_not_ready", small.content


# A template that reads tools, as a tool-calling model's does: the tools and past calls are
# written into the prompt by the template, beside the messages' contents.
TOOLS_TEMPLATE = (
    "{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function | tojson }}</call>{% endfor %}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
def tool_model(tiny_model: Path, tmp_path: Path) -> Path:
    model = tmp_path / "tools" / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return model


@pytest.mark.parametrize(
    "ask",
    [
        {"messages": HI, "tools": [_tool(f"f{i}", description="d" * 1000) for i in range(12)]},
        {"messages": [*_call(json.dumps({"q": "x" * 12_000})), {"role": "tool", "content": "sunny"}]},
    ],
    ids=["tools", "past-call-arguments"],
)
def test_a_prompt_the_template_makes_too_long_is_refused_from_its_characters_before_tokenizing(
    ask: dict, tool_model: Path, key: str
) -> None:
    """The messages' contents fit the tiny model's context easily; the tools (or a past call's
    arguments) the template writes beside them do not. The prompt is counted as the template
    writes it, in characters, so it is refused without being tokenized (the message counts
    characters; a tokenized prompt's refusal counts tokens)."""
    from controlplane.serving.structured import conversation, read_structure
    from controlplane.serving.text import chat_text, tokenizer_for

    _ready(tool_model)
    tokenizer = tokenizer_for(str(tool_model))
    assert tokenizer.template_reads_tools
    turns, tools = conversation(ask["messages"], read_structure(ask).tools, True)
    rendered = chat_text(tokenizer, turns, tools)
    assert sum(len(m.get("content") or "") for m in ask["messages"]) < 100  # the contents alone are short
    response = _post(CHAT, key, {"model": "d", "max_tokens": 8, **ask})
    assert response.status_code == 400, response.content[:300]
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages", error
    assert f"the prompt has {len(rendered)} characters" in error["message"], error


def test_the_chat_counts_its_conversation_as_the_template_writes_it_before_tokenizing(tiny_model) -> None:
    """1,500 one-character turns are 1,500 characters of content and over 12,000 as the prompt
    (``role: content`` lines): refused from their characters, not tokenized first."""
    from controlplane.chat.consumers import _prepare
    from controlplane.serving.text import InputError, chat_text, tokenizer_for

    _ready(tiny_model)
    history = [{"role": ("user", "assistant")[i % 2], "content": "a"} for i in range(1499)]
    rendered = chat_text(tokenizer_for(str(tiny_model)), history)
    with pytest.raises(InputError) as refused:
        _prepare(history, 8)
    assert refused.value.code == "context_length_exceeded"
    assert f"the prompt has {len(rendered)} characters" in str(refused.value) and "new conversation" in str(
        refused.value
    )


def test_the_chat_holds_its_conversation_to_the_messages_bounds(tiny_model) -> None:
    from controlplane.chat.consumers import _prepare
    from controlplane.serving.text import InputError

    _ready(tiny_model)
    history = [{"role": "user", "content": "a"}] * (bounds.MESSAGES.limit + 1)
    with pytest.raises(InputError) as refused:
        _prepare(history, 8)
    assert refused.value.param == "messages" and str(bounds.MESSAGES.limit) in str(refused.value)


def test_the_largest_generation_the_bounds_allow_fits_half_the_agent_links_default_frame() -> None:
    """The worst case for the link: schemas made of quotes (each escaped twice on the way), the
    response schema and 128 tools filling every structure bound, a prompt that fills Mixtral's
    context with six-digit token ids, and a logit bias of as many tokens as it may name, each
    six digits with the longest bias."""
    from controlplane.serving.structured import read_structure
    from inference.wire.generation import MAX_LOGIT_BIAS, MAX_TOP_K, Generate
    from inference.wire.grammar import MAX_GRAMMAR_BYTES

    def quoted(size: int) -> dict:
        return {"description": '"' * ((size - len(compact_json({"description": ""}))) // 2)}

    schema = quoted(bounds.SCHEMA_BYTES.limit)
    names = [f"f{i:03d}" for i in range(bounds.TOOLS.limit)]
    room = bounds.STRUCTURE_BYTES.limit - len(compact_json(schema)) - sum(len(compact_json(n)) for n in names)
    tools = [_tool(name, parameters=quoted(room // len(names))) for name in names]
    body = {"messages": HI, "tools": tools, **_schema(schema)}
    bounds.check_openai_request(body, chat=True)  # within every bound...
    with pytest.raises(ValueError, match="more than the"):  # ...and at them
        bounds.check_openai_request({**body, **_schema(quoted(bounds.SCHEMA_BYTES.limit + 2))}, chat=True)
    grammar = read_structure(body).grammar
    assert len(grammar.encode()) <= MAX_GRAMMAR_BYTES
    mixtral_context = 32_768
    request = Generate(
        request_id="0" * 32,
        prompt_ids=[151_643] * mixtral_context,
        max_new_tokens=bounds.MAX_TOKENS.limit,
        do_sample=True,
        seed=2**63 - 1,
        user="1234567890",
        logprobs=True,
        top_logprobs=bounds.TOP_LOGPROBS.limit,
        grammar=grammar,
        deployment="d" * 64,
        logit_bias=[(151_000 + i, -99.99999999999999) for i in range(MAX_LOGIT_BIAS)],
        top_k=MAX_TOP_K,
        min_p=0.0123456789,
        repetition_penalty=1.2345678901,
        frequency_penalty=-1.9999999999999,
        presence_penalty=-1.9999999999999,
    )
    frame = len(json.dumps(request.to_json()))  # as the agent consumer sends it (channels' send_json)
    assert frame <= 0.55 * 2**20, frame


def test_the_limits_page_is_rendered_from_its_template_and_the_declarations() -> None:
    assert limits_page.PAGE.read_text() == limits_page.render(), "run python -m controlplane.limits_page"


@pytest.mark.parametrize(
    "directive", ["{{ value: controlplane.serving.bounds:NOPE }}", "{{ nope }}", "{{ setting: MAX_REQUEST_BYTES | x }}"]
)
def test_a_template_directive_that_names_nothing_is_an_error_not_a_blank(directive: str) -> None:
    with pytest.raises(limits_page.RenderError):
        limits_page.render(directive)
