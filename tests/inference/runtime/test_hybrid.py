"""Hybrid CPU/GPU execution: the per-expert decision, the loader's snapshot it reads, the emulated
CPU path, and a cluster that computes late experts on its workers' CPUs with exact output."""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from benchmarks.streams import run_streams
from inference.modelio.checkpoint import Checkpoint, expert_key_name
from inference.policies.hybrid import (
    CopyState,
    HostRates,
    ShareController,
    copy_eta,
    cpu_seconds,
    expert_flops,
    planned_on_cpu,
    predicted_share,
    share_delay,
    split,
)
from inference.runtime.experts import activation
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.loader import ExpertLoader, measure_host_rates
from inference.runtime.spec import DeploymentSettings, SpecError, validate_settings
from inference.sim.hardware import get_profile
from inference.sim.model_sizes import mixtral_8x7b
from inference.tools.emulation import emulation_for, real_times
from inference.wire.generation import Done
from tests.inference.runtime.test_loader import EXPERT_BYTES, MemoryStore, _wait_until
from tests.reference import PROMPTS, reference_generate

RATES = HostRates(memory_bytes_per_s=1e9, flops=1e12, copy_bytes_per_s=1e8)
MB = 1_000_000  # an expert of 1 MB: 1 ms on the CPU, 10 ms to copy at these rates


def test_the_cpu_path_is_its_memory_read_or_its_arithmetic_whichever_is_longer() -> None:
    assert cpu_seconds(MB, 1e6, RATES) == pytest.approx(1e-3)  # one row: the weights' read
    assert cpu_seconds(MB, 4e9, RATES) == pytest.approx(4e-3)  # many rows: the FLOPs
    assert expert_flops(4096, 14336, 1) == 2 * 3 * 4096 * 14336
    with pytest.raises(ValueError, match="positive"):
        HostRates(memory_bytes_per_s=0.0, flops=1.0, copy_bytes_per_s=1.0)


def test_a_copys_eta_counts_the_pass_under_way_and_the_copies_queued_before_it() -> None:
    copy_s = 0.010
    assert copy_eta(CopyState("ready"), copy_s) == 0.0
    assert copy_eta(CopyState("loading", 1, 2, 0.004), copy_s) == pytest.approx(0.016)  # second of its pass
    assert copy_eta(CopyState("queued", 2, 1, 0.004), copy_s) == pytest.approx(0.006 + 0.020 + 0.010)
    assert copy_eta(CopyState("queued", 2, 1, 0.004), copy_s, dropped_ahead=2) == pytest.approx(0.016)
    assert copy_eta(CopyState("absent", 0, 0, 0.0), copy_s) == pytest.approx(0.010)  # copied next


def test_a_late_expert_runs_on_the_cpu_and_one_on_the_device_never_does() -> None:
    ready, late = CopyState("ready"), CopyState("absent")
    assert split([(MB, 1e6, ready), (MB, 1e6, late)], 0.010, RATES) == [False, True]


def test_the_cpu_does_its_experts_one_after_another() -> None:
    # 4 ms each on the CPU against a 10 ms copy: two fit before the copy would be done, the third does not
    slow_cpu = HostRates(memory_bytes_per_s=0.25e9, flops=1e12, copy_bytes_per_s=1e8)
    units = [(MB, 1e6, CopyState("absent"))] * 3
    assert split(units, 0.010, slow_cpu) == [True, True, False]


def test_a_copy_almost_done_stays_and_dropped_copies_move_the_later_ones_up() -> None:
    almost = CopyState("loading", 0, 1, 0.0095)  # 0.5 ms left against 1 ms on the CPU
    assert split([(MB, 1e6, almost)], 0.010, RATES) == [False]
    # Two queued copies behind a pass with 10 ms left: the first goes to the CPU (1 ms < 20 ms), the
    # second then waits 10 + 10 ms for its copy, against 2 ms on the CPU: the CPU again.
    queued = [(MB, 1e6, CopyState("queued", 0, 1, 0.0)), (MB, 1e6, CopyState("queued", 1, 1, 0.0))]
    assert split(queued, 0.010, RATES) == [True, True]
    fast_copy = HostRates(memory_bytes_per_s=1e9, flops=1e12, copy_bytes_per_s=1e10)
    assert split(queued, 0.0001, fast_copy) == [False, False]


