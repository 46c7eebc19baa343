"""The OpenAI API's sampling knobs read at the edge (``controlplane.serving.knobs``): each value
within its bounds becomes ``Generate``'s field, each outside them a 400 naming it, null nothing."""

from __future__ import annotations

import pytest

from controlplane.serving.knobs import check_knobs
from controlplane.serving.text import InputError, Sampling
from inference.wire.generation import Generate


def test_knobs_within_bounds_become_generate_s_fields() -> None:
    body = {
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "frequency_penalty": -2,
        "presence_penalty": 2,
        "logit_bias": {"17": -100, "3": 100, "0": 0.5},
    }
    knobs = check_knobs(body, vocab=64)
    assert knobs == {
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "frequency_penalty": -2.0,
        "presence_penalty": 2.0,
        "logit_bias": [(0, 0.5), (3, 100.0), (17, -100.0)],
    }
    msg = Generate(request_id="r", prompt_ids=[1], max_new_tokens=1, **Sampling(knobs=knobs).request_fields())
    assert (msg.top_k, msg.logit_bias) == (40, [(0, 0.5), (3, 100.0), (17, -100.0)])
    # vLLM's "no top-k" is Transformers' 0; nulls and an empty bias ask for nothing.
    assert check_knobs({"top_k": -1}, vocab=64) == {"top_k": 0}
    assert check_knobs({name: None for name in body} | {"logit_bias": {}}, vocab=64) == {}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"min_p": 1.01}, "min_p"),
        ({"min_p": "0.1"}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"frequency_penalty": 2.01}, "frequency_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"logit_bias": [[3, 1]]}, "logit_bias"),
        ({"logit_bias": []}, "logit_bias"),
        ({"logit_bias": 0}, "logit_bias"),
        ({"repetition_penalty": 10**400}, "repetition_penalty"),
        ({"min_p": 10**400}, "min_p"),
        ({"frequency_penalty": -(10**400)}, "frequency_penalty"),
        ({"logit_bias": {"3": 10**400}}, "logit_bias"),
        ({"logit_bias": {"64": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"logit_bias": {"3": 1, "03": 2}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ],
)
def test_a_knob_outside_its_bounds_is_a_400_naming_it(body: dict, param: str) -> None:
    with pytest.raises(InputError) as refused:
        check_knobs(body, vocab=64)
    assert refused.value.param == param
