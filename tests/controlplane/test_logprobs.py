"""Logprobs in OpenAI's two shapes, from main's entries, with the demo model's tokenizer (a
byte-level BPE, whose tokens may hold part of a character); and main's bound on alternatives.

Their values against Transformers are ``tests/inference/runtime/engine/test_engine.py``'s and, through a live cluster
and the official client, ``test_serving_e2e.py``'s.
"""

from __future__ import annotations

import pytest

from controlplane.serving.logprobs import (
    Scored,
    chat_logprobs,
    chat_top_logprobs,
    completion_logprobs,
    legacy_logprobs,
    prompt_tokens,
    token_text,
)
from controlplane.serving.text import InputError
from controlplane.serving.tokenizer import TextTokenizer
from inference.runtime.engine.scheduler import request_problem
from inference.wire.generation import Generate, TokenLogprob
from tests.paths import REPO

DEMO = REPO / "platform" / "demo-model"


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(DEMO)


def test_a_token_holding_part_of_a_character_is_written_as_its_bytes(tokenizer: TextTokenizer) -> None:
    first, second = tokenizer.encode("é", add_special_tokens=False)  # two byte tokens: 0xc3 0xa9
    assert token_text(tokenizer, first) == ("bytes:\\xc3", [0xC3])
    assert token_text(tokenizer, second) == ("bytes:\\xa9", [0xA9])
    (space_word,) = tokenizer.encode(" w", add_special_tokens=False)
    assert token_text(tokenizer, space_word) == (" w", [32, 119])  # the leading space stays


def test_the_chat_shape_lists_each_token_with_its_alternatives(tokenizer: TextTokenizer) -> None:
    h, i = tokenizer.encode("Hello world", add_special_tokens=False)[:2]
    entry = TokenLogprob(h, -0.5, [(h, -0.5), (i, -1.25)])
    shaped = chat_logprobs(tokenizer, [Scored(h, entry, 0)])
    text = token_text(tokenizer, h)[0]
    assert shaped["refusal"] is None
    assert shaped["content"] == [
        {
            "token": text,
            "logprob": -0.5,
            "bytes": list(tokenizer.token_bytes(h)),
            "top_logprobs": [
                {"token": text, "logprob": -0.5, "bytes": list(tokenizer.token_bytes(h))},
                {"token": token_text(tokenizer, i)[0], "logprob": -1.25, "bytes": list(tokenizer.token_bytes(i))},
            ],
        }
    ]


def test_the_legacy_shape_echoes_the_prompt_and_always_lists_the_chosen_token(tokenizer: TextTokenizer) -> None:
    prompt = "Mixture of experts"
    ids, starts = tokenizer.encode_with_offsets(prompt)
    entries = [TokenLogprob(t, -float(n + 1), [(5, -0.1), (6, -0.2)]) for n, t in enumerate(ids[1:])]
    echoed = prompt_tokens(ids, starts, entries)
    answer = Scored(7, TokenLogprob(7, -3.0, [(7, -3.0), (5, -3.5)]), len(prompt))
    shaped = legacy_logprobs(tokenizer, [*echoed, answer], 1)
    assert shaped["tokens"] == [token_text(tokenizer, t)[0] for t in [*ids, 7]]
    assert shaped["token_logprobs"] == [None, *(e.logprob for e in entries), -3.0]
    assert shaped["top_logprobs"][0] is None  # nothing predicts the prompt's first token
    # The likeliest one (logprobs=1) and the chosen one, which is not among them.
    assert shaped["top_logprobs"][1] == {token_text(tokenizer, 5)[0]: -0.1, token_text(tokenizer, ids[1])[0]: -1.0}
    assert shaped["top_logprobs"][-1] == {token_text(tokenizer, 7)[0]: -3.0}
    assert shaped["text_offset"][0] == 0 and shaped["text_offset"][-1] == len(prompt)
    assert shaped["text_offset"] == sorted(shaped["text_offset"])
    with pytest.raises(ValueError, match="prompt logprobs"):
        prompt_tokens(ids, starts, entries[:-1])


@pytest.mark.parametrize(
    ("logprobs", "top", "expected"),
    [(None, None, None), (False, None, None), (True, None, 0), (True, 20, 20), (False, 0, None)],
)
def test_chat_asks_for_alternatives_only_with_logprobs(logprobs, top, expected) -> None:
    assert chat_top_logprobs(logprobs, top) == expected


@pytest.mark.parametrize(
    ("logprobs", "top"), [(True, 21), (True, -1), (True, 2.5), ("yes", None), (None, 3), (False, 1)]
)
def test_chat_logprobs_out_of_bounds_are_refused_by_name(logprobs, top) -> None:
    with pytest.raises(InputError) as refused:
        chat_top_logprobs(logprobs, top)
    assert refused.value.param in ("logprobs", "top_logprobs")


@pytest.mark.parametrize("value", [6, -1, True, "2", 1.5])
def test_completion_logprobs_past_5_are_refused(value) -> None:
    with pytest.raises(InputError) as refused:
        completion_logprobs(value)
    assert refused.value.param == "logprobs"
    assert completion_logprobs(5) == 5 and completion_logprobs(None) is None


def test_main_refuses_more_than_20_alternatives() -> None:
    ask = Generate(request_id="r", prompt_ids=[1, 2], max_new_tokens=2, logprobs=True, top_logprobs=21)
    assert "top_logprobs must be from 0 to 20" in request_problem(ask, vocab=10, context=16)
    assert (
        request_problem(
            Generate(request_id="r", prompt_ids=[1, 2], max_new_tokens=2, top_logprobs=20), vocab=10, context=16
        )
        == ""
    )