def test_the_planned_shares_ceiling_balances_a_groups_copies_against_its_cpu_layers_alone() -> None:
    # The emulated edge profile: 14.1 ms a copy, 8.8 ms on the CPU, 4 groups: c / (G h + c) = 0.286,
    # rounded down to sixteenths: the last at which a group's link, copying (1 - s) of its 2 layers'
    # experts per token, takes no less than the four groups' CPU layers (8 s per token) on the critical path.
    share = predicted_share(0.0141, 0.0088, 4)
    assert share == Fraction(4, 16)
    assert 2 * (1 - share) * 14.1 >= 8 * share * 8.8
    assert 2 * (1 - share - Fraction(1, 16)) * 14.1 < 8 * (share + Fraction(1, 16)) * 8.8
    assert predicted_share(0.02, 0.002, 1) == Fraction(14, 16)  # one group: most layers on the CPUs
    assert predicted_share(0.001, 0.1, 4) == Fraction(0)  # a CPU 100x slower than a copy: never planned
    with pytest.raises(ValueError, match="positive"):
        predicted_share(0.0, 0.01, 4)


def feed(control: ShareController, period_of) -> list[Fraction]:
    """Shares held after each window, the period a function of the share (one token a step)."""
    shares = []
    step = 0
    for _ in range(12):
        for _ in range(control.window):
            step += 1
            control.observe(step, period_of(control.share))
        shares.append(control.share)
    return shares


def test_the_share_climbs_while_the_decode_period_shortens_and_holds_the_best() -> None:
    # Decode at the longer of a worker's copies, 78 (1 - s) ms, and the critical path, 27 + 195 s ms:
    # the best sixteenth is 3/16 (63.4 and 63.6 ms); 4/16, the ceiling, is tried and undone (75.8 ms).
    control = ShareController(Fraction(4, 16), window=4)
    shares = feed(control, lambda s: max(0.078 * (1 - float(s)), 0.027 + 0.195 * float(s)))
    assert shares[:5] == [Fraction(n, 16) for n in (1, 2, 3, 4, 3)]
    assert control.holding and set(shares[4:]) == {Fraction(3, 16)}
    # Copies that do not bind: the first step up gains nothing and is undone.
    idle = ShareController(Fraction(4, 16), window=4)
    assert set(feed(idle, lambda s: 0.1 + 0.195 * float(s))[1:]) == {Fraction(0)}
    # Never past the ceiling, however much each step gains.
    capped = ShareController(Fraction(2, 16), window=1)
    assert max(feed(capped, lambda s: 1.0 - float(s))) == Fraction(2, 16)


def test_a_held_share_whose_period_grows_is_measured_again_from_zero() -> None:
    control = ShareController(Fraction(4, 16), window=2)
    feed(control, lambda s: max(0.078 * (1 - float(s)), 0.027 + 0.195 * float(s)))
    assert control.holding and control.share == Fraction(3, 16)
    for step in (100, 101):
        control.observe(step, 0.2)  # the machine slowed: 3x the best period
    assert (control.share, control.holding, control.best) == (Fraction(0), False, None)
    with pytest.raises(ValueError, match="ceiling"):
        ShareController(Fraction(3, 2))


def test_a_window_of_periods_never_spans_two_sessions() -> None:
    control = ShareController(Fraction(4, 16), window=2)
    control.observe(20, 0.1)  # the last token of one session
    control.new_session()
    control.observe(1, 0.1)  # one token of the next: the window is not full yet
    assert control.best is None and control.share == 0
    control.observe(2, 0.1)
    assert control.best == (Fraction(0), pytest.approx(0.1)) and control.share == Fraction(1, 16)


def test_a_changed_share_plans_from_a_fixed_later_step_and_counts_only_its_own_tokens() -> None:
    # lookahead 2: token 4's period is heard with step 5's request, when predictions up to step 7
    # may already have been planned; the change plans from step 8 on.
    assert share_delay(2) == 4 and share_delay(0) == 2
    control = ShareController(Fraction(4, 16), window=2, delay=share_delay(2))
    control.observe(3, 0.1)
    control.observe(4, 0.1)  # the window of share 0 is full: 1/16 is tried, from step 8
    assert control.share == Fraction(1, 16) and control.effective == 8
    assert [control.share_at(s) for s in (5, 7, 8, 30)] == [0, 0, Fraction(1, 16), Fraction(1, 16)]
    for step in range(5, 8):
        control.observe(step, 0.01)  # planned with share 0 still: not counted, however fast
    assert control.best == (Fraction(0), pytest.approx(0.1)) and control.share == Fraction(1, 16)
    control.observe(8, 0.1)
    control.observe(9, 0.1)  # 1/16 gained nothing: back to 0, from step 13
    assert (control.share, control.effective, control.holding) == (Fraction(0), 13, True)
    assert [control.share_at(s) for s in (12, 13)] == [Fraction(1, 16), 0]
    control.new_session()  # session steps count from 0 again: the share reached plans them all
    assert control.share_at(0) == 0 and control.effective == 0
    with pytest.raises(ValueError, match="lookahead"):
        share_delay(-1)


