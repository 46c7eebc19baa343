"""What the OpenAI-compatible API does with each body parameter: one declaration per endpoint.

Every parameter of OpenAI's chat completions and (legacy) completions requests is listed once,
with what this API does with it:

- ``HONOURED``: it does what OpenAI documents (its value is checked where the request is read,
  ``openai_protocol.parse_ask``);
- ``NEUTRAL_ONLY``: the feature is not offered, so only the value that asks for nothing (and
  null) is accepted, e.g. ``frequency_penalty: 0``; any other value is a 400 naming it;
- ``EXTENSIONS``: not OpenAI's, but what vLLM and llama.cpp's server take, honoured too;
- ``NOT_YET``: planned, refused with "not supported yet" meanwhile, but for its neutral value
  where it has one (none is at present).

A parameter that is in neither list, OpenAI's or ours, is a 400 naming it too: nothing a client
sends is silently ignored. Refusals are ``InputError`` with ``code="unsupported_parameter"``
and the parameter as ``param``. The docs' compatibility table is rendered from these
declarations (``python -m controlplane.serving.parameters``; a test keeps the page current,
and another checks that the declarations name exactly the parameters of the installed
``openai`` client's request types).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass

from inference.wire.generation import MAX_LOGIT_BIAS

from .bounds import CHOICES, COMPLETION_LOGPROBS, STOP_CHARS, STOPS, TOP_LOGPROBS
from .text import InputError

UNSUPPORTED = "unsupported_parameter"


class Support(enum.Enum):
    HONOURED = "honoured"
    NEUTRAL_ONLY = "neutral value only"
    NOT_YET = "not supported yet"


@dataclass(frozen=True)
class Parameter:
    """One request parameter: what is done with it, why, and what it takes.

    ``accepts``: for a refused one, the values taken besides null (they ask for nothing); for an
    honoured one, a type its value must have where no other check reads it (an opaque label).
    ``example``: the body fields of a request that uses it (tests send it; an honoured one is
    answered, a refused one refused).
    """

    support: Support
    note: str
    accepts: tuple[object, ...] | type = ()
    example: Mapping[str, object] | None = None

    def takes(self, value: object) -> bool:
        """Whether ``value`` passes the declaration (an honoured one's value is checked further)."""
        if value is None:
            return True
        if isinstance(self.accepts, type):
            return isinstance(value, self.accepts)
        if self.support is Support.HONOURED:
            return True
        return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in self.accepts)


H, N, Y = Support.HONOURED, Support.NEUTRAL_ONLY, Support.NOT_YET
LABEL = "an opaque label: checked to be a string; it changes nothing in the answer"

# The examples' schema and tool (the parameter walk sends them).
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"]}
_TOOL = {"type": "function", "function": {"name": "f", "parameters": _SCHEMA}}

# Honoured by both endpoints, the same way.
_COMMON: dict[str, Parameter] = {
    "model": Parameter(H, "a deployment's name (404 `model_not_found` otherwise)"),
    "max_tokens": Parameter(
        H, "prompt + `max_tokens` past the context is a 400 `context_length_exceeded`", example={"max_tokens": 3}
    ),
    "temperature": Parameter(H, "0 is greedy, token-identical to Transformers", example={"temperature": 0.5}),
    "top_p": Parameter(H, "nucleus sampling, as Transformers' `generate`", example={"top_p": 0.9}),
    "seed": Parameter(H, "the same seed samples the same answer", example={"seed": 7}),
    "stop": Parameter(
        H,
        f"a string or up to {STOPS.limit}, each at most {STOP_CHARS.limit} characters; ends the answer and the "
        "generation on the cluster",
        example={"stop": "."},
    ),
    "n": Parameter(
        H,
        f"each choice a generation of its own in the batch; at most {CHOICES.limit} and the deployment's "
        "`max_per_user`",
        example={"n": 2},
    ),
    "stream": Parameter(H, "server-sent events ending in `data: [DONE]`", example={"stream": True}),
    "stream_options": Parameter(
        H,
        "`include_usage` (with `stream`); no other option",
        example={"stream": True, "stream_options": {"include_usage": True}},
    ),
    "user": Parameter(H, f"{LABEL} (fairness and limits go by the API key's user)", str, example={"user": "u-1"}),
    "frequency_penalty": Parameter(
        H,
        "-2 to 2: each token's logit less its count in the answer so far times this, greedy or sampled",
        example={"frequency_penalty": 0.5},
    ),
    "presence_penalty": Parameter(
        H,
        "-2 to 2: each token's logit less this once it is in the answer so far, greedy or sampled",
        example={"presence_penalty": 0.5},
    ),
    "logit_bias": Parameter(
        H,
        f"token id to -100 ... 100, added to its logit; at most {MAX_LOGIT_BIAS} ids, each the model's",
        example={"logit_bias": {"3": 5}},
    ),
}

