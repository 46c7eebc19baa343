"""Hybrid CPU/GPU expert execution: which requested experts a worker computes on its own CPU.

A worker keeps its experts in host memory, so it has two ways to run an expert main asks for:
copy it over PCIe to the compute device and compute there, or compute it on the worker's CPU
straight from host memory. At batch 1 an expert's weights are read once per token either way,
so the CPU path costs about the expert's bytes over the host's memory bandwidth (a desktop's
DRAM reads several times faster than nothing, and this read needs no copy first), while the GPU
path costs whatever is left of its copy (Fiddler, arXiv 2402.07033; DAOP, arXiv 2501.10375).

A copy can start early, on a prediction; the CPU can start only when main's hidden state
arrives. So the choice is made per expert when main's request arrives, from what the copy
engine still has to do: an expert already on the device is computed there; for any other, the
time until its copy is done (what is left of the copy in flight, the copies queued before it,
its own) is set against the time the CPU would take (the CPU experts already chosen for this
request first, then its own); it runs where it finishes first, and a CPU expert's pending
copy is dropped, which moves every later copy up. A late (mispredicted) expert is the common
case: its copy has not even started.

The CPU can also take work the copies would otherwise do. Under a cacheless strategy that loads
ahead (odmoe), the copy links bound decode: each of a layer group's workers copies its share of
every predicted expert. Leaving some (step, layer)s' predicted experts uncopied and computing
them on the CPUs when main's request comes frees link time for the rest, at a CPU expert's time
on the critical path (it cannot start before its layer's hidden state arrives). A layer's
experts are dealt over its group's workers, so its CPU experts run on several CPUs at once. Per
token, with a share ``s`` of the (step, layer)s planned on the CPUs, a worker's copies take
``C (1 - s)`` and the token's critical path ``B + H s``: ``C`` its copies with none planned,
``H`` every group's CPU layers with all planned, ``B`` the rest of the critical path (main's
layers, the hops, the device's experts). Decode runs at the longer of the two, so the best share
makes them equal: ``s = (C - B) / (C + H)``, at most ``c / (G h + c)`` (``B = 0``,
``predicted_share``) for a copy time ``c``, a CPU time ``h`` and ``G`` groups. ``B`` is not
known ahead (on a 2-core test machine it is most of a token), and a worker cannot tell its part
of it from its own copy waits (they gather at whichever group the copies fall behind in), so the
share is found from what every worker of a group hears alike, the decode tokens' periods as main
times them and stamps them on its requests (``ShareController``; each change plans from a fixed
later step, so a group's workers hold the same share for every step): it starts at 0
and climbs a step while each step shortens the period, up to that ceiling. The balance also
overstates what a step gains: the link time a planned layer frees is of use only for copies
whose predictions are already there, and the shadow predicts one token ahead. Every worker of a
group picks the same (step, layer)s from the step, the layer and the share alone, evenly spaced,
the groups' picks interleaved in time (``planned_on_cpu``): no message. At main's request the
rule above still decides each such expert (one that the CPU would finish after its copy gets
copied then).

Everything here is pure arithmetic on rates and a snapshot of the loader's queue; the worker
(``inference.runtime.roles.worker``) takes the snapshot and runs the result.

Exactness: on a CPU-only worker both paths run the same kernel on the same weights, so the
output is bit-identical whichever is taken. On a CUDA worker the CPU computes with another
kernel than the GPU and may round differently, so hybrid execution is off by default
(``DeploymentSettings.hybrid``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

Where = Literal["ready", "loading", "queued", "absent"]


@dataclass(frozen=True)
class HostRates:
    """What a worker's own hardware does, in the units the decision needs."""

    memory_bytes_per_s: float  # how fast the CPU streams an expert's weights from host memory
    flops: float  # the CPU's FLOP/s on an expert's GEMMs (what bounds it with many rows)
    copy_bytes_per_s: float  # host -> compute device

    def __post_init__(self) -> None:
        if min(self.memory_bytes_per_s, self.flops, self.copy_bytes_per_s) <= 0:
            raise ValueError("host memory bandwidth, CPU FLOP/s and copy bandwidth must be positive")


@dataclass(frozen=True)
class CopyState:
    """Where one expert's copy stands in the loader (a snapshot)."""

    where: Where
    # "loading": its index in the copy pass under way; "queued": the pending copies before it.
    position: int = 0
    # Of the copy pass under way (if any): how many experts it holds and how long it has run.
    pass_size: int = 0
    pass_elapsed_s: float = 0.0


