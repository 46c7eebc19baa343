"""Split/compute/combine per expert gives the same bits as Transformers' MixtralExperts, from
the workers' answers to what main asked of each, and no other."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from inference.runtime import routing as routing_module
from inference.runtime.engine.exchange import answered_request, assemble, plan_layer
from inference.runtime.experts import ExpertWeights, activation, expert_forward
from inference.runtime.routing import (
    Routing,
    combine_eager,
    combine_grouped,
    grouped_mm_works,
    resolve_arithmetic,
    split_eager,
    split_grouped,
)
from inference.wire.runtime import ExpertRequest, ExpertResult

CPU = torch.device("cpu")

SHAPES = [
    # (hidden, intermediate, experts, top_k)
    (64, 96, 8, 2),
    (64, 96, 8, 3),
    (75, 97, 8, 2),
]
ALIGNED = [s for s in SHAPES if s[0] % 4 == 0 and s[1] % 4 == 0]  # 16-byte fp32 strides
TOKENS = (1, 5, 40)


def _experts(hidden: int, intermediate: int, n_experts: int, top_k: int, dtype: torch.dtype, seed: int):
    config = MixtralConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_local_experts=n_experts,
        num_experts_per_tok=top_k,
    )
    module = MixtralExperts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=g) * 0.1)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=g) * 0.1)
    return config, module.to(dtype).eval()


def _routing(num_tokens: int, hidden: int, n_experts: int, top_k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    index = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.05
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(torch.float32)
    return states, index, weights


def _distributed(module: MixtralExperts, states, index, weights, split, combine) -> torch.Tensor:
    """What main and the workers compute: each expert's rows alone, then main's sum."""
    routed = split(states, index, weights)
    act_fn = activation(module.config.hidden_act)
    outputs = {}
    for e in routed.experts:
        expert = ExpertWeights(gate_up=module.gate_up_proj[e].detach(), down=module.down_proj[e].detach())
        outputs[e] = expert_forward(routed.rows[e], routed.weights[e], expert, act_fn)
    return combine(routed, outputs, states.dtype)


def _reference(config, module, implementation: str, states, index, weights) -> torch.Tensor:
    config._experts_implementation = implementation
    with torch.no_grad():
        return module(states, index, weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-i{}-e{}-k{}".format(*s))
def test_eager_arithmetic_is_bit_identical(shape, dtype: torch.dtype) -> None:
    hidden, _, n_experts, top_k = shape
    config, module = _experts(*shape, dtype=dtype, seed=hidden + top_k)
    for seed, num_tokens in enumerate(TOKENS):
        states, index, weights = _routing(num_tokens, hidden, n_experts, top_k, dtype, seed)
        want = _reference(config, module, "eager", states, index, weights)
        with torch.no_grad():
            got = _distributed(module, states, index, weights, split_eager, combine_eager)
        assert got.dtype == want.dtype and got.shape == (num_tokens, hidden)
        assert torch.equal(got, want), (shape, num_tokens, (got - want).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", ALIGNED, ids=lambda s: "h{}-i{}-e{}-k{}".format(*s))
def test_grouped_arithmetic_is_bit_identical(shape, dtype: torch.dtype) -> None:
    hidden, intermediate, n_experts, top_k = shape
    if not grouped_mm_works(hidden, intermediate, dtype, CPU):
        pytest.skip("torch's grouped GEMM cannot run these shapes; eager is the reference")
    config, module = _experts(*shape, dtype=dtype, seed=hidden + top_k)
    for seed, num_tokens in enumerate(TOKENS):
        states, index, weights = _routing(num_tokens, hidden, n_experts, top_k, dtype, seed)
        want = _reference(config, module, "grouped_mm", states, index, weights)
        with torch.no_grad():
            got = _distributed(module, states, index, weights, split_grouped, combine_grouped)
        assert got.dtype == want.dtype and got.shape == (num_tokens, hidden)
        assert torch.equal(got, want), (shape, num_tokens, (got - want).abs().max())


def test_odd_shape_really_cannot_use_grouped_mm() -> None:
    """The reason the eager arithmetic exists: Transformers' default path refuses odd strides."""
    config, module = _experts(75, 97, 8, 2, dtype=torch.float32, seed=0)
    states, index, weights = _routing(5, 75, 8, 2, torch.float32, 0)
    with pytest.raises(RuntimeError, match="16 bytes"):
        _reference(config, module, "grouped_mm", states, index, weights)