# Not OpenAI's: what vLLM and llama.cpp's server take (and chat front ends expose), on both endpoints.
EXTENSIONS: dict[str, Parameter] = {
    "top_k": Parameter(
        H,
        "not OpenAI's: sampling from the k most likely tokens, as Transformers' `generate` (0 or -1: none; "
        "unset: the model's generation config)",
        example={"top_k": 5},
    ),
    "min_p": Parameter(
        H,
        "not OpenAI's: 0 to 1, sampling from tokens at least this times as likely as the likeliest, as "
        "Transformers' `generate`",
        example={"min_p": 0.1},
    ),
    "repetition_penalty": Parameter(
        H,
        "not OpenAI's: above 0, Transformers' repetition penalty over prompt and answer (1: none), greedy or sampled",
        example={"repetition_penalty": 1.2},
    ),
}

CHAT: dict[str, Parameter] = {
    "messages": Parameter(
        H,
        "through the model's chat template; roles system, user, assistant (string content, or `tool_calls`) and tool",
    ),
    **_COMMON,
    **EXTENSIONS,
    "max_completion_tokens": Parameter(H, "as `max_tokens` (and wins over it)", example={"max_completion_tokens": 3}),
    "logprobs": Parameter(
        H, "each token's logprob: main's log-softmax of the raw logits, before sampling", example={"logprobs": True}
    ),
    "top_logprobs": Parameter(
        H,
        f"0 to {TOP_LOGPROBS.limit} alternatives per token, with `logprobs: true`",
        example={"logprobs": True, "top_logprobs": 3},
    ),
    "response_format": Parameter(
        H,
        "`text`, `json_object` or `json_schema`: decoding keeps to the schema (always, `strict` or not), compact JSON",
        example={"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": _SCHEMA}}},
    ),
    "tools": Parameter(
        H,
        "functions; a call's `arguments` keep to its `parameters` schema; through the chat template's "
        "`tools`, or a system message where the template has none",
        example={"tools": [_TOOL]},
    ),
    "tool_choice": Parameter(
        H,
        "`auto` (a call or text), `none`, `required` or a named function (exactly one call)",
        example={"tools": [_TOOL], "tool_choice": "required"},
    ),
    "functions": Parameter(N, "the deprecated form of `tools`: send `tools`"),
    "function_call": Parameter(N, "the deprecated form of `tool_choice`: send `tool_choice`", ("none",)),
    "parallel_tool_calls": Parameter(
        H, "at most one call an answer, either way", bool, example={"tools": [_TOOL], "parallel_tool_calls": False}
    ),
    "prompt_cache_key": Parameter(H, f"{LABEL} (one main: nothing to route)", str, example={"prompt_cache_key": "k"}),
    "safety_identifier": Parameter(H, LABEL, str, example={"safety_identifier": "end-user-1"}),
    "service_tier": Parameter(N, "one tier", ("auto", "default")),
    "store": Parameter(N, "answers are not stored for distillation or evals", (False,)),
    "metadata": Parameter(N, "kept only with `store`", ({},)),
    "modalities": Parameter(N, "text only", (["text"],)),
    "audio": Parameter(N, "text only"),
    "prediction": Parameter(N, "main does not draft from a predicted output"),
    "reasoning_effort": Parameter(N, "the model has no reasoning setting"),
    "verbosity": Parameter(N, "the model has no verbosity setting"),
    "web_search_options": Parameter(N, "no web search"),
    "moderation": Parameter(N, "no moderation"),
    "prompt_cache_retention": Parameter(N, "no prompt cache kept past main's memory", ("in-memory",)),
    "prompt_cache_options": Parameter(N, "no prompt cache settings"),
}

