"""Constrained decoding in main's sampler, without a cluster: the tiny model under a JSON schema.

The mask goes in before the logits processors, so greedy decoding is the argmax over the
tokens the grammar allows; a random-weighted model keeps to a strict schema only because of
it, which is what these tests rely on.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import llguidance
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

from inference.runtime.engine.grammar import Constraint, GrammarError, grammar_problem, grammar_tokenizer
from inference.runtime.engine.sampling import Sampler, sampler_for
from inference.tools.tiny import make_tiny

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "colour": {"enum": ["red", "green"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "colour", "tags", "home"],
    "additionalProperties": False,
}


def _grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("grammar") / "m", family="mixtral", seed=5)


@pytest.fixture(scope="module")
def model(tiny: Path):
    return AutoModelForCausalLM.from_pretrained(tiny, dtype="auto", experts_implementation="eager").eval()


def _eos(model) -> frozenset[int]:
    """The ids that end a generation, as main's samplers have them."""
    cpu = torch.device("cpu")
    return sampler_for(
        model, prompt_len=1, max_new_tokens=1, do_sample=False, temperature=1.0, top_p=1.0, seed=None, device=cpu
    ).eos


def test_the_masked_greedy_choice_is_the_argmax_over_the_allowed_tokens(tiny: Path, model) -> None:
    eos = _eos(model)
    vocab = model.config.vocab_size
    tokenizer = grammar_tokenizer(str(tiny), vocab, tuple(sorted(eos)))
    sampler = Sampler(LogitsProcessorList(), False, None, eos, Constraint(tokenizer, _grammar(SCHEMA), vocab))
    follower = Constraint(tokenizer, _grammar(SCHEMA), vocab)  # the same grammar, to read each mask
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1]])
    for _ in range(200):
        logits = torch.randn(1, vocab, generator=generator) * 5
        allowed = follower.allowed(torch.device("cpu"))  # [V]
        assert 0 < int(allowed.sum()) < vocab
        expected = int(torch.where(allowed, logits[0], float("-inf")).argmax())
        token = sampler.next_token(ids, logits)
        assert token == expected
        if token in eos:
            assert follower.complete  # the end only where the document is whole
            break
        follower.advance(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    else:
        pytest.fail("the constrained walk did not end within 200 tokens")


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_schema_constrained_generation_of_the_tiny_model_is_valid_json(tiny: Path, model, do_sample: bool) -> None:
    vocab = model.config.vocab_size
    eos = _eos(model)
    text_tokenizer = AutoTokenizer.from_pretrained(tiny)
    prompt = text_tokenizer("Describe a person as JSON:")["input_ids"]
    constraint = Constraint(grammar_tokenizer(str(tiny), vocab, tuple(sorted(eos))), _grammar(SCHEMA), vocab)
    sampler = sampler_for(
        model,
        prompt_len=len(prompt),
        max_new_tokens=200,
        do_sample=do_sample,
        temperature=1.0,
        top_p=1.0,
        seed=11,
        device=torch.device("cpu"),
        constraint=constraint,
    )
    ids = torch.tensor([prompt])
    generated: list[int] = []
    with torch.no_grad():
        for _ in range(200):
            token = sampler.next_token(ids, model(ids).logits[:, -1])  # [1, V]
            if token in sampler.eos:
                break
            generated.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    answer = text_tokenizer.decode(generated, skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), SCHEMA)


def test_a_grammar_that_does_not_compile_is_refused_with_the_reason(tiny: Path, model) -> None:
    vocab = model.config.vocab_size
    tokenizer = grammar_tokenizer(str(tiny), vocab, tuple(sorted(_eos(model))))
    problem = grammar_problem(tokenizer, llguidance.grammar_from("lark", "start: missing_rule"))
    assert "does not compile" in problem and "missing_rule" in problem
    assert grammar_problem(tokenizer, _grammar(SCHEMA)) == ""
    with pytest.raises(GrammarError, match="does not compile"):
        Constraint(tokenizer, llguidance.grammar_from("lark", "start: missing_rule"), vocab)