@pytest.mark.parametrize("split", [split_grouped, split_eager])
def test_split_gives_every_pair_once(split) -> None:
    states, index, weights = _routing(40, 16, 8, 3, torch.float32, 3)
    routed = split(states, index, weights)
    assert routed.experts == sorted(set(index.flatten().tolist()))
    assert sum(routed.count(e) for e in routed.experts) == 40 * 3
    for e in routed.experts:
        assert routed.count(e) == int((index == e).sum())
        assert routed.weights[e].shape == (routed.count(e),)
        assert routed.rows[e].shape == (routed.count(e), 16)
    assert (routed.num_tokens, routed.top_k) == (40, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arithmetic", ["grouped", "eager"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_one_token_fast_path_matches_the_general_path(
    arithmetic: str, top_k: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step's split and sum skip the general tensor ops, and give the same tensors."""
    routing = Routing(arithmetic)
    for seed in range(5):
        states, index, weights = _routing(1, 24, 8, top_k, dtype, seed)
        g = torch.Generator().manual_seed(seed)
        fast = routing.split(states, index, weights)
        assert fast.slots == index[0].tolist()
        outputs = {e: torch.randn(1, 24, generator=g).to(dtype) for e in fast.experts}
        fast_sum = routing.combine(fast, outputs, dtype)
        with monkeypatch.context() as m:
            m.setattr(routing_module, "_single_token_slots", lambda hidden, top_k_index: None)
            general = routing.split(states, index, weights)
            general_sum = routing.combine(general, outputs, dtype)
        assert general.slots is None and fast.experts == general.experts
        for e in general.experts:
            assert torch.equal(fast.rows[e], general.rows[e]) and fast.rows[e].shape == general.rows[e].shape
            assert torch.equal(fast.weights[e], general.weights[e])
            assert fast.weights[e].shape == general.weights[e].shape == (1,)
        assert fast_sum.dtype == general_sum.dtype and torch.equal(fast_sum, general_sum)


def test_one_token_with_repeated_experts_takes_the_general_path() -> None:
    states = torch.randn(1, 8)
    routed = split_grouped(states, torch.tensor([[3, 3]]), torch.tensor([[0.5, 0.5]]))
    assert routed.slots is None and routed.experts == [3] and routed.count(3) == 2


@pytest.mark.parametrize(
    ("hidden", "intermediate", "expected"),
    [(64, 96, "grouped"), (75, 97, "eager"), (64, 97, "eager"), (128, 256, "grouped")],
)
def test_resolve_auto(hidden: int, intermediate: int, expected: str) -> None:
    assert grouped_mm_works(hidden, intermediate, torch.float32, CPU) == (expected == "grouped")
    assert resolve_arithmetic("auto", hidden, intermediate, torch.float32, CPU) == expected


@pytest.mark.parametrize("setting", ["grouped", "eager"])
def test_explicit_setting_wins(setting: str) -> None:
    assert resolve_arithmetic(setting, 75, 97, torch.float32, CPU) == setting
    assert resolve_arithmetic(setting, 64, 96, torch.float32, CPU) == setting


@pytest.mark.parametrize("bad", ["", "Grouped", "grouped_mm", "fast", None])
def test_bad_setting(bad) -> None:
    with pytest.raises(ValueError, match="experts arithmetic"):
        resolve_arithmetic(bad, 64, 96, torch.float32, CPU)


def test_routing_pairs() -> None:
    assert Routing("grouped").split is split_grouped
    assert Routing("grouped").combine is combine_grouped
    assert Routing("eager").split is split_eager
    assert Routing("eager").combine is combine_eager
    with pytest.raises(ValueError, match="grouped or eager"):
        Routing("auto")


def _answers(plan, act_fn, module: MixtralExperts) -> list[tuple[str, ExpertResult]]:
    """What each worker answers to the plan's requests: its segments' weighted outputs, computed
    by the workers' own ``expert_forward`` and sent as computed."""
    answers = []
    for worker, requests in plan.requests.items():
        for pieces, _ in requests:
            if not pieces:
                continue
            outputs = [
                expert_forward(
                    plan.rows[p.expert][p.offset : p.offset + p.count],
                    plan.weights[p.expert][p.offset : p.offset + p.count],
                    ExpertWeights(module.gate_up_proj[p.expert].detach(), module.down_proj[p.expert].detach()),
                    act_fn,
                )
                for p in pieces
            ]
            result = ExpertResult(
                request_id="s",
                step=1,
                layer=0,
                experts=[p.expert for p in pieces],
                counts=[p.count for p in pieces],
                offsets=[p.offset for p in pieces],
                output=torch.cat(outputs),
                wait_ms=0.0,
                compute_ms=0.0,
                hits=0,
                misses=0,
            )
            answers.append((f"worker-{worker}", result))
    return answers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("arithmetic", ["grouped", "eager"])
def test_main_sums_the_workers_answers_as_the_reference(arithmetic: str, dtype: torch.dtype) -> None:
    """Main's whole layer path (plan, the workers' answers, ``assemble``) gives the reference's bits.

    A half-precision model's routing weights are fp32, so each weighted output is an fp32 product:
    the grouped reference sums those before rounding once, and main must keep them unrounded until
    its sum (it once rounded them to the model's dtype on arrival, which is the eager arithmetic)."""
    hidden, intermediate, n_experts, top_k = ALIGNED[0]
    if arithmetic == "grouped" and not grouped_mm_works(hidden, intermediate, dtype, CPU):
        pytest.skip("torch's grouped GEMM cannot run these shapes; eager is the reference")
    config, module = _experts(hidden, intermediate, n_experts, top_k, dtype=dtype, seed=7)
    act_fn = activation(config.hidden_act)
    routing = Routing(arithmetic)
    assignment = {0: list(range(0, n_experts, 2)), 1: list(range(1, n_experts, 2))}
    for seed, (num_tokens, chunk) in enumerate([(1, 0), (5, 0), (40, 16)]):
        sequences = [_routing(num_tokens, hidden, n_experts, top_k, dtype, seed * 2 + i) for i in range(2)]
        routed = [routing.split(*s) for s in sequences]
        plan = plan_layer(routed, [num_tokens > 1] * 2, assignment, [0, 1], chunk)
        with torch.no_grad():
            got = assemble(plan, routed, _answers(plan, act_fn, module), routing, [dtype, dtype])
        implementation = "grouped_mm" if arithmetic == "grouped" else "eager"
        for (states, index, weights), mine in zip(sequences, got, strict=True):
            want = _reference(config, module, implementation, states, index, weights)
            assert mine.dtype == want.dtype
            assert torch.equal(mine, want), (arithmetic, dtype, num_tokens, (mine.float() - want.float()).abs().max())


def test_an_answer_counts_only_for_a_request_main_sent_that_worker_and_only_once() -> None:
    sent = [
        ExpertRequest(
            request_id="s",
            step=1,
            layer=0,
            experts=[2, 5],
            counts=[1, 2],
            offsets=[0, 4],
            rows=torch.zeros(3, 8),
            weights=torch.ones(3),
        )
    ]

    def answer(experts=(2, 5), offsets=(0, 4), output=None) -> ExpertResult:
        output = torch.ones(3, 8) if output is None else output
        return ExpertResult(
            request_id="s",
            step=1,
            layer=0,
            experts=list(experts),
            counts=[1, 2],
            offsets=list(offsets),
            output=output,
            wait_ms=0.0,
            compute_ms=0.0,
            hits=0,
            misses=0,
        )

    assert answered_request(answer(), sent, set()) == 0
    assert answered_request(answer(), sent, {0}) is None  # a second answer to it
    assert answered_request(answer(experts=(2, 6)), sent, set()) is None  # an expert it was not asked
    assert answered_request(answer(offsets=(0, 0)), sent, set()) is None  # rows it was not sent
    assert answered_request(answer(output=torch.ones(2, 8)), sent, set()) is None
    assert answered_request(answer(output=torch.ones(3, 8, dtype=torch.long)), sent, set()) is None
