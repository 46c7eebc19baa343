"""Main's engine without sockets, against Transformers' ``generate``.

Main's own engine, driven by a host in this process (``inference.tools.local_engine``), runs a real tiny
checkpoint of every family layer by layer, several sequences at once with chunked prefill, its
experts computed by the checkpoint's own experts module in place of the workers; every sequence
must be token-identical to its own ``generate`` run, greedy and seeded sampling alike, also where
the shadow's drafts are verified (all right, all wrong), and its logprobs (generated and prompt
tokens) must be the log-softmax of Transformers' own forward's logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.modelio.families import FAMILIES
from inference.runtime.engine import runner as runner_module
from inference.runtime.engine.sampling import check_generation_config
from inference.tools.local_engine import run_engine
from inference.tools.reference import reference_generate
from inference.tools.tiny import make_tiny
from inference.wire.runtime import Done

SHAPE = {"layers": 2, "hidden": 32, "intermediate": 48, "experts": 4, "top_k": 2, "heads": 4, "kv_heads": 2}
PROMPTS = [[5, 9, 14, 3, 22, 7, 31], [40, 2], [17, 17, 8, 60, 11, 4, 9, 12, 13, 50, 6]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine")
    extra = {"qwen2_moe": {"shared_intermediate": 24}}
    return {
        f: make_tiny(root / f, family=f, seed=3, **SHAPE, **extra.get(f, {}))
        for f in FAMILIES  # every family the runner mirrors
    }


def _load(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype="auto", experts_implementation="eager").eval()


def _run_engine(
    model, requests: list[dict], *, max_batch: int, prefill_step: int, logprobs: dict | None = None
) -> dict[str, list[int]]:
    """Main's engine on ``requests`` (``inference.tools.local_engine``: experts by the model's own module).

    A request with ``top_logprobs`` gets its logprobs gathered from its streamed tokens into
    ``logprobs[id]``: ``{"prompt": [...], "generated": [...]}``.
    """
    asked = [{**r, "logprobs": "top_logprobs" in r, "prompt_logprobs": "top_logprobs" in r} for r in requests]
    ends, streamed = run_engine(model, asked, max_batch=max_batch, prefill_step=prefill_step, prefix_cache=False)
    for request_id, tokens in streamed.items():
        if logprobs is not None and tokens and tokens[0].prompt_logprobs is not None:
            logprobs[request_id] = {"prompt": tokens[0].prompt_logprobs, "generated": [t.logprob for t in tokens]}
    done = {request_id: end for request_id, end in ends.items() if isinstance(end, Done)}
    assert done.keys() == ends.keys(), ends
    assert all(end.token_ids == [t.token_id for t in streamed[i]] for i, end in done.items())
    return {request_id: end.token_ids for request_id, end in done.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_sequence_of_an_engine_batch_is_token_identical_to_its_own_generate(
    models: dict[str, Path], family: str
) -> None:
    model = _load(models[family])
    requests = [{"id": f"r{i}", "prompt": p, "max_new_tokens": 6} for i, p in enumerate(PROMPTS)]
    # Two at once: the third joins when one leaves; prompts prefilled in pieces of 4 tokens.
    got = _run_engine(model, requests, max_batch=2, prefill_step=4)
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"] == reference_generate(models[family], prompt, 6, prefill_step=4), family


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("drafts", ["right", "wrong"])
def test_drafts_main_verifies_change_no_token(models: dict[str, Path], family: str, drafts: str) -> None:
    """Up to 4 drafts a pass, three sequences at once: drafts equal to ``generate``'s next tokens
    are all kept (the answers in fewer passes), drafts that are all wrong all refused; the tokens
    are ``generate``'s either way."""
    model = _load(models[family])
    expected = {f"r{i}": reference_generate(models[family], p, 9) for i, p in enumerate(PROMPTS)}

    def drafter(ask) -> list[int]:
        right = expected[ask.request_id][ask.position : ask.position + ask.tokens]
        return right if drafts == "right" else [(t + 1) % model.config.vocab_size for t in right]

    requests = [{"id": f"r{i}", "prompt": p, "max_new_tokens": 9} for i, p in enumerate(PROMPTS)]
    ends, _ = run_engine(model, requests, drafter=drafter, max_batch=3, draft_tokens=4, prefix_cache=False)
    for request_id, end in ends.items():
        assert isinstance(end, Done), end
        assert end.token_ids == expected[request_id], (family, drafts)
        counts = end.metrics["drafts"]
        assert counts["drafted"] > 0 and counts["unanswered"] == 0
        assert counts["accepted"] == (counts["drafted"] if drafts == "right" else 0)
        # After the prefill's token, all kept: 4 drafts and 1 more, then 2 drafts (no pass drafts
        # past 9 tokens) and 1 more; none kept: a token a pass, the last pass drafting none.
        assert counts["passes"] == (2 if drafts == "right" else 7)


