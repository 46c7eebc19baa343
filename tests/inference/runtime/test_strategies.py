"""Strategies: their pure decisions, the device cache, and each one's exactness end to end."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from inference.policies.depth import resolve_depth
from inference.policies.placement import placement
from inference.policies.strategies import (
    STRATEGIES,
    dispatch_plan,
    get_strategy,
    home_experts,
    home_worker,
    lru_evictions,
    predictor_for,
    prefetch_on_prediction,
    prefill_prefetch,
)
from inference.runtime.cache import DeviceCache
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings, SpecError, validate_settings
from tests.reference import PROMPTS, reference_generate

PLAN = placement(n_layers=4, n_experts=8, top_k=2, n_workers=8)  # groups (0,1) (2,3) (4,5) (6,7)


# --- pure decisions ----------------------------------------------------------------------


def test_every_strategy_has_a_name_and_unknown_ones_are_refused() -> None:
    assert [get_strategy(name).name for name in STRATEGIES] == list(STRATEGIES)
    with pytest.raises(ValueError, match="strategy must be one of odmoe, full-cache, reactive, lru-offload"):
        get_strategy("belady")
    assert get_strategy("odmoe").predictor == "shadow" and get_strategy("lru-offload").predictor != "shadow"
    assert get_strategy("lru-offload").predictor == "next-gate"


def test_a_predictor_is_the_strategys_own_unless_one_is_chosen() -> None:
    assert [predictor_for(name) for name in STRATEGIES] == ["shadow", None, None, "next-gate"]
    assert predictor_for("odmoe", "next-gate") == "next-gate"
    assert predictor_for("lru-offload", "shadow") == "shadow"
    with pytest.raises(ValueError, match="reactive loads only what is routed and takes no predictor"):
        predictor_for("reactive", "shadow")
    with pytest.raises(ValueError, match="predictor must be one of shadow, next-gate"):
        predictor_for("odmoe", "oracle")
    with pytest.raises(SpecError, match="full-cache loads only what is routed"):
        validate_settings(DeploymentSettings(strategy="full-cache", predictor="next-gate"))
    assert [get_strategy(n).fixed_homes for n in STRATEGIES] == [False, True, False, True]


def test_home_workers_split_a_layers_experts_evenly_over_its_group() -> None:
    assert [home_worker(e, (2, 3)) for e in range(8)] == [2, 3, 2, 3, 2, 3, 2, 3]
    assert home_experts(PLAN, 3) == [(1, 1), (1, 3), (1, 5), (1, 7)]
    single = placement(n_layers=2, n_experts=4, top_k=2, n_workers=1)
    assert home_experts(single, 0) == [(layer, e) for layer in range(2) for e in range(4)]


def test_caching_strategies_send_each_expert_home_in_prefill_and_decode() -> None:
    for strategy in (get_strategy("full-cache"), get_strategy("lru-offload")):
        for step in (0, 5):
            plan, told = dispatch_plan(strategy, PLAN, step, layer=2, real=[7, 0, 3], predicted=[1, 2])
            assert plan == {4: [0], 5: [3, 7]}
            assert told == [4, 5]


def test_cacheless_strategies_keep_the_odmoe_dispatch() -> None:
    odmoe = get_strategy("odmoe")
    plan, told = dispatch_plan(odmoe, PLAN, 0, layer=2, real=[0, 3, 7], predicted=None)
    assert plan == {0: [0], 3: [3], 7: [7]} and told == list(range(8))  # prefill: expert e on worker e
    plan, told = dispatch_plan(odmoe, PLAN, 4, layer=2, real=[3, 6], predicted=[3, 6])
    assert plan == {4: [3], 5: [6]} and told == [4, 5]  # each predicted expert where it was preloaded


def test_prefetches_follow_the_strategy() -> None:
    assert prefetch_on_prediction(get_strategy("odmoe"), [6, 3], (4, 5), 4) == [3]
    assert prefetch_on_prediction(get_strategy("lru-offload"), [6, 3], (4, 5), 4) == [6]
    assert prefill_prefetch(get_strategy("full-cache"), PLAN, 0) == [(0, 0), (0, 2), (0, 4), (0, 6)]
    assert prefill_prefetch(get_strategy("odmoe"), PLAN, 0) == [(layer, 0) for layer in range(4)]


def test_lru_evictions_free_the_least_recently_used_of_the_layer() -> None:
    order = [(0, 1), (1, 4), (0, 3), (0, 5), (1, 2)]
    assert lru_evictions(order, 0, 2) == [(0, 1)]
    assert lru_evictions(order, 1, 2) == []
    assert lru_evictions(order, 0, 0) == [(0, 1), (0, 3), (0, 5)]


def test_device_cache_keeps_recent_experts_per_layer_and_counts_bytes() -> None:
    cache: DeviceCache[str] = DeviceCache(2)
    for expert in (1, 2):
        assert cache.admit((0, expert), f"e{expert}", 10) == []
    cache.admit((1, 9), "other layer", 5)
    assert cache.get((0, 1)) == "e1"  # now most recent: expert 2 goes next
    assert cache.admit((0, 3), "e3", 10) == ["e2"]
    assert (0, 2) not in cache and (0, 1) in cache and (0, 3) in cache
    assert cache.nbytes() == 25 and len(cache) == 3
    unbounded: DeviceCache[str] = DeviceCache(None)
    for expert in range(8):
        unbounded.admit((0, expert), "x", 1)
    assert len(unbounded) == 8
    assert DeviceCache(0).admit((0, 1), "kept nowhere", 1) == ["kept nowhere"]
    assert cache.admit((0, 3), "e3 again", 10) == ["e3"]  # the replaced copy is handed back too
    with pytest.raises(ValueError):
        DeviceCache(-1)


def test_settings_name_what_is_wrong() -> None:
    with pytest.raises(SpecError, match="strategy must be one of"):
        validate_settings(DeploymentSettings(strategy="mru"))
    with pytest.raises(SpecError, match="link_bytes_per_s must be > 0"):
        validate_settings(DeploymentSettings(link_bytes_per_s=0.0))
    with pytest.raises(SpecError, match="cache_experts"):
        validate_settings(DeploymentSettings(cache_experts=-1))
    validate_settings(DeploymentSettings(strategy="lru-offload", link_bytes_per_s=1e8, link_latency_s=1e-4))


# --- end to end: exact, and each strategy holds what it says ---------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "workers"),
    # odmoe's exactness has its own tests (test_runtime_e2e.py); it is here once for the set.
    [("odmoe", 3), ("full-cache", 8), ("full-cache", 1), ("reactive", 8), ("lru-offload", 1), ("lru-offload", 3)],
)
def test_every_strategy_is_token_identical_to_transformers(tiny_model: Path, strategy: str, workers: int) -> None:
    generator = random.Random(3)
    long_prompt = [1] + [generator.randrange(3, 500) for _ in range(90)]  # prefilled in mini-batches
    prompts = [PROMPTS[0], PROMPTS[2], long_prompt]
    options = ClusterOptions(
        workers=workers, settings=DeploymentSettings(strategy=strategy, prefill_chunk=16), in_process=True
    )
    with LocalCluster(tiny_model, options) as cluster:
        assert ("shadow" in cluster.roles) == (strategy == "odmoe")
        results = [cluster.generate(prompt, 24) for prompt in prompts]
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_generate(tiny_model, prompt, 24)
    metrics = results[1].metrics
    one_expert = metrics["expert_bytes"]
    peak = max(metrics["worker_peak_expert_bytes"].values())
    layers, experts, top_k = 4, 8, 2  # the tiny model's shape
    # What each worker's loader holds at once: its layer's experts + 1, or the link's two.
    groups = placement(layers, experts, top_k, workers).groups
    in_flight = max(resolve_depth(0, top_k, len(members)) for members in groups)
    if strategy == "full-cache":
        assert peak == one_expert * layers * experts // workers  # each expert has one home
        assert metrics["recall"] == 0.0  # nothing predicted, nothing needed
    elif strategy == "lru-offload":
        assert peak <= one_expert * (2 * layers + in_flight)  # two cached per layer, the rest in flight
        assert metrics["recall"] > 0.3  # the next router's guess names many experts
    else:
        assert peak <= in_flight * one_expert


@pytest.mark.slow
def test_odmoe_on_mains_next_gate_predictor_runs_no_shadow_and_stays_exact(tiny_model: Path) -> None:
    """``predictor="next-gate"``: main's next-layer router names what the workers load ahead."""
    options = ClusterOptions(
        workers=4, settings=DeploymentSettings(strategy="odmoe", predictor="next-gate"), in_process=True
    )
    with LocalCluster(tiny_model, options) as cluster:
        assert "shadow" not in cluster.roles
        results = [cluster.generate(prompt, 24) for prompt in PROMPTS[:3]]
    for prompt, result in zip(PROMPTS[:3], results, strict=True):
        assert result.token_ids == reference_generate(tiny_model, prompt, 24)
        metrics = result.metrics
        assert metrics["shadow"] is None
        # Every decode layer but the first has main's guess, made one layer before it is served.
        assert metrics["prediction_in_time"] == pytest.approx(3 / 4)
        assert metrics["prediction_lead_layers"] == 1
        assert metrics["recall"] > 0.3
        assert max(metrics["worker_peak_expert_bytes"].values()) <= 2 * metrics["expert_bytes"]  # cacheless
