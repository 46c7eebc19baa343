"""Main's engine without sockets: its runner and sampler against Transformers' ``generate``.

The runner runs a real tiny checkpoint of every family layer by layer, several sequences at
once with chunked prefill, its experts computed by the checkpoint's own experts module in
place of the workers; every sequence must be token-identical to its own ``generate`` run,
greedy and seeded sampling alike, and its logprobs (generated and prompt tokens) must be the
log-softmax of Transformers' own forward's logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from inference.modelio.families import FAMILIES
from inference.modelio.model import family_of
from inference.runtime.engine import runner as runner_module
from inference.runtime.engine.runner import ModelRunner
from inference.runtime.engine.sampling import check_generation_config, sampler_for, token_logprobs
from inference.runtime.engine.scheduler import Waiting, schedule
from inference.runtime.engine.sequence import Sequence
from inference.runtime.records import RequestState, StepRecord
from inference.tools.reference import reference_generate
from inference.tools.tiny import make_tiny

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
    """The engine's scheduler, runner and sampler on ``requests``; experts by the model's own module.

    A request with ``top_logprobs`` gets its logprobs gathered as main's engine gathers them
    into ``logprobs[id]``: ``{"prompt": [...], "generated": [...]}``.
    """
    family = family_of(model.config)

    def serve_layer(layer: int, batch: list[Sequence]) -> list[torch.Tensor]:
        experts = family.experts(model.model.layers[layer])
        return [experts(s.call.hidden_states, s.call.top_k_index, s.call.top_k_weights) for s in batch]

    def embedded(sequence: Sequence, work, embeds: torch.Tensor) -> None:
        steps = sequence.state.steps
        if steps and not sequence.state.token_times:
            steps[-1].tokens += work.tokens
        else:
            steps.append(StepRecord(len(steps), work.tokens, 0.0))

    runner = ModelRunner(model, family, serve_layer, embedded)
    waiting = list(requests)
    running: dict[str, Sequence] = {}
    out: dict[str, list[int]] = {}
    while waiting or running:
        views = [Waiting(r["id"], r.get("user", ""), len(r["prompt"]), r["max_new_tokens"]) for r in waiting]
        plan = schedule(views, [s.view() for s in running.values()], max_batch=max_batch, prefill_step=prefill_step)
        for request_id, _ in plan.leaves:
            out[request_id] = running.pop(request_id).state.generated
        for r in [waiting[i] for i in plan.joins]:
            waiting.remove(r)
            state = RequestState(r["id"], b"", len(r["prompt"]), r["max_new_tokens"], 1, 1, 0.0)
            state.cache = DynamicCache(config=model.config)
            sampler = sampler_for(
                model,
                prompt_len=len(r["prompt"]),
                max_new_tokens=r["max_new_tokens"],
                do_sample=r.get("do_sample", False),
                temperature=r.get("temperature", 1.0),
                top_p=r.get("top_p", 1.0),
                seed=r.get("seed"),
                device=torch.device("cpu"),
            )
            tokens = torch.tensor([r["prompt"]], dtype=torch.long)
            asks = "top_logprobs" in r
            running[r["id"]] = Sequence(
                state,
                r.get("user", ""),
                sampler,
                tokens,
                joined_step=0,
                logprobs=asks,
                top_logprobs=r.get("top_logprobs", 0),
                prompt_logprobs=[] if asks else None,
            )
            if asks and logprobs is not None:
                logprobs[r["id"]] = {"prompt": running[r["id"]].prompt_logprobs, "generated": []}
        batch = [(running[w.request_id], w) for w in plan.work]
        if not batch:
            continue
        for (s, work), step in zip(batch, runner.run(batch), strict=True):
            s.computed = work.end
            if step.prompt is not None and s.prompt_logprobs is not None:
                s.prompt_logprobs += step.prompt
            if step.last is not None:
                token = s.sampler.next_token(s.tokens, step.last)
                if s.logprobs and logprobs is not None:
                    entries = token_logprobs(step.last, torch.tensor([token]), s.top_logprobs)
                    logprobs[s.request_id]["generated"] += entries
                s.state.generated.append(token)
                s.state.token_times.append(0.0)
                s.tokens = torch.cat([s.tokens, torch.tensor([[token]])], dim=1)
                s.ended = token in s.sampler.eos
    return out


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
