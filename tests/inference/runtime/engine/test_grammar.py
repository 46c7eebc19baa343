"""Constrained decoding in main's sampler, without a cluster: the tiny model under a JSON schema.

The mask goes in before the logits processors, so greedy decoding is the argmax over the
tokens the grammar allows; a random-weighted model keeps to a strict schema only because of
it, which is what these tests rely on.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import llguidance
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

from inference.runtime.engine.compiles import Compiles
from inference.runtime.engine.grammar import Constraint, GrammarError, Guessing, grammar_tokenizer
from inference.runtime.engine.sampling import Sampler, sampler_for
from inference.tools.tiny import make_tiny
from inference.wire.generation import Generate
from inference.wire.grammar import BYTE_TOKENIZER, compile_grammar, digest

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


def _constraint(tokenizer: llguidance.LLTokenizer, grammar: str, vocab: int) -> Constraint:
    matcher, problem = compile_grammar(grammar, tokenizer)
    assert matcher is not None, problem
    return Constraint(matcher, vocab)


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
    sampler = Sampler(LogitsProcessorList(), False, None, eos, _constraint(tokenizer, _grammar(SCHEMA), vocab))
    follower = _constraint(tokenizer, _grammar(SCHEMA), vocab)  # the same grammar, to read each mask
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


def _walk(constraint: Constraint, logits: list[torch.Tensor]) -> list[int]:
    """The greedy tokens under ``constraint`` for these logits, one a step, until an end."""
    tokens = []
    for row in logits:
        token = int(torch.where(constraint.allowed(torch.device("cpu")), row, float("-inf")).argmax())
        if not constraint.matcher.consume_token(token) or constraint.matcher.is_stopped():
            break
        tokens.append(token)
    return tokens


def _after(tokenizer: llguidance.LLTokenizer, grammar: str, vocab: int, tokens: list[int]) -> torch.Tensor:
    """The mask a fresh matcher computes after ``tokens``."""
    fresh = _constraint(tokenizer, grammar, vocab)
    for token in tokens:
        fresh.advance(token)
    return fresh.allowed(torch.device("cpu"))


def test_the_shadow_s_grammar_rolls_back_to_the_tokens_it_shares_with_main(tiny: Path, model) -> None:
    """The shadow's guesses follow a sequence whose later tokens main replaces: after any rewrite
    its mask is the one a fresh matcher computes after the same tokens."""
    vocab = model.config.vocab_size
    tokenizer = grammar_tokenizer(str(tiny), vocab, tuple(sorted(_eos(model))))
    grammar = _grammar(SCHEMA)
    generator = torch.Generator().manual_seed(1)
    first = _walk(_constraint(tokenizer, grammar, vocab), [torch.randn(vocab, generator=generator) for _ in range(40)])
    second = _walk(_constraint(tokenizer, grammar, vocab), [torch.randn(vocab, generator=generator) for _ in range(40)])
    assert len(first) > 12 and len(second) > 12 and first[:3] == second[:3]  # '{"name' at least, then apart
    matcher, _ = compile_grammar(grammar, tokenizer)
    guessing = Guessing(matcher, vocab)
    cpu = torch.device("cpu")
    for tokens in (first[:12], first[:5], second[:12], second[:12], first[:3], second, []):
        assert torch.equal(guessing.allowed_after(tokens, cpu), _after(tokenizer, grammar, vocab, tokens))
        assert guessing.taken == tokens
    assert guessing.allowed_after([first[0], first[0]], cpu) is None  # refused: it begins again
    assert torch.equal(guessing.allowed_after(first[:4], cpu), _after(tokenizer, grammar, vocab, first[:4]))


KNOBS = {"repetition_penalty": 1.3, "presence_penalty": 1.5, "logit_bias": [(5, 50.0)], "top_k": 8, "min_p": 0.01}


@pytest.mark.parametrize("knobs", [{}, KNOBS], ids=["plain", "knobs"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_schema_constrained_generation_of_the_tiny_model_is_valid_json(
    tiny: Path, model, do_sample: bool, knobs: dict
) -> None:
    """Also under sampling knobs: they act on the tokens the grammar allows (its mask comes first),
    so a strong bias towards one token cannot take the answer out of the schema."""
    vocab = model.config.vocab_size
    eos = _eos(model)
    text_tokenizer = AutoTokenizer.from_pretrained(tiny)
    prompt = text_tokenizer("Describe a person as JSON:")["input_ids"]
    constraint = _constraint(grammar_tokenizer(str(tiny), vocab, tuple(sorted(eos))), _grammar(SCHEMA), vocab)
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
        **knobs,
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
    matcher, problem = compile_grammar(llguidance.grammar_from("lark", "start: missing_rule"), tokenizer)
    assert matcher is None and "does not compile" in problem and "missing_rule" in problem
    assert compile_grammar(_grammar(SCHEMA), tokenizer)[1] == ""


def _optional_properties(n: int) -> str:
    """The grammar of an object of ``n`` optional properties: about 8 symbols each, and a compile
    that grows with their square (seconds past a few thousand)."""
    return _grammar({"type": "object", "properties": {f"p{i}": {"type": "null"} for i in range(n)}})


@pytest.fixture(scope="module")
def tokenizer(tiny: Path, model) -> llguidance.LLTokenizer:
    return grammar_tokenizer(str(tiny), model.config.vocab_size, tuple(sorted(_eos(model))))


def _request(name: str, grammar: str, user: str = "u") -> Generate:
    return Generate(request_id=name, prompt_ids=[1], max_new_tokens=4, user=user, grammar=grammar)


def _ended(compiles: Compiles, n: int, busy: list[str] | None = None) -> list[tuple[Generate, bytes, str]]:
    """The next ``n`` requests whose compile ended, in order; each one's user joins ``busy`` (main
    queues it), as main's loop would have it."""
    busy = [] if busy is None else busy
    ended: list[tuple[Generate, bytes, str]] = []
    deadline = time.monotonic() + 120
    while len(ended) < n and time.monotonic() < deadline:
        for entry in compiles.poll(busy):
            ended.append(entry)
            busy.append(entry[0].user)
        time.sleep(0.002)
    assert len(ended) == n, f"{len(ended)} of {n} compiles ended in time"
    return ended


