"""Hybrid execution at a worker, its CPU path (``DeploymentSettings.hybrid``; the decisions are
``inference.policies.hybrid``'s): its rates, the planned share's controller, which of a request's experts
run on the CPU, and computing them there.

The choices are functions of the rates and the loader's copy states; only ``compute_on_host``
touches tensors.
"""

from __future__ import annotations

import logging
import time
from fractions import Fraction

import torch

from inference.policies.hybrid import HostRates, ShareController, cpu_seconds, expert_flops, predicted_share, split
from inference.policies.loads import Key
from inference.runtime.experts import expert_forward
from inference.runtime.loader import measure_host_rates
from inference.runtime.roles.worker.session import Session
from inference.runtime.spec import DeploymentSettings
from inference.wire.runtime import ExpertRequest

log = logging.getLogger(__name__)


class CpuExperts(set[int]):
    """The experts of one request computed on the CPU, and how many of them had been predicted."""

    predicted: int = 0


def host_rates(settings: DeploymentSettings, store, device: torch.device, act_fn, index: int) -> HostRates:
    """The rates hybrid execution decides with: the emulated ones, else measured here at start."""
    given = (settings.host_memory_bytes_per_s, settings.host_flops, settings.copy_bytes_per_s)
    if all(given):  # emulated: nothing to measure
        rates = HostRates(*given)  # type: ignore[arg-type]
    else:
        measured = measure_host_rates(store, device, act_fn)
        rates = HostRates(
            memory_bytes_per_s=settings.host_memory_bytes_per_s or measured.memory_bytes_per_s,
            flops=settings.host_flops or measured.flops,
            copy_bytes_per_s=settings.copy_bytes_per_s or measured.copy_bytes_per_s,
        )
    log.info(
        "worker %d: hybrid execution, the CPU reads experts at %.0f MB/s and does %.1f GFLOP/s; "
        "copies run at %.0f MB/s",
        index,
        rates.memory_bytes_per_s / 1e6,
        rates.flops / 1e9,
        rates.copy_bytes_per_s / 1e6,
    )
    return rates


def share_control_for(
    rates: HostRates | None, strategy, expert_bytes: int, flops: float, n_groups: int, delay: int, index: int
) -> ShareController | None:
    """The planned share's controller (``inference.policies.hybrid.ShareController``), its ceiling from
    this worker's rates (``flops``: one row through one expert): none without hybrid execution, or
    under a strategy that caches or loads nothing ahead."""
    if rates is None or strategy.cache != "none" or strategy.predictor is None:
        return None
    cpu = cpu_seconds(expert_bytes, flops, rates)
    ceiling = predicted_share(expert_bytes / rates.copy_bytes_per_s, cpu, n_groups)
    log.info("worker %d: up to %s of the group's decode layers may be planned on the CPUs", index, ceiling)
    return ShareController(ceiling, delay=delay)


def cpu_share(control: ShareController | None, step: int) -> Fraction:
    """The share of the group's (step, layer)s planned on the CPUs at session step ``step``."""
    return control.share_at(step) if control else Fraction(0)


def choose_on_cpu(
    units: list[tuple[int, int]],
    keys_of: dict[int, Key],
    states: dict,
    nbytes: dict[Key, int],
    per_row: float,
    rates: HostRates,
    planned: set[int],
) -> CpuExperts:
    """Of a request's experts not held (``keys_of``, with their copy ``states``), those to compute
    on the CPU. ``planned``: the experts this worker was predicted to load for the layer but left
    on the CPU's plan; one of them computed on the CPU was predicted (a hit), though never copied."""
    rows: dict[int, int] = {}
    segments: dict[int, int] = {}  # units of one expert: on the CPU each reads its weights again
    for expert, count in units:
        rows[expert] = rows.get(expert, 0) + count
        segments[expert] = segments.get(expert, 0) + 1
    keys = list(keys_of.values())
    candidates = [(nbytes[k] * segments[k[2]], rows[k[2]] * per_row, states[k]) for k in keys]
    copy_s = nbytes[keys[0]] / rates.copy_bytes_per_s
    chosen = CpuExperts()
    for key, take in zip(keys, split(candidates, copy_s, rates), strict=True):
        if take:
            chosen.add(key[2])
            chosen.predicted += states[key].where in ("loading", "queued") or key[2] in planned
    return chosen


def compute_on_host(
    msg: ExpertRequest,
    expert: int,
    span: slice,
    store,
    act_fn,
    rates: HostRates,
    settings: DeploymentSettings,
    device,
    sizes,
) -> torch.Tensor:
    """One expert's rows computed on this host's CPU from its weights in host memory.
    ``sizes``: (hidden, intermediate), for an emulated host's floor."""
    assert msg.rows is not None and msg.weights is not None
    started = time.perf_counter()
    rows = msg.rows[span]
    out = expert_forward(rows, msg.weights[span], store.get(msg.layer, expert), act_fn)
    if settings.host_memory_bytes_per_s:
        # Emulated host: the CPU path takes what the profile's DRAM (or CPU) would.
        floor = cpu_seconds(store.nbytes(msg.layer, expert), expert_flops(*sizes, rows.shape[0]), rates)
        left = floor - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
    return out.to(device)


def mark_token(
    session: Session, control: ShareController | None, step: int, previous_step_s: float, longest: float, index: int
) -> None:
    """Main's first request to the group for session step ``step``: the previous decode
    token's period, as main stamped it, goes to the share's controller. One no decode step
    can take (``longest``: every layer waits at most ``timeout_s``) is a peer's invention and is
    left out, by every worker of the group alike."""
    mark, session.token_mark = session.token_mark, step
    if control is None or mark is None or not session.alone(mark) or not 0 < previous_step_s <= longest:
        return
    first_step = next(iter(session.joined.values()))  # the sequence's prefill
    if mark == step - 1 and mark > first_step:  # two decode tokens in a row
        before = control.share
        control.observe(mark, previous_step_s)
        if control.share != before:
            log.info(
                "worker %d: %s of the group's decode layers planned on the CPUs from session step %d",
                index,
                control.share,
                control.effective,
            )
