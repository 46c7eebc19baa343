"""The OpenAI API's parameter declarations: complete against OpenAI's own request types, the
docs' table rendered from them, and a request checked against them.

The walk of every parameter against a live cluster is ``check_every_parameter_is_honoured_or_refused``
in ``test_serving_e2e.py``.
"""

from __future__ import annotations

import re

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from controlplane.serving.parameters import (
    CHAT,
    COMPLETIONS,
    ENDPOINTS,
    EXTENSIONS,
    RESPONSES,
    Support,
    check_parameters,
    markdown_table,
)
from controlplane.serving.text import InputError
from tests.paths import REPO

PAGE = REPO / "docs" / "using" / "openai-api.md"


@pytest.mark.parametrize(
    ("declared", "spec"),
    [
        (CHAT, chat_create_params.CompletionCreateParamsBase),
        (COMPLETIONS, completion_create_params.CompletionCreateParamsBase),
        (RESPONSES, response_create_params.ResponseCreateParamsBase),
    ],
    ids=["chat", "completions", "responses"],
)
def test_each_endpoint_declares_exactly_the_parameters_of_openais_request(declared, spec) -> None:
    # ``stream`` is declared on the client's streaming and non-streaming subtypes; the extensions
    # (vLLM's and llama.cpp's) are not OpenAI's, and none of them is.
    assert set(declared) == set(spec.__annotations__) | {"stream"} | set(EXTENSIONS)
    assert not set(EXTENSIONS) & set(spec.__annotations__)


# Honoured with no example the walk can send alone: what every request has, and a stored response's id
# (check_responses_api in test_serving_e2e.py chains two responses).
NO_EXAMPLE = ("model", "messages", "prompt", "input", "previous_response_id")


def test_every_refused_parameter_says_why_and_every_honoured_one_has_an_example_or_is_required() -> None:
    for declared in ENDPOINTS.values():
        for name, parameter in declared.items():
            assert parameter.note, name
            if parameter.support is Support.HONOURED:
                assert parameter.example is not None or name in NO_EXAMPLE, name
            else:
                assert parameter.example is None and not isinstance(parameter.accepts, type), name


def test_the_docs_tables_are_the_declarations() -> None:
    page = PAGE.read_text()
    for endpoint, declared in ENDPOINTS.items():
        table = page.split(f"<!-- parameters-table:{endpoint}:start -->\n")[1].split(
            f"<!-- parameters-table:{endpoint}:end -->"
        )[0]
        assert table == markdown_table(declared), "run python -m controlplane.serving.parameters and paste its tables"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"store": True}, "store", "accepted as false (or null)"),
        ({"functions": [{"name": "f"}]}, "functions", "send `tools`"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a bool"),
        ({"top_a": 5}, "top_a", "not a parameter of OpenAI's chat completions API"),
        ({"user": 5}, "user", "must be a str"),
    ],
)
def test_a_parameter_not_honoured_is_refused_by_name(body: dict, param: str, words: str) -> None:
    with pytest.raises(InputError, match=re.escape(words)) as refused:
        check_parameters({"model": "m", **body}, CHAT, "chat completions")
    assert refused.value.param == param
    assert refused.value.code == "unsupported_parameter" or param in ("user", "parallel_tool_calls")


def test_neutral_values_and_nulls_pass() -> None:
    body = {
        "model": "m",
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "store": False,
        "service_tier": "auto",
        "tools": None,
        "user": "someone",
    }
    check_parameters(body, CHAT, "chat completions")
    check_parameters({"model": "m", "best_of": 1, "suffix": None, "echo": True}, COMPLETIONS, "completions")
