"""The sampling knobs main honours, against Transformers' ``generate`` and OpenAI's formula.

``top_k``, ``min_p`` and ``repetition_penalty``: main's engine (``inference.tools.local_engine``) gives the
tokens ``generate`` gives with the same settings, greedy and seeded, several sequences at once,
also while verifying drafts. ``frequency_penalty``, ``presence_penalty`` and ``logit_bias``: the
processor's logits are OpenAI's documented formula on hand-made rows, and the served tokens are
``generate``'s with that processor. A value outside its bounds is refused, naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList

from inference.runtime.engine.sampling import OpenAIPenalties
from inference.runtime.engine.scheduler import request_problem
from inference.tools.local_engine import run_engine
from inference.tools.tiny import make_tiny
from inference.wire.generation import Done, Generate

SHAPE = {"layers": 2, "hidden": 32, "intermediate": 48, "experts": 4, "top_k": 2, "heads": 4, "kv_heads": 2}
PROMPTS = [[5, 9, 14, 3, 22, 7, 31], [40, 2], [17, 17, 8, 60, 11, 4, 9, 12, 13, 50, 6]]
NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("knobs") / "mixtral", family="mixtral", seed=5, **SHAPE)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", experts_implementation="eager").eval()


def _generate(model, prompt: list[int], seed: int | None = None, processors=None, **knobs) -> list[int]:
    if seed is not None:
        torch.manual_seed(seed)
    ids = torch.tensor([prompt])
    extra = {"logits_processor": LogitsProcessorList(processors)} if processors else {}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, **knobs, **extra)
    return out[0, len(prompt) :].tolist()


def _served(model, knobs: dict, *, seeded: bool, drafter=None, **settings) -> dict[str, list[int]]:
    sampling = {"do_sample": True, "temperature": 0.8, "top_p": 0.95} if seeded else {}
    requests = [
        {"id": f"r{i}", "prompt": p, "max_new_tokens": NEW, **sampling, **knobs, **({"seed": 40 + i} if seeded else {})}
        for i, p in enumerate(PROMPTS)
    ]
    ends, _ = run_engine(model, requests, drafter=drafter, max_batch=3, prefix_cache=False, **settings)
    assert all(isinstance(e, Done) for e in ends.values()), ends
    return {request_id: end.token_ids for request_id, end in ends.items()}


GENERATE_KNOBS = [
    {"top_k": 3},
    {"top_k": 0},
    {"min_p": 0.2},
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.7, "top_k": 5, "min_p": 0.05},
]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("knobs", GENERATE_KNOBS, ids=lambda k: ",".join(f"{n}={v}" for n, v in k.items()))
def test_transformers_knobs_give_generate_s_tokens(model, knobs: dict, seeded: bool) -> None:
    got = _served(model, knobs, seeded=seeded)
    for i, prompt in enumerate(PROMPTS):
        if seeded:
            expected = _generate(model, prompt, 40 + i, do_sample=True, temperature=0.8, top_p=0.95, **knobs)
        else:  # greedy: generate applies its repetition penalty; top-k and min-p shape only sampling
            greedy = {k: v for k, v in knobs.items() if k == "repetition_penalty"}
            expected = _generate(model, prompt, do_sample=False, **greedy)
        assert got[f"r{i}"] == expected, (knobs, seeded, i)


def test_a_repetition_penalty_changes_the_greedy_answer_of_this_model(model) -> None:
    """So the greedy cases above test something: the penalty moves at least one answer."""
    plain = _served(model, {}, seeded=False)
    assert _served(model, {"repetition_penalty": 1.8}, seeded=False) != plain


def test_openai_penalties_are_openai_s_formula_on_hand_made_rows() -> None:
    # Prompt [7, 1], generated so far [1, 3, 1, 4]: counts 1 -> 2, 3 -> 1, 4 -> 1 (the prompt's 1 not counted).
    input_ids = torch.tensor([[7, 1, 1, 3, 1, 4]])
    scores = torch.tensor([[0.5, 2.0, -1.0, 3.0, 0.25, 1.0, 0.0, 9.0]])
    processor = OpenAIPenalties(prompt_len=2, frequency=0.5, presence=0.25, bias=[(5, 10.0), (7, -100.0)])
    got = processor(input_ids, scores)
    expected = scores.clone()
    for token, count in {1: 2, 3: 1, 4: 1}.items():
        expected[0, token] -= count * 0.5 + 0.25
    expected[0, 5] += 10.0
    expected[0, 7] -= 100.0
    assert torch.equal(got, expected)
    assert torch.equal(scores, torch.tensor([[0.5, 2.0, -1.0, 3.0, 0.25, 1.0, 0.0, 9.0]]))  # its input untouched
    # Negative penalties raise what was said; a token never generated is left alone.
    raised = OpenAIPenalties(prompt_len=2, frequency=-1.0, presence=-2.0)(input_ids, scores)
    assert raised[0, 1] == 2.0 + 2 * 1.0 + 2.0 and raised[0, 6] == 0.0


OPENAI_KNOBS = [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"frequency_penalty": -0.5, "presence_penalty": 0.5},
    {"logit_bias": [(11, 100.0)]},
    {"logit_bias": [(11, 5.0), (12, -100.0)], "frequency_penalty": 2.0},
]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("knobs", OPENAI_KNOBS, ids=lambda k: ",".join(f"{n}={v}" for n, v in k.items()))
def test_openai_knobs_serve_the_tokens_their_logits_give(model, knobs: dict, seeded: bool) -> None:
    got = _served(model, knobs, seeded=seeded)
    for i, prompt in enumerate(PROMPTS):
        processor = OpenAIPenalties(
            len(prompt),
            knobs.get("frequency_penalty", 0.0),
            knobs.get("presence_penalty", 0.0),
            knobs.get("logit_bias", ()),
        )
        sampling = {"do_sample": True, "temperature": 0.8, "top_p": 0.95} if seeded else {"do_sample": False}
        expected = _generate(model, prompt, 40 + i if seeded else None, [processor], **sampling)
        assert got[f"r{i}"] == expected, (knobs, seeded, i)
    if knobs == {"logit_bias": [(11, 100.0)]} and not seeded:  # a +100 bias takes every greedy token
        assert all(tokens == [11] * NEW for tokens in got.values())


def test_knobs_with_drafts_keep_every_token(model) -> None:
    """Drafts verified under a repetition penalty and OpenAI's penalties: main counts the kept
    drafts as generated tokens, so all-right drafts change no token."""
    knobs = {"repetition_penalty": 1.3, "frequency_penalty": 0.7, "presence_penalty": 0.3}
    plain = _served(model, knobs, seeded=False)

    def drafter(ask) -> list[int]:
        return plain[ask.request_id][ask.position : ask.position + ask.tokens]

    drafted = _served(model, knobs, seeded=False, drafter=drafter, draft_tokens=4)
    assert drafted == plain


def test_a_continuation_counts_the_answer_it_re_reads_in_openai_s_penalties(model) -> None:
    """Main's restart cut each answer after ``CUT`` tokens; its continuation (``agent.migration``)
    re-reads them as prompt and says so (``Generate.answered``): the penalties count them as
    generated, so the rest is the undisturbed answer's. Without ``answered`` they would count
    none of them, and this model would answer otherwise."""
    knobs, cut = {"frequency_penalty": 1.5, "presence_penalty": 0.5}, 4
    whole = _served(model, knobs, seeded=False)

    def continued(answered: bool) -> dict[str, list[int]]:
        requests = [
            {"id": f"r{i}", "prompt": prompt + whole[f"r{i}"][:cut], "max_new_tokens": NEW - cut, **knobs}
            | ({"answered": cut} if answered else {})
            for i, prompt in enumerate(PROMPTS)
        ]
        ends, _ = run_engine(model, requests, max_batch=3, prefix_cache=False)
        return {request_id: end.token_ids for request_id, end in ends.items()}

    assert continued(answered=True) == {request_id: tokens[cut:] for request_id, tokens in whole.items()}
    assert continued(answered=False) != {request_id: tokens[cut:] for request_id, tokens in whole.items()}


@pytest.mark.parametrize(
    ("knobs", "named"),
    [
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"logit_bias": [(64, 1.0)]}, "logit_bias token ids"),
        ({"logit_bias": [(3, 101.0)]}, "logit_bias"),
        ({"logit_bias": [(3, float("nan"))]}, "logit_bias"),
        ({"logit_bias": [(3, 1.0), (3, 2.0)]}, "logit_bias names a token more than once"),
        ({"logit_bias": [(i, 1.0) for i in range(301)]}, "at most 300"),
        ({"answered": 2}, "answered must be from 0 to 1"),  # a continuation re-reads its answer after a prompt
        ({"answered": -1}, "answered must be from 0 to 1"),
    ],
)
def test_a_knob_out_of_bounds_is_refused_naming_it(knobs: dict, named: str) -> None:
    msg = Generate(request_id="r", prompt_ids=[1, 2], max_new_tokens=2, **knobs)
    problem = request_problem(msg, vocab=64, context=128)
    assert named in problem
    assert request_problem(Generate(request_id="r", prompt_ids=[1, 2], max_new_tokens=2), vocab=64, context=128) == ""


def test_knobs_with_a_reused_prefix_keep_generate_s_tokens(model) -> None:
    """The second of two requests reuses the first's prompt KV (prefix cache): the knobs see the whole
    prompt either way. (Under a grammar: ``test_grammar``.)"""
    prompt = [(7 * i + 3) % 60 + 1 for i in range(40)]
    knobs = {"repetition_penalty": 1.5, "presence_penalty": 1.0, "logit_bias": [(11, 3.0)]}
    requests = [{"id": f"again{i}", "prompt": prompt, "max_new_tokens": NEW, **knobs} for i in range(2)]
    ends, _ = run_engine(model, requests, max_batch=1, prefix_cache=True)
    processor = OpenAIPenalties(len(prompt), 0.0, 1.0, [(11, 3.0)])
    expected = _generate(model, prompt, None, [processor], do_sample=False, repetition_penalty=1.5)
    assert [ends[f"again{i}"].token_ids for i in range(2)] == [expected, expected]
    assert ends["again1"].metrics["cached_prompt_tokens"] > 0 == ends["again0"].metrics["cached_prompt_tokens"]