def expert_flops(hidden: int, intermediate: int, rows: int) -> float:
    """FLOPs of one SwiGLU expert over ``rows`` rows: three GEMMs of hidden x intermediate."""
    return 2.0 * 3 * hidden * intermediate * rows


def cpu_seconds(nbytes: int, flops: float, rates: HostRates) -> float:
    """The CPU path: the weights read once from host memory, or the arithmetic, whichever is longer."""
    return max(nbytes / rates.memory_bytes_per_s, flops / rates.flops)


def copy_eta(state: CopyState, copy_s: float, dropped_ahead: int = 0) -> float:
    """Seconds until the expert is on the device, if it is copied (0 when it is there already).

    Copies run one after another; ``dropped_ahead`` of the queued copies before it will not
    run (their experts went to the CPU), which moves it up. An expert not queued at all is
    copied next, once the pass under way is done (a request's load jumps the queue).
    """
    if state.where == "ready":
        return 0.0
    if state.where == "loading":
        return max(0.0, (state.position + 1) * copy_s - state.pass_elapsed_s)
    pass_left = max(0.0, state.pass_size * copy_s - state.pass_elapsed_s)
    ahead = state.position - dropped_ahead if state.where == "queued" else 0
    return pass_left + max(0, ahead) * copy_s + copy_s


def split(units: list[tuple[int, float, CopyState]], copy_s: float, rates: HostRates) -> list[bool]:
    """For each requested expert (its bytes, its rows' FLOPs, its copy's state): True to compute it on the CPU.

    In request order: the CPU does its experts one after another, so each CPU expert waits for
    the ones chosen before it; an expert goes to the CPU when that finishes strictly before its
    copy would, and one already on the device never does.
    """
    on_cpu: list[bool] = []
    cpu_clock = 0.0
    dropped: list[int] = []  # queue positions of the copies that will not run
    for nbytes, flops, state in units:
        ahead = sum(p < state.position for p in dropped) if state.where == "queued" else 0
        eta = copy_eta(state, copy_s, ahead)
        cpu_done = cpu_clock + cpu_seconds(nbytes, flops, rates)
        take = state.where != "ready" and cpu_done < eta
        on_cpu.append(take)
        if take:
            cpu_clock = cpu_done
            if state.where == "queued":
                dropped.append(state.position)
    return on_cpu


# The planned share is a multiple of 1 / SHARE_STEPS: every worker of a group must pick the same
# (step, layer)s, and workers whose measurements differ a little then still hold the same share,
# or neighbouring ones (a disagreement costs speed, never exactness).
SHARE_STEPS = 16
# Decode tokens one share is measured over (their mean period: the decode rate over the window).
SHARE_WINDOW = 8
# A step up is kept when it shortens the mean period by this much: less is within the noise of
# one window on a loaded machine. A held share's period growing by REMEASURE starts the climb over.
SHARE_GAIN = 0.02
REMEASURE = 0.10


def predicted_share(copy_s: float, cpu_s: float, groups: int) -> Fraction:
    """The share of a decode group's (step, layer)s worth planning on the CPUs if nothing but the
    copies and the CPU layers took time: ``c / (G h + c)`` for a copy time ``c``, a CPU time
    ``h`` and ``G`` decode groups, rounded down to a step (module docstring). A ceiling: the
    rest of a real critical path only lowers the best share."""
    if copy_s <= 0 or cpu_s <= 0 or groups < 1:
        raise ValueError("copy and CPU times must be positive and there must be at least one group")
    return Fraction(math.floor(copy_s / (groups * cpu_s + copy_s) * SHARE_STEPS), SHARE_STEPS)


def share_delay(lookahead: int) -> int:
    """How many session steps after a decode token a share changed on that token's period first
    plans: ``2 + lookahead``. A worker hears token ``t``'s period with main's request of step
    ``t + 1``; main waits at that layer for every worker it sent experts to, and aligns the
    shadow with a step only once the step is done, so no prediction sent by then is for a step
    past ``t + 1 + lookahead`` (the shadow runs at most ``lookahead`` steps ahead of the step it
    was last aligned with, its guesses included), and each worker of the group may already have
    planned any of them. From the step after those, every worker plans alike. Not covered: a
    worker sent only an empty request at that layer is not waited for, so if it stalls (a hot
    store's read, say) main may run on and a later prediction reach it first."""
    if lookahead < 0:
        raise ValueError("the lookahead must not be negative")
    return 2 + lookahead