COMPLETIONS: dict[str, Parameter] = {
    "prompt": Parameter(
        H,
        "a string, a list of strings, a list of token ids or a list of such lists, each a generation of its own; "
        "ids go to the model as they are, an id past its vocabulary a 400 naming it",
    ),
    **_COMMON,
    **EXTENSIONS,
    "logprobs": Parameter(
        H,
        f"0 to {COMPLETION_LOGPROBS.limit} alternatives per token, and each token's logprob: main's log-softmax "
        "of the raw logits, before sampling",
        example={"logprobs": 2},
    ),
    "echo": Parameter(
        H,
        "the prompt comes first in the text (and in the logprobs, its first token's null); with `max_tokens: 0` "
        "the prompt alone",
        example={"echo": True},
    ),
    "best_of": Parameter(N, "no server-side ranking of extra samples", (1,)),
    "suffix": Parameter(N, "no insertion: text only follows the prompt", ("",)),
}

_FORMAT = {"type": "json_schema", "name": "n", "schema": _SCHEMA}
_FUNCTION = {"type": "function", "name": "f", "parameters": _SCHEMA, "strict": True}
RESPONSES: dict[str, Parameter] = {
    "model": Parameter(H, "a deployment's name (404 `model_not_found` otherwise)"),
    "input": Parameter(
        H,
        "a string, or a list of messages (user, system, developer, assistant; text content), `function_call` "
        "items and their `function_call_output`; through the model's chat template",
    ),
    "instructions": Parameter(H, "a system message before the input", example={"instructions": "Be brief."}),
    "max_output_tokens": Parameter(H, "as the chat's `max_tokens`", example={"max_output_tokens": 3}),
    "temperature": Parameter(H, "0 is greedy, token-identical to Transformers", example={"temperature": 0.5}),
    "top_p": Parameter(H, "nucleus sampling, as Transformers' `generate`", example={"top_p": 0.9}),
    "text": Parameter(
        H,
        "`format`: `text`, `json_object` or `json_schema`, through the chat's grammar path and bounds",
        example={"text": {"format": _FORMAT}},
    ),
    # Declarations, one per line: alike CHAT's tools and tool_choice by shape, on purpose.
    "tools": Parameter(
        H,
        "function tools, as the chat's; a built-in tool (web search, file search, computer use, code "
        "interpreter, ...) is a 400 naming it",
        example={"tools": [_FUNCTION]},
    ),
    "tool_choice": Parameter(
        H,
        "`auto`, `none`, `required` or a function by name",
        example={"tools": [_FUNCTION], "tool_choice": "required"},
    ),
    "parallel_tool_calls": Parameter(
        H, "at most one call an answer, either way", bool, example={"tools": [_FUNCTION], "parallel_tool_calls": False}
    ),
    "stream": Parameter(
        H, "the Responses events, `response.created` to `response.completed`", example={"stream": True}
    ),
    "user": Parameter(H, f"{LABEL} (fairness and limits go by the API key's user)", str, example={"user": "u-1"}),
    "safety_identifier": Parameter(H, LABEL, str, example={"safety_identifier": "end-user-1"}),
    "prompt_cache_key": Parameter(H, f"{LABEL} (one main: nothing to route)", str, example={"prompt_cache_key": "k"}),
    **EXTENSIONS,
    "previous_response_id": Parameter(
        H,
        "continues a stored response of yours (its input and output, not its instructions); another's, or one "
        "expired, is a 404 `previous_response_not_found`",
    ),
    "store": Parameter(
        H,
        "true unless false, as OpenAI's: the response is kept 30 days for `previous_response_id`, for you only, "
        "your newest 100",
        example={"store": False},
    ),
    "conversation": Parameter(N, "no conversation objects: chain responses with `previous_response_id`"),
    "prompt": Parameter(N, "no stored prompts"),
    "background": Parameter(N, "answers run while the request is open", (False,)),
    "background_options": Parameter(N, "answers run while the request is open"),
    "include": Parameter(N, "no extra output data", ([],)),
    "top_logprobs": Parameter(N, "no logprobs in this endpoint yet (the chat's `logprobs` has them)", (0,)),
    "reasoning": Parameter(N, "the model has no reasoning setting"),
    "max_tool_calls": Parameter(N, "at most one call an answer"),
    "truncation": Parameter(N, "input past the context is a 400, never cut", ("disabled",)),
    "metadata": Parameter(N, "kept only with `store`", ({},)),
    "service_tier": Parameter(N, "one tier", ("auto", "default")),
    "stream_options": Parameter(N, "no stream options"),
    "context_management": Parameter(N, "no context management: input past the context is a 400"),
    "prompt_cache_retention": Parameter(N, "no prompt cache kept past main's memory", ("in-memory",)),
    "prompt_cache_options": Parameter(N, "no prompt cache settings"),
    "moderation": Parameter(N, "no moderation"),
    "image": Parameter(N, "text only"),
    "access_programs": Parameter(N, "no access programs"),
}

