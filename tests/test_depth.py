"""The prefetch depth: the rule by hand, bad input, and what the simulators do with it."""

from __future__ import annotations

import math

import pytest

from inference.depth import prefetch_depth
from inference.emulation import emulation_for
from inference.sim.hardware import PROFILES
from inference.sim.model_sizes import mixtral_8x7b
from inference.sim.report import compare
from inference.sim.strategies import Cluster
from inference.sim.traces import synthetic_trace


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
