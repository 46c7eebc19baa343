"""Structured output and tool calls on the control plane's side, without a cluster: what a request
asks becomes a grammar (or a 400 naming the parameter), and an answer is read back."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest

from controlplane.serving import structured
from controlplane.serving.structured import conversation, read_structure, tool_calls, with_tools
from controlplane.serving.text import InputError, check_messages

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}},
    },
}
DEMO = "platform/demo-model/tokenizer.json"


def _accepts(grammar: str, text: str) -> bool:
    tokenizer = llguidance.LLTokenizer(Path(DEMO).read_text())
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return all(matcher.consume_token(t) for t in tokenizer.tokenize_str(text)) and matcher.is_accepting()


def test_no_structure_asks_for_no_grammar() -> None:
    assert read_structure({}).grammar == ""
    assert read_structure({"response_format": {"type": "text"}}).grammar == ""
    none = read_structure({"tools": [TOOL], "tool_choice": "none"})
    assert none.grammar == "" and none.tools == [TOOL] and not none.calls


def test_a_schema_becomes_a_compact_grammar() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 5}}, "required": ["a"]}
    grammar = read_structure(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    ).grammar
    assert _accepts(grammar, '{"a":5}')
    assert not _accepts(grammar, '{"a":6}')
    assert not _accepts(grammar, '{"a": 5}')  # compact: no free whitespace to pad with
    assert _accepts(read_structure({"response_format": {"type": "json_object"}}).grammar, '{"x":[1]}')


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_or_named_call_is_exactly_one_call(choice: object) -> None:
    structure = read_structure({"tools": [TOOL], "tool_choice": choice})
    call = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
    assert structure.calls and _accepts(structure.grammar, call)
    assert not _accepts(structure.grammar, "It is sunny.")
    assert not _accepts(structure.grammar, call.replace("Paris", "Parisx"))  # maxLength 5


def test_auto_takes_a_call_or_text_that_does_not_start_like_one() -> None:
    grammar = read_structure({"tools": [TOOL]}).grammar
    assert _accepts(grammar, '<tool_call>{"name":"get_weather","arguments":{}}</tool_call>')
    assert _accepts(grammar, "It is sunny.")
    assert not _accepts(grammar, "<b>")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, None),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ],
)
def test_a_wrong_structure_is_refused_naming_the_parameter(body: dict, param: str | None) -> None:
    with pytest.raises(InputError) as refused:
        read_structure(body)
    assert refused.value.param == (param or "response_format")


def test_an_answer_that_is_a_whole_call_is_read_back_in_openai_shape() -> None:
    (call,) = tool_calls('<tool_call>{"name":"get_weather","arguments":{"city":"Rome"}}</tool_call>')
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    assert tool_calls("It is sunny.") is None
    # Text under tool_choice "auto" never starts with "<" (the grammar's): a call after a space is text.
    assert tool_calls(' <tool_call>{"name":"get_weather","arguments":{}}</tool_call>') is None
    assert tool_calls('<tool_call>{"name":"get_weather","argum') is None  # cut by the token limit


def test_tools_go_into_the_system_message_for_a_template_without_them() -> None:
    added = with_tools([{"role": "user", "content": "hi"}], [TOOL])
    assert added[0]["role"] == "system" and '"name":"get_weather"' in added[0]["content"]
    merged = with_tools([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [TOOL])
    assert len(merged) == 2 and merged[0]["content"].startswith("Be brief.\n\n")


CALLED = [
    {"role": "user", "content": "Weather in Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_a_tool_loop_becomes_plain_turns_for_a_template_without_tools() -> None:
    turns, tools = conversation(CALLED, [TOOL], reads_tools=False)
    assert tools is None and turns[0]["role"] == "system"
    assert turns[2] == {
        "role": "assistant",
        "content": '<tool_call>{"name":"get_weather","arguments":{"city":"Rome"}}</tool_call>',
    }
    assert turns[3] == {"role": "user", "content": "<tool_response>sunny</tool_response>"}
    check_messages(turns)


def test_a_tool_loop_goes_as_it_is_to_a_template_that_reads_tools() -> None:
    turns, tools = conversation(CALLED, [TOOL], reads_tools=True)
    assert tools == [TOOL] and len(turns) == 3
    assert turns[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    check_messages(turns, tool_turns=True)
    with pytest.raises(InputError, match=r"messages\[1\].content must be a string"):
        check_messages(CALLED)  # without a template that reads tools, a call is no turn of its own
    with pytest.raises(InputError, match=r"a role of system, user, assistant$"):
        check_messages(CALLED[2:])


def test_a_past_call_that_is_not_one_is_refused_naming_it() -> None:
    broken = [CALLED[0], {**CALLED[1], "tool_calls": [{"function": {"name": "f", "arguments": "{no"}}]}]
    with pytest.raises(InputError) as refused:
        conversation(broken, [TOOL], reads_tools=False)
    assert refused.value.param == "messages[1].tool_calls[0]"


def _optional_properties(n: int) -> dict:
    """An object of ``n`` optional properties: about 8 grammar symbols each, its compile growing
    with their square (the shape that cost seconds in the hostile-tenant report)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "null"} for i in range(n)}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": _optional_properties(5200)},
                }
            },
            "response_format",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": _optional_properties(5200)}}]},
            "tools",
        ),
    ],
)
def test_a_schema_past_a_grammar_limit_is_refused_naming_the_parameter_and_the_limit(body: dict, param: str) -> None:
    # 139 KB, under every byte bound, and compiles to more than max_grammar_size's 40,000 symbols:
    # refused by a count of llguidance's, so the same way on any machine under any load.
    with pytest.raises(InputError) as refused:
        read_structure(body)
    assert refused.value.param == param and refused.value.code == "invalid_schema"
    assert "over the limit max_grammar_size = 40000 grammar symbols" in str(refused.value)
    with pytest.raises(InputError) as again:
        read_structure(body)
    assert str(again.value) == str(refused.value)


def test_a_schema_is_compiled_once_however_often_it_comes() -> None:
    schema = {"type": "object", "properties": {"once": {"type": "integer", "maximum": 7}}, "required": ["once"]}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    compiled_before = structured._CHECKED.misses
    grammars = {read_structure(body).grammar for _ in range(5)}
    assert len(grammars) == 1
    assert structured._CHECKED.misses == compiled_before + 1