@pytest.mark.parametrize(("groups", "share"), [(4, Fraction(4, 16)), (1, Fraction(3, 16)), (2, Fraction(5, 16))])
def test_planned_layers_are_the_share_of_each_group_evenly_spaced_in_the_generations_order(
    groups: int, share: Fraction
) -> None:
    layers, tokens = 8, 42
    picked = [
        (step, layer)
        for step in range(1, tokens + 1)
        for layer in range(layers)
        if planned_on_cpu(step, layer, [la for la in range(layers) if la % groups == layer % groups], groups, share)
    ]
    per_group = [sum(1 for _, layer in picked if layer % groups == g) for g in range(groups)]
    slots = tokens * layers // groups
    assert all(abs(n - share * slots) <= 1 for n in per_group)
    per_token = {step: sum(1 for s, _ in picked if s == step) for step in range(1, tokens + 1)}
    assert set(per_token.values()) <= {int(share * layers), int(share * layers) + 1}  # never bunched in one token
    assert not any(planned_on_cpu(s, la, [la], 1, Fraction(0)) for s in range(9) for la in range(8))


def test_the_loader_reports_where_each_copy_stands(request: pytest.FixtureRequest) -> None:
    loader = ExpertLoader(MemoryStore(), torch.device("cpu"), max_resident=2, copy_bytes_per_s=EXPERT_BYTES / 0.2)
    request.addfinalizer(loader.close)  # 200 ms a copy
    for expert in range(4):
        loader.prefetch((1, 0, expert))
    _wait_until(lambda: loader.copy_states([(1, 0, 0)])[(1, 0, 0)].where == "loading")
    states = loader.copy_states([(1, 0, e) for e in range(5)])
    assert states[(1, 0, 0)].where == "loading" and states[(1, 0, 0)].pass_size == 2
    assert states[(1, 0, 1)] == CopyState("loading", 1, 2, states[(1, 0, 1)].pass_elapsed_s)
    assert states[(1, 0, 2)].where == "queued" and states[(1, 0, 2)].position == 0
    assert states[(1, 0, 3)].position == 1 and states[(1, 0, 4)].where == "absent"
    _wait_until(lambda: loader.copy_states([(1, 0, 0)])[(1, 0, 0)].where == "ready", timeout_s=5)


def test_a_host_measures_its_own_rates() -> None:
    rates = measure_host_rates(MemoryStore(), torch.device("cpu"), activation("silu"), rounds=2)
    assert rates.memory_bytes_per_s > 0 and rates.flops > 0 and rates.copy_bytes_per_s > 0


def test_the_emulated_cpu_path_keeps_the_profiles_dram_to_compute_proportion() -> None:
    here_s, expert_bytes, flops_here = 0.002, 10_000_000, 5e6
    emulation = emulation_for("3090-pcie4-1gbe", here_s, expert_bytes, 2048, expert_flops_here=flops_here)
    profile = get_profile("3090-pcie4-1gbe")
    compute, _, _ = real_times(profile)
    cpu_real = mixtral_8x7b().expert_bytes(16) / profile.host_memory.effective  # ~8.8 ms on DDR4-3200
    assert emulation.expert_cpu_real_s == pytest.approx(cpu_real)
    assert expert_bytes / emulation.host_memory_bytes_per_s / here_s == pytest.approx(cpu_real / compute)
    row_real = 2 * mixtral_8x7b().expert_params / profile.host_cpu_flops
    assert flops_here / emulation.host_flops / here_s == pytest.approx(row_real / compute)
    settings = emulation.settings(DeploymentSettings(hybrid=True))
    assert settings.host_memory_bytes_per_s == emulation.host_memory_bytes_per_s and settings.hybrid
    assert emulation_for("3090-pcie4-1gbe", here_s, expert_bytes, 2048).host_flops is None