def test_the_choices_of_one_grammar_cost_one_compile_and_each_gets_a_matcher_of_its_own(
    tokenizer: llguidance.LLTokenizer,
) -> None:
    compiles = Compiles(lambda: tokenizer)
    grammar = _grammar(SCHEMA)
    assert all(compiles.submit(_request(f"choice-{i}", grammar), b"client") is None for i in range(8))
    ended = _ended(compiles, 8)
    assert [(msg.request_id, problem) for msg, _, problem in ended] == [(f"choice-{i}", "") for i in range(8)]
    assert compiles.compiles == 1
    first, second = compiles.take("choice-0"), compiles.take("choice-1")
    brace = tokenizer.tokenize_str("{")[0]
    assert first.consume_token(brace)
    assert second.consume_token(brace)  # still at the start: one sequence's token leaves the other's state
    assert compiles.submit(_request("later", grammar), b"client") == ""  # compiled already: it may queue now
    assert compiles.compiles == 1


def test_a_request_cancelled_while_its_grammar_compiles_is_handed_back_and_never_queued(
    tokenizer: llguidance.LLTokenizer,
) -> None:
    compiles = Compiles(lambda: tokenizer)
    heavy = _optional_properties(3000)  # about a second's compile
    compiles.submit(_request("cancelled", heavy), b"a")
    compiles.submit(_request("kept", heavy), b"b")
    assert compiles.poll([]) == []  # its compile begins
    assert compiles.users() == ["u", "u"]  # both count against the user's and the queue's bounds
    msg, client = compiles.cancel("cancelled")  # type: ignore[misc]
    assert (msg.request_id, client) == ("cancelled", b"a")
    assert not compiles.holds("cancelled") and compiles.cancel("cancelled") is None
    assert [(msg.request_id, problem) for msg, _, problem in _ended(compiles, 1)] == [("kept", "")]
    # Cancelled before its compile began: the compile never runs.
    compiles.submit(_request("never", _grammar({"type": "object", "properties": {"never": {"type": "null"}}})), b"c")
    assert compiles.cancel("never") is not None
    compiles.poll([])
    assert compiles.compiles == 1 and not compiles.pending


def test_compiles_take_turns_between_users(tokenizer: llguidance.LLTokenizer) -> None:
    compiles = Compiles(lambda: tokenizer)
    schemas = [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(4)]
    for name, user, schema in zip(["a-0", "a-1", "a-2", "b-0"], "aaab", schemas, strict=True):
        compiles.submit(_request(name, _grammar(schema), user), b"client")
    # b's one grammar compiles before a's second: a has one more generation in main by then.
    assert [msg.request_id for msg, _, _ in _ended(compiles, 4)] == ["a-0", "b-0", "a-1", "a-2"]


def test_a_compile_past_the_backstop_fails_its_requests_and_what_it_compiles_is_kept(
    tokenizer: llguidance.LLTokenizer,
) -> None:
    compiles = Compiles(lambda: tokenizer, backstop_s=0.0)
    heavy = _optional_properties(3001)
    compiles.submit(_request("slow", heavy), b"client")
    compiles.poll([])  # begins
    ((msg, _, problem),) = _ended(compiles, 1)
    assert msg.request_id == "slow" and "still compiling after 0 s" in problem
    deadline = time.monotonic() + 120
    while compiles.cache.get(digest(heavy)) is None and time.monotonic() < deadline:
        compiles.poll([])
        time.sleep(0.01)
    assert compiles.submit(_request("again", heavy), b"client") == ""  # the thread finished it: kept


def test_main_and_the_edge_refuse_a_grammar_past_a_limit_in_the_same_words(tokenizer: llguidance.LLTokenizer) -> None:
    grammar = _optional_properties(5200)  # 139 KB; over 40,000 symbols
    in_main = compile_grammar(grammar, tokenizer)
    at_edge = compile_grammar(grammar, BYTE_TOKENIZER)
    assert in_main[0] is None and at_edge[0] is None
    assert in_main[1] == at_edge[1]
    assert "over the limit max_grammar_size = 40000 grammar symbols" in in_main[1]


def test_a_step_limit_ends_a_generation_at_the_same_token_naming_the_limit_and_nothing_of_the_grammar(
    tokenizer: llguidance.LLTokenizer, model
) -> None:
    # 600 optional properties compile (4,800 symbols), but the first token, "{", makes a parser row
    # of 4 * 600 + 7 items, past max_items_in_row: the generation ends there, every time.
    grammar = _optional_properties(600)
    for _ in range(2):
        constraint = _constraint(tokenizer, grammar, model.config.vocab_size)
        with pytest.raises(GrammarError) as stopped:
            constraint.advance(tokenizer.tokenize_str("{")[0])
        assert "over the limit max_items_in_row = 2000" in str(stopped.value)
        assert len(str(stopped.value)) < 400  # the message travels in a Failed: no grammar, no parser state