def test_a_seeded_sampled_sequence_draws_what_generate_drew_after_manual_seed(models: dict[str, Path]) -> None:
    path = models["mixtral"]
    model = _load(path)
    sampled = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 8}
    requests = [{"id": f"s{i}", "prompt": p, "seed": 100 + i, **sampled} for i, p in enumerate(PROMPTS)]
    got = _run_engine(model, requests, max_batch=3, prefill_step=0)
    for i, prompt in enumerate(PROMPTS):
        torch.manual_seed(100 + i)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=True, temperature=0.7, top_p=0.9
            )
        assert got[f"s{i}"] == ref[0, len(prompt) :].tolist()
    # Another seed draws another run (the draws depend on the seed, not on the batch).
    other = _run_engine(model, [{**requests[0], "seed": 7}], max_batch=1, prefill_step=0)
    assert other["s0"] != got["s0"]


def test_a_generation_config_asking_for_beams_is_refused_at_startup(models: dict[str, Path]) -> None:
    model = _load(models["mixtral"])
    check_generation_config(model)  # the tiny checkpoint's own config is served
    model.generation_config.num_beams = 4
    with pytest.raises(ValueError, match="num_beams=4"):
        check_generation_config(model)


@pytest.mark.parametrize(("prefill_step", "rows"), [(0, 512), (3, 512), (4, 3)])
def test_logprobs_are_the_log_softmax_of_transformers_own_logits(
    models: dict[str, Path], prefill_step: int, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy fp32: each generated token's and each echoed prompt token's logprob and top-3 are
    those of ``torch.log_softmax`` over ``model(prompt + answer).logits``, whole prompt or pieces,
    the prompt's LM head in one product or several per piece (``rows``)."""
    monkeypatch.setattr(runner_module, "PROMPT_LOGIT_ROWS", rows)
    model = _load(models["mixtral"]).float()
    requests = [{"id": f"r{i}", "prompt": p, "max_new_tokens": 5, "top_logprobs": 3} for i, p in enumerate(PROMPTS)]
    gathered: dict = {}
    got = _run_engine(model, requests, max_batch=2, prefill_step=prefill_step, logprobs=gathered)
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt + got[f"r{i}"]])
        with torch.inference_mode():
            reference = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [L, V]
        # Position p predicts token p + 1: the prompt's from its second token, then every generated one.
        entries = gathered[f"r{i}"]["prompt"] + gathered[f"r{i}"]["generated"]
        assert [e.token_id for e in entries] == ids[0, 1:].tolist()
        for position, entry in enumerate(entries):
            expected = reference[position]
            assert entry.logprob == pytest.approx(float(expected[entry.token_id]), abs=1e-5)
            top_values, top_ids = torch.topk(expected, 3)
            assert [t for t, _ in entry.top] == top_ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-5)
        # Greedy: each generated token is the most likely one at its position.
        for entry in gathered[f"r{i}"]["generated"]:
            assert entry.top[0][0] == entry.token_id
