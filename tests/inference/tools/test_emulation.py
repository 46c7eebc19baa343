"""Emulated hardware: the token-bucket settings keep a real cluster's proportions."""

from __future__ import annotations

import pytest

from inference.runtime.spec import DeploymentSettings
from inference.sim.hardware import get_profile
from inference.tools.emulation import emulation_for, measure_expert_compute, real_times

MIXTRAL_EXPERT = 3 * 4096 * 14336 * 2  # fp16 bytes


def test_real_times_are_the_profiles_roofline_for_a_mixtral_expert() -> None:
    profile = get_profile("3090-pcie4-1gbe")
    compute, load, hop = real_times(profile)
    assert compute == pytest.approx(MIXTRAL_EXPERT / 936e9)  # ~0.376 ms: reading the weights once
    assert load == pytest.approx(MIXTRAL_EXPERT / profile.host_to_device.effective + profile.host_to_device.latency)
    assert 30 < load / compute < 45  # PCIe is ~37x slower than the GPU's memory
    assert hop == pytest.approx(4096 * 2 / profile.network.effective + profile.network.latency)


def test_emulation_scales_every_time_by_the_compute_ratio() -> None:
    here_s, expert_bytes, hidden_bytes = 0.002, 10_000_000, 2048
    emulation = emulation_for("3090-pcie4-1gbe", here_s, expert_bytes, hidden_bytes)
    compute, load, hop = real_times(get_profile("3090-pcie4-1gbe"))
    assert emulation.scale == pytest.approx(here_s / compute)
    emulated_load = expert_bytes / emulation.copy_bytes_per_s
    assert emulated_load / here_s == pytest.approx(load / compute)  # the load:compute ratio is the profile's
    emulated_hop = hidden_bytes / emulation.link_bytes_per_s + emulation.link_latency_s
    assert emulated_hop / here_s == pytest.approx(hop / compute)
    assert "profile 3090-pcie4-1gbe" in emulation.describe()


def test_settings_carry_the_emulation_and_one_box_has_no_network() -> None:
    emulation = emulation_for("3090-pcie4-10gbe", 0.001, 1_000_000, 1024)
    networked = emulation.settings(DeploymentSettings(strategy="full-cache"))
    assert networked.strategy == "full-cache" and networked.copy_bytes_per_s == emulation.copy_bytes_per_s
    assert networked.link_bytes_per_s == emulation.link_bytes_per_s and networked.link_latency_s > 0
    local = emulation.settings(DeploymentSettings(), networked=False)
    assert local.link_bytes_per_s is None and local.link_latency_s == 0.0


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        emulation_for("3090-pcie4-1gbe", 0.0, 1, 1)
    with pytest.raises(ValueError, match="unknown hardware profile"):
        emulation_for("abacus", 0.001, 1, 1)


def test_expert_compute_is_measured_here() -> None:
    small, large = measure_expert_compute(32, 64, repeats=50), measure_expert_compute(512, 2048, repeats=50)
    assert 0 < small < large