class ShareController:
    """A worker's planned share, found from its decode tokens' periods.

    It starts at 0 (every predicted expert copied, as without hybrid execution). Every
    ``window`` decode tokens it takes their mean period (a planned layer shortens some tokens
    and leaves the copies of the others less far behind: a median misses it): a step up that shortened it by
    ``SHARE_GAIN`` is kept and the next step tried (up to ``ceiling``); one that did not is
    undone and the best share held. A held share whose period grows by ``REMEASURE`` (the
    machine or the load changed) starts the climb again from 0.

    The workers of a group must plan the same (step, layer)s, so each change is tied to steps:
    made on token ``t``'s period, it plans from step ``t + delay`` on (``share_delay``; the
    steps before keep the share they may already have been planned with, ``share_at``), and
    only tokens from that step on count towards the next window. Main stamps each token's period
    on its requests, so the workers of a group feed their controllers the same periods for the
    same tokens and hold the same share for every step, provided they have the same ceiling (the
    same rates: emulated, or measured alike) and the same history (a worker restarted, or one
    that missed tokens while it was lost, starts again from 0 beside peers that did not). Pure:
    the worker feeds it, and the simulator feeds it the same way.
    """

    def __init__(self, ceiling: Fraction, window: int = SHARE_WINDOW, delay: int = 1) -> None:
        if not 0 <= ceiling <= 1 or window < 1 or delay < 1:
            raise ValueError(
                "the ceiling must lie in [0, 1], the window hold at least one token and the delay be a step or more"
            )
        self.ceiling, self.window, self.delay = ceiling, window, delay
        self.share = Fraction(0)  # the share decided last: it plans from step ``effective`` on
        self.effective = 0
        self._before = Fraction(0)  # the share that plans the steps before ``effective``
        self.best: tuple[Fraction, float] | None = None  # the best share so far and its mean period
        self.holding = False
        self._periods: list[float] = []

    def share_at(self, step: int) -> Fraction:
        """The share that plans session step ``step``'s layers."""
        return self.share if step >= self.effective else self._before

    def new_session(self) -> None:
        """A session begins: the periods gathered so far belong to another one and are dropped,
        and the share reached plans from its first step (session steps count from 0 again; the
        period it was reached at stands)."""
        self._periods.clear()
        self._before, self.effective = self.share, 0

    def observe(self, step: int, period_s: float) -> None:
        """Decode token ``step``'s period. A token planned with an earlier share (one before the
        current share's first step) does not count."""
        if step < self.effective:
            return
        self._periods.append(period_s)
        if len(self._periods) < self.window:
            return
        periods, self._periods = self._periods, []
        period = statistics.fmean(periods)
        share = self.share
        if self.holding:
            assert self.best is not None
            if period > self.best[1] * (1 + REMEASURE):
                share, self.best, self.holding = Fraction(0), None, False
        elif self.best is None or period < self.best[1] * (1 - SHARE_GAIN):
            self.best = (self.share, period)
            if self.share + Fraction(1, SHARE_STEPS) <= self.ceiling:
                share = self.share + Fraction(1, SHARE_STEPS)
            else:
                self.holding = True
        else:
            share, self.holding = self.best[0], True
        if share != self.share:
            self._before, self.share, self.effective = self.share, share, step + self.delay


def planned_on_cpu(step: int, layer: int, group_layers: Sequence[int], groups: int, share: Fraction) -> bool:
    """Whether ``layer``'s predicted experts at ``step`` are planned on the CPUs of its group.

    A group's (step, layer)s are numbered in the order a generation needs them,
    ``n = step x len(group_layers) + position``; ``n`` is picked when ``n x share + phase``
    crosses an integer, which picks ``share`` of them evenly spaced. Layer ``l`` belongs to
    group ``l mod G``, so group ``j``'s ``n``-th is the generation's ``n G + j``-th (step,
    layer); the phase ``j (1 + share) / G`` puts the groups' picks ``1 / share`` apart in that
    order, not all at once.
    """
    if share <= 0:
        return False
    group = layer % groups
    n = step * len(group_layers) + group_layers.index(layer)
    phase = (group * (1 + share) / groups) % 1
    return math.floor((n + 1) * share + phase) > math.floor(n * share + phase)
