"""The prefetch depth: the rule by hand, bad input, and what the simulators do with it."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.sim_prediction import predict_from_inputs
from inference.building.memory import memory_from_config
from inference.building.role_memory import CUDA_CONTEXT_BYTES
from inference.policies.depth import LINK_DEPTH, prefetch_depth, resolve_depth, worker_depth
from inference.settings import DeploymentSettings
from inference.sim.hardware import PROFILES
from inference.sim.model_sizes import mixtral_8x7b
from inference.sim.report import compare
from inference.sim.strategies import Cluster
from inference.sim.traces import synthetic_trace
from inference.tools.emulation import emulation_for
from tests.paths import REPO

VALIDATION = REPO / "inference" / "sim" / "validation"


@pytest.mark.parametrize(
    ("copy_s", "hold_s", "depth"),
    [
        (14.1e-3, 0.55e-3, 2),  # Mixtral over PCIe 4: one computing while the next is copied
        (1.0, 1.0, 2),  # freed exactly as the next copy ends
        (1.0, 1.5, 3),  # compute longer than a copy: a slot more keeps the link busy
        (0.5e-3, 2.0e-3, 5),
    ],
)
def test_the_rule_by_hand(copy_s: float, hold_s: float, depth: int) -> None:
    assert prefetch_depth(copy_s, hold_s) == depth
    # The rule's condition, and the least depth that meets it: (D - 1) copies cover the hold.
    assert (depth - 1) * copy_s >= hold_s > (depth - 2) * copy_s


@pytest.mark.parametrize(("copy_s", "hold_s"), [(0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, 0.0), (1.0, math.inf)])
def test_bad_times_are_refused(copy_s: float, hold_s: float) -> None:
    with pytest.raises(ValueError, match="positive number of seconds"):
        prefetch_depth(copy_s, hold_s)


def test_every_profiles_emulation_gets_the_rules_depth() -> None:
    for name in PROFILES:
        emulation = emulation_for(name, 0.001, 10_000_000, 2048)
        assert emulation.prefetch_depth == prefetch_depth(emulation.expert_load_real_s, emulation.expert_compute_real_s)
        assert emulation.as_dict()["prefetch_depth"] == emulation.prefetch_depth


def test_the_paper_simulator_takes_the_rules_depth_and_holds_a_slot_per_expert() -> None:
    """Measured in the paper-testbed model (README, *Prefetch depth*): at the rule's depth (2) odmoe
    decodes as fast as with more slots, one slot fewer is slower, and each slot costs an expert."""
    model, trace = mixtral_8x7b(), synthetic_trace(mixtral_8x7b(), 64)

    def odmoe(depth: int | None) -> dict:
        result = compare(model, "3090-pcie4-1gbe", Cluster(prefetch_depth=depth), trace, ["odmoe"])
        return {"depth": result["prefetch_depth"]["depth"], **result["strategies"]["odmoe"]["adjusted"]}

    rule, one, three = odmoe(None), odmoe(1), odmoe(3)
    assert rule["depth"] == 2
    assert one["decode_tok_s"] < rule["decode_tok_s"] == pytest.approx(three["decode_tok_s"])
    slot = three["memory_bytes"]["worker0"] - rule["memory_bytes"]["worker0"]
    assert slot == pytest.approx(model.expert_bytes())
    assert rule["memory_bytes"]["worker0"] - one["memory_bytes"]["worker0"] == pytest.approx(slot)


def test_a_depth_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="prefetch_depth must be at least 1"):
        Cluster(prefetch_depth=0)


@pytest.mark.parametrize(
    ("top_k", "members", "depth"),
    [
        (2, 2, 2),  # Mixtral on groups of two: one expert a layer each, the link's 2
        (2, 4, 2),
        (2, 1, 3),  # both of a layer's experts on one worker, and a slot for the next layer's
        (8, 2, 5),  # a fine-grained family on fewer workers than its top-k
        (6, 4, 3),
    ],
)
def test_a_workers_depth_is_the_links_or_its_layers_experts_and_one(top_k: int, members: int, depth: int) -> None:
    assert worker_depth(top_k, members) == depth
    assert resolve_depth(0, top_k, members) == depth  # 0: the default, from the group
    assert resolve_depth(7, top_k, members) == 7  # a setting is kept
    assert worker_depth(2, 2, link_depth=4) == 4  # a link that needs more


def test_the_depth_refuses_what_is_no_deployment() -> None:
    assert LINK_DEPTH == 2
    with pytest.raises(ValueError, match="at least 1"):
        worker_depth(0, 2)
    with pytest.raises(ValueError, match="at least 1"):
        worker_depth(2, 0)
    with pytest.raises(ValueError, match=">= 0"):
        resolve_depth(-1, 2, 2)


def test_the_memory_plan_reserves_each_workers_own_depth() -> None:
    """A cacheless worker's device holds its depth's experts: 2 on Mixtral's groups of two, 3 when one
    worker serves the whole layer, and what a setting says when it says one."""
    expert = 3 * 4096 * 14336 * 2  # a bf16 Mixtral-8x7B expert

    def device(workers: int, setting: int) -> int:
        plan = memory_from_config(
            "mixtral-8x7b", workers=workers, settings=DeploymentSettings(max_resident_experts=setting)
        )
        return plan.role("worker-0").gpu_bytes - CUDA_CONTEXT_BYTES

    assert device(8, 0) == 2 * expert
    assert device(1, 0) == 3 * expert
    assert device(1, 2) == 2 * expert and device(8, 4) == 4 * expert


def test_our_runtimes_model_gains_nothing_past_the_rules_depth_on_the_recorded_run() -> None:
    """`inference.sim.local` on the recorded 8-worker inputs at 1 to 4 slots (README, *Prefetch
    depth*): one slot fewer than the rule is slower, more are no faster for odmoe."""
    recorded = json.loads((VALIDATION / "strategies-8-workers.json").read_text())
    assert recorded["inputs"]["shape"]["max_resident"] == LINK_DEPTH  # what the run held

    def odmoe_at(depth: int) -> float:
        inputs = dict(recorded["inputs"], shape=dict(recorded["inputs"]["shape"], max_resident=depth))
        return predict_from_inputs(inputs, ["odmoe"])["odmoe"]

    at = {depth: odmoe_at(depth) for depth in (1, 2, 3, 4)}
    assert at[1] < at[2]
    assert at[3] == pytest.approx(at[2], rel=1e-9) and at[4] == pytest.approx(at[2], rel=1e-9)
    assert at[2] == pytest.approx(recorded["predicted_decode_tok_s"]["odmoe"], rel=1e-9)
