"""The simulator driven by main's real engine (``inference.tools.engine_passes``): the engine's own
passes recorded in one process, then timed on the emulated cluster (``inference.sim.cluster``).

One generation without drafts, or with drafts that are all kept, is the case the trace's walk
(``inference.sim.local``) also models: the two give the same decode rate. Past it, the engine's
passes carry what the walk cannot: a batch whose sequences join, prefill in pieces and leave, and
a quantized shadow's own drafts, kept where main's sampling confirms them, the tokens unchanged.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.shadow import quant
from inference.sim.cluster import EmulatedRates, MachineCosts, Options, Shape
from inference.sim.local import simulate_generation
from inference.tools.engine_passes import Pass, record_passes, time_passes
from inference.tools.local_engine import run_engine
from inference.tools.reference import reference_generate

COSTS = MachineCosts(
    expert_compute_s=1e-3, main_layer_s=1e-3, main_dispatch_s=1e-4, round_trip_s=4e-4, step_fixed_s=1e-3
)
RATES = EmulatedRates(
    copy_bytes_per_s=1e9,
    link_bytes_per_s=1.25e8,
    link_latency_s=1e-4,
    expert_bytes=40_000_000,  # 40 ms a copy
    request_bytes=2_000,
    result_bytes=2_000,
    align_bytes=500,
)
PROMPT = [1, 5, 9, 14, 3]
STAGGERED = [([1, 5, 9, 14, 3], 12), ([7, 7, 2, 40, 41, 42, 43], 9), ([3, 3], 10)]


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model, experts_implementation="eager").eval()


def _shape(model: torch.nn.Module, workers: int = 4) -> Shape:
    config = model.config
    return Shape(config.num_hidden_layers, config.num_local_experts, config.num_experts_per_tok, workers)


def _trace(passes: list[Pass], layers: int) -> list[list[list[int]]]:
    """The decode passes' routing, as the trace's walk takes it (the prefill's pass left out)."""
    return [[p.union(layer, p.rows) for layer in range(layers)] for p in passes[1:]]


@pytest.mark.parametrize("strategy", ["odmoe", "reactive", "full-cache"])
def test_one_generation_without_drafts_times_as_the_trace_walk_does(model, strategy: str) -> None:
    shape = _shape(model)
    passes, _ = record_passes(model, [{"id": "a", "prompt": PROMPT, "max_new_tokens": 12}], prefix_cache=False)
    assert [[(r.positions, r.tokens) for r in p.rows] for p in passes] == [[(5, 1)]] + [[(1, 1)]] * 11
    driven = time_passes(passes, Options(strategy), shape, COSTS, RATES)
    walked = simulate_generation(Options(strategy), shape, COSTS, RATES, _trace(passes, shape.layers))
    assert driven["decode_tok_s"] == pytest.approx(walked["decode_tok_s"], rel=1e-12)
    assert driven["per_request_decode_tok_s"]["a"] == driven["decode_tok_s"]


def test_drafts_all_kept_time_as_the_trace_walk_at_every_draft_kept(model) -> None:
    """The model as its own shadow: every draft kept, passes of 3 drafts and main's own token; the
    walk at 4 tokens a pass makes the same passes and gives the same rate."""
    shape = _shape(model)
    request = [{"id": "a", "prompt": PROMPT, "max_new_tokens": 12}]
    plain, plain_tokens = record_passes(model, request, prefix_cache=False)
    drafted, tokens = record_passes(model, request, shadow=model, prefix_cache=False, draft_tokens=3)
    assert tokens == plain_tokens
    assert [[(r.positions, r.tokens) for r in p.rows] for p in drafted] == [[(5, 1)], [(4, 4)], [(4, 4)], [(3, 3)]]
    driven = time_passes(drafted, Options("odmoe"), shape, COSTS, RATES)
    walked = simulate_generation(
        Options("odmoe", drafts=3, tokens_per_pass=4.0), shape, COSTS, RATES, _trace(plain, shape.layers)
    )
    assert driven["decode_tok_s"] == pytest.approx(walked["decode_tok_s"], rel=1e-12)
    assert driven["passes"] - 1 == walked["passes"]


def test_a_staggered_batch_is_timed_as_the_engine_ran_it(model, tiny_model: Path) -> None:
    """Three requests, two places, prompts prefilled in pieces of 4: the tokens are ``generate``'s;
    every pass holds the rows the engine computed (each position its top-k experts at each layer),
    each request its tokens, in order; its token times never go backwards. Eight workers: a
    prompt's experts go to prefill workers outside the decode groups (four groups of two)."""
    shape = _shape(model, workers=8)
    requests = [{"id": f"r{i}", "prompt": p, "max_new_tokens": n} for i, (p, n) in enumerate(STAGGERED)]
    passes, tokens = record_passes(model, requests, max_batch=2, prefill_step=4, prefix_cache=False)
    for i, (prompt, new) in enumerate(STAGGERED):
        assert tokens[f"r{i}"] == reference_generate(tiny_model, prompt, new, prefill_step=4)
    assert max(len(p.rows) for p in passes) == 2
    for p in passes:
        positions = sum(r.positions for r in p.rows)
        for layer in range(shape.layers):
            segments = sum(p.segments(layer).values()) + sum(p.segments(layer, prefill=True).values())
            assert segments == positions * shape.top_k
    for i, (_, new) in enumerate(STAGGERED):
        assert sum(r.tokens for p in passes for r in p.rows if r.request_id == f"r{i}") == new
    timed = time_passes(passes, Options("odmoe"), shape, COSTS, RATES)
    for request_id, times in timed["token_times"].items():
        assert times == sorted(times) and len(times) == len(tokens[request_id])
        assert timed["per_request_decode_tok_s"][request_id] > 0


def test_an_int8_shadows_drafts_change_no_token(model) -> None:
    """A quantized copy drafts (its greedy continuation), main keeps what its own sampling confirms:
    the tokens are the engine's without drafts, each decode pass keeps at least main's own token
    and at most its positions, and the passes are timed."""
    shadow = copy.deepcopy(model)
    quant.quantize_shadow_(shadow, "int8")
    requests = [{"id": f"r{i}", "prompt": p, "max_new_tokens": n} for i, (p, n) in enumerate(STAGGERED)]
    _, plain = run_engine(model, requests, max_batch=2, prefix_cache=False)
    passes, tokens = record_passes(model, requests, shadow=shadow, max_batch=2, prefix_cache=False, draft_tokens=3)
    assert tokens == {request_id: [t.token_id for t in streamed] for request_id, streamed in plain.items()}
    decodes = [r for p in passes for r in p.decoding()]
    assert decodes and all(1 <= r.tokens <= r.positions <= 4 for r in decodes)
    assert time_passes(passes, Options("odmoe"), _shape(model), COSTS, RATES)["decode_tok_s"] > 0


def test_what_cannot_be_timed_after_the_run_is_refused(model) -> None:
    request = [{"id": "a", "prompt": PROMPT, "max_new_tokens": 4}]
    with pytest.raises(ValueError, match="draft_policy='auto'"):
        record_passes(model, request, shadow=model, draft_tokens=3, draft_policy="auto")
    with pytest.raises(ValueError, match="needs a shadow"):
        record_passes(model, request, draft_tokens=3)
    passes, _ = record_passes(model, request, prefix_cache=False)
    for options in (Options("odmoe", hybrid=True), Options("lru-offload"), Options("odmoe", drafts=2)):
        with pytest.raises(ValueError, match="networked strategies"):
            time_passes(passes, options, _shape(model), COSTS, RATES)
    with pytest.raises(ValueError, match="no passes"):
        time_passes([], Options("odmoe"), _shape(model), COSTS, RATES)
