"""``/v1/completions`` with token-id prompts, as lm-evaluation-harness's ``local-completions`` sends
them: OpenAI's four prompt forms, ids checked against the model's vocabulary before anything
starts, and the ids handed on as they are (never decoded and encoded again).

The answers' values through a live cluster (echo logprobs equal to Transformers') are
``test_serving_e2e.py``'s; lm_eval itself against ``manage.py up`` is ``test_lm_eval.py``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from controlplane.accounts.services import create_api_key
from controlplane.serving.openai_protocol import parse_ask
from controlplane.serving.text import InputError, check_token_ids, decode_with_starts, prompt_list
from controlplane.serving.tokenizer import TextTokenizer
from tests.paths import REPO

DEMO = REPO / "platform" / "demo-model"


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(DEMO)


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("text", ["text"]),
        (["a", "b"], ["a", "b"]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5, 6], [7]], [[5, 6], [7]]),
    ],
)
def test_the_four_forms_of_a_prompt_are_a_list_of_prompts(prompt, prompts) -> None:
    assert prompt_list(prompt) == prompts


@pytest.mark.parametrize("prompt", [None, [], [[]], [5, "a"], [[5], 6], [True, 1], [[5], [False]], [[[5]]], 5.0])
def test_a_prompt_in_none_of_the_forms_is_refused_by_name(prompt) -> None:
    with pytest.raises(InputError, match="a list of token ids or a list of lists of token ids") as refused:
        prompt_list(prompt)
    assert refused.value.param == "prompt"


def test_an_id_past_the_vocabulary_is_refused_with_the_id_and_where_it_is() -> None:
    check_token_ids([[0, 4095]], 4096)
    with pytest.raises(InputError, match=r"token id 4096 \(position 1\) .* ids 0 to 4095"):
        check_token_ids([[0, 4096]], 4096)
    with pytest.raises(InputError, match=r"token id -1 \(prompt 1, position 0\)"):
        check_token_ids([[3], [-1]], 4096)


def test_a_token_prompts_text_is_its_decoding_with_each_token_where_its_text_starts(tokenizer: TextTokenizer) -> None:
    text = "Un café, s'il vous plaît: 3 €"
    ids = tokenizer.encode(text)  # <s> first, and characters split over byte tokens
    decoded, starts = decode_with_starts(tokenizer, ids)
    assert decoded == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert starts == tokenizer.encode_with_offsets(text)[1]  # where the tokenizer itself puts them
    # A character cut in the middle: the text so far, then U+FFFD, as decoding gives it.
    cut = [*tokenizer.encode("caf", add_special_tokens=False), tokenizer.encode("é", add_special_tokens=False)[0]]
    decoded, starts = decode_with_starts(tokenizer, cut)
    assert decoded == tokenizer.decode(cut) == "caf\ufffd" and starts[-1] == 3


# --- through the view: what the request becomes before anything is sent to main -----------------


@pytest.fixture
def ready(transactional_db, tiny_model: Path) -> str:
    """An API key, and a deployment "d" of the tiny model marked ready with no cluster behind it."""
    from controlplane.artifacts.services import register_model
    from controlplane.deployments.models import Deployment, DeploymentStatus

    model = register_model(name="tiny", path=str(tiny_model))
    Deployment.objects.create(name="d", model=model, status=DeploymentStatus.READY, max_per_user=8)
    return create_api_key(user=get_user_model().objects.create_user("user"))[1]


def ask(key: str, body: dict):
    body = json.dumps({"model": "d", "max_tokens": 1, **body})
    return Client().post("/v1/completions", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}")


def test_token_ids_reach_main_as_they_are_even_where_encoding_their_text_would_differ(
    ready: str, tiny_model: Path
) -> None:
    tokenizer = TextTokenizer(tiny_model)
    word = tokenizer.encode("the", add_special_tokens=False)
    letters = [t for c in "the" for t in tokenizer.encode(c, add_special_tokens=False)]
    assert len(word) < len(letters)  # the tokenizer merges them: encoding the text again would too
    parsed = parse_ask({"model": "d", "prompt": [letters, word], "max_tokens": 0, "echo": True, "logprobs": 1}, False)
    assert parsed.prompts == [letters, word]
    assert parsed.texts == ["the", "the"]
    assert parsed.starts == [[0, 1, 2], tokenizer.encode_with_offsets("the", add_special_tokens=False)[1]]
    assert parsed.prompt_only and parsed.logprobs == 1
    one = parse_ask({"model": "d", "prompt": letters, "max_tokens": 1}, False)
    assert one.prompts == [letters]


def test_an_id_past_the_models_vocabulary_is_a_400_naming_it_and_nothing_starts(ready: str) -> None:
    from controlplane.artifacts.models import ModelArtifact

    vocab = ModelArtifact.objects.get(name="tiny").summary["vocab_size"]
    refused = ask(ready, {"prompt": [[1, 2], [1, vocab]], "echo": True, "logprobs": 1})
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert error["param"] == "prompt" and f"token id {vocab} (prompt 1, position 1)" in error["message"]
    for bad in ([-1], [1, True], [[1], "a"], []):
        assert ask(ready, {"prompt": bad}).json()["error"]["param"] == "prompt"
    context = ModelArtifact.objects.get(name="tiny").summary["max_position_embeddings"]
    too_long = ask(ready, {"prompt": [1] * context})  # with max_tokens 1: one past the context
    assert too_long.json()["error"]["code"] == "context_length_exceeded", too_long.content
    # Within the vocabulary: past the parse, to the cluster (this deployment has no main: 503).
    within = ask(ready, {"prompt": [1, vocab - 1], "echo": True, "logprobs": 1, "seed": 1234, "temperature": 0})
    assert within.status_code == 503 and within.json()["error"]["code"] == "model_not_ready", within.content