ENDPOINTS = {"chat.completions": CHAT, "completions": COMPLETIONS, "responses": RESPONSES}


def check_parameters(body: Mapping[str, object], declared: Mapping[str, Parameter], endpoint: str) -> None:
    """Refuse, naming it, the first parameter of ``body`` that this API would not honour."""
    for name, value in body.items():
        parameter = declared.get(name)
        if parameter is None:
            raise InputError(
                f"{name!r:.60} is not a parameter of OpenAI's {endpoint} API; this one honours "
                f"{', '.join(n for n, p in declared.items() if p.support is Support.HONOURED)}",
                param=name[:60],
                code=UNSUPPORTED,
            )
        if parameter.takes(value):
            continue
        if parameter.support is Support.HONOURED:
            raise InputError(f"{name} must be a {parameter.accepts.__name__}: {parameter.note}", param=name)
        taken = " or ".join(_shown(v) for v in parameter.accepts)
        neutral = f"; it is accepted as {taken} (or null), which asks for nothing" if taken else "; leave it out"
        status = "not supported yet" if parameter.support is Support.NOT_YET else "not supported"
        raise InputError(f"{name} is {status} ({parameter.note}){neutral}", param=name, code=UNSUPPORTED)


def _shown(value: object) -> str:
    return json.dumps(value)


def markdown_table(declared: Mapping[str, Parameter]) -> str:
    """One endpoint's parameters, what is done with each, and what a refused one accepts."""
    rows = ["| parameter | here | notes |", "|---|---|---|"]
    for name, parameter in declared.items():
        note = parameter.note.replace("|", "\\|")
        if parameter.support is not Support.HONOURED:
            taken = ", ".join(f"`{_shown(v)}`" for v in parameter.accepts)
            note += f"; accepted: null{', ' + taken if taken else ''}"
        rows.append(f"| `{name}` | {parameter.support.value} | {note} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    for endpoint, declared in ENDPOINTS.items():
        print(f"<!-- parameters-table:{endpoint}:start -->")
        print(markdown_table(declared), end="")
        print(f"<!-- parameters-table:{endpoint}:end -->")