def test_hybrid_execution_needs_experts_in_host_memory() -> None:
    validate_settings(DeploymentSettings(hybrid=True))
    with pytest.raises(SpecError, match="needs the ram expert store, not 'disk'"):
        validate_settings(DeploymentSettings(hybrid=True, expert_store="disk"))
    with pytest.raises(SpecError, match="needs the ram expert store, not 'hot'"):
        validate_settings(DeploymentSettings(hybrid=True, strategy="prerouter"))
    with pytest.raises(SpecError, match="host_memory_bytes_per_s must be > 0"):
        validate_settings(DeploymentSettings(hybrid=True, host_memory_bytes_per_s=0.0))


# The group's two workers log each change of the share, and the step it plans from.
SHARE_CHANGE = re.compile(r"(\S+) of the group's decode layers planned on the CPUs from session step (\d+)")


def fast_cpu_settings(model: Path, strategy: str) -> DeploymentSettings:
    """Copies of 20 ms against 2 ms on the CPU: every expert that is not on the device goes to the
    CPU, and under odmoe (one group of two) up to 14 of every 16 layers' predicted experts may be
    planned there."""
    checkpoint = Checkpoint(model)
    expert_bytes = sum(checkpoint.nbytes(expert_key_name(0, 0, p)) for p in ("w1", "w2", "w3"))
    return DeploymentSettings(
        strategy=strategy,
        hybrid=True,
        copy_bytes_per_s=expert_bytes / 0.020,
        host_memory_bytes_per_s=expert_bytes / 0.002,
        host_flops=1e15,
    )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["reactive", "lru-offload", "odmoe"])
def test_late_experts_computed_on_the_workers_cpus_give_the_reference_tokens(tiny_model: Path, strategy: str) -> None:
    settings = fast_cpu_settings(tiny_model, strategy)
    # odmoe's check reads each worker's own log: processes; the others' read none: threads.
    options = ClusterOptions(workers=2, settings=settings, in_process=strategy != "odmoe")
    with LocalCluster(tiny_model, options) as cluster:
        results = [cluster.generate(prompt, 12) for prompt in PROMPTS[:2]]
        logs = [(cluster.work_dir / f"worker-{w}.log").read_text() for w in range(2)] if strategy == "odmoe" else []
    for prompt, result in zip(PROMPTS[:2], results, strict=True):
        assert result.token_ids == reference_generate(tiny_model, prompt, 12)
        assert result.metrics["cpu_experts"] > 0
    if strategy == "odmoe":
        # The group's two workers change the share alike, from the same steps: they hear the same
        # periods from main. The first change is certain (8 decode periods in, 1/16 is tried).
        changes = [SHARE_CHANGE.findall(log) for log in logs]
        assert changes[0] == changes[1] and changes[0][0] == ("1/16", "12"), changes


@pytest.mark.slow
def test_a_sequence_left_alone_in_its_session_is_planned_again_from_a_step_every_worker_agrees_on(
    tiny_model: Path,
) -> None:
    # A long stream and a short one that joins it: once the short one has left, the group's
    # workers plan for the long one again, from the same step, and change its share alike.
    prompts, new_tokens = [PROMPTS[0], PROMPTS[1]], [30, 4]
    options = ClusterOptions(workers=2, settings=fast_cpu_settings(tiny_model, "odmoe"))
    with LocalCluster(tiny_model, options) as cluster:
        results = run_streams(cluster, prompts, new_tokens, stagger_s=0.05)
        logs = [(cluster.work_dir / f"worker-{w}.log").read_text() for w in range(2)]
    for prompt, n, result in zip(prompts, new_tokens, results, strict=True):
        assert isinstance(result, Done), result
        assert result.token_ids == reference_generate(tiny_model, prompt, n)
    assert results[1].metrics["max_batch"] == 2  # the short one ran beside the long one
    left = results[1].metrics["joined_step"] + len(results[1].token_ids) - 1  # the session step of its last token
    alone = [re.findall(r"one sequence again, planned from session step (\d+)", log) for log in logs]
    assert alone[0] == alone[1] == [str(left + share_delay(DeploymentSettings().lookahead))], alone
    changes = [SHARE_CHANGE.findall(log) for log in logs]
    # 8 decode periods after it, 1/16 is tried (the long stream has 20 steps left): certain.
    assert changes[0] == changes[1] and changes[0], changes
    assert changes[0][0][0] == "1/16" and int(changes[0][0][1]) >= int(alone[0][0]) + 8, changes
