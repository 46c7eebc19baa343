"""Emulated hardware: slow this machine's copies and links down to a real cluster's proportions.

A small model on a CPU computes an expert in microseconds and copies it in microseconds
too, so none of the trade-offs between the strategies shows. An ``Emulation`` takes a
hardware profile (``inference.sim.hardware``: GPU memory bandwidth, PCIe, network) and
sets the runtime's token buckets (``DeploymentSettings.copy_bytes_per_s`` in the expert loader,
``DeploymentSettings.disk_bytes_per_s`` in the disk expert store, ``DeploymentSettings.link_bytes_per_s`` /
``link_latency_s`` in the transport) so that, measured
against one expert's decode compute *here*, loading an expert and sending a hidden state
between nodes take as long as they do next to one Mixtral-8x7B expert's decode compute on
the profile's hardware:

    scale = expert compute here / expert compute on the profile's GPU (memory-bound roofline)
    emulated copy time  = real copy time of a Mixtral expert x scale
    emulated disk read  = real SSD read time of a Mixtral expert x scale
    emulated link time  = (real latency + real transfer of a Mixtral hidden row) x scale
    emulated CPU path   = a Mixtral expert read from the host's DRAM (or its FLOPs on the
                          host CPU, when more rows share it) x scale   (hybrid execution)

What it does not scale is everything else this machine does slower than a GPU (attention
and Python overheads); the profile and the scale are printed with every result.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from inference.policies.depth import prefetch_depth
from inference.runtime.experts import ExpertWeights, activation, expert_forward
from inference.runtime.spec import DeploymentSettings
from inference.sim.hardware import Profile, get_profile
from inference.sim.model_sizes import ModelSizes, mixtral_8x7b

REAL_BITS = 16  # Mixtral served in fp16 on the profile's GPUs


@dataclass(frozen=True)
class Emulation:
    profile: str
    scale: float  # seconds here per second on the profile's hardware
    expert_compute_here_s: float
    expert_compute_real_s: float
    expert_load_real_s: float
    hop_real_s: float
    copy_bytes_per_s: float
    link_bytes_per_s: float
    link_latency_s: float
    disk_bytes_per_s: float
    # Hybrid execution's CPU path on a worker host: the expert's weights read from host memory.
    expert_cpu_real_s: float
    host_memory_bytes_per_s: float
    host_flops: float | None  # None: the caller gave no expert FLOPs here, the worker measures its own

    @property
    def load_to_compute(self) -> float:
        return self.expert_load_real_s / self.expert_compute_real_s

    @property
    def prefetch_depth(self) -> int:
        """The experts a worker needs to hold at once on this profile (`inference.policies.depth`): its
        expert's copy against its compute (the same at any time scale)."""
        return prefetch_depth(self.expert_load_real_s, self.expert_compute_real_s)

    def settings(self, base: DeploymentSettings, *, networked: bool = True) -> DeploymentSettings:
        """``base`` with the emulated copy bandwidth, and the emulated link if roles are on separate boxes."""
        link = (
            {"link_bytes_per_s": self.link_bytes_per_s, "link_latency_s": self.link_latency_s}
            if networked
            else {"link_bytes_per_s": None, "link_latency_s": 0.0}
        )
        return dataclasses.replace(
            base,
            copy_bytes_per_s=self.copy_bytes_per_s,
            disk_bytes_per_s=self.disk_bytes_per_s,
            host_memory_bytes_per_s=self.host_memory_bytes_per_s,
            host_flops=self.host_flops,
            **link,
        )

    def describe(self) -> str:
        return (
            f"profile {self.profile}: a Mixtral-8x7B expert computes in {self.expert_compute_real_s * 1e3:.3f} ms "
            f"and loads in {self.expert_load_real_s * 1e3:.2f} ms ({self.load_to_compute:.0f}x), a hidden state "
            f"crosses the network in {self.hop_real_s * 1e3:.3f} ms; here an expert computes in "
            f"{self.expert_compute_here_s * 1e3:.3f} ms, so time scale {self.scale:.3f}: expert loads at "
            f"{self.copy_bytes_per_s / 1e6:.1f} MB/s (disk reads at {self.disk_bytes_per_s / 1e6:.1f} MB/s), "
            f"links at {self.link_bytes_per_s / 1e6:.2f} MB/s + "
            f"{self.link_latency_s * 1e3:.3f} ms; on a worker's CPU from host memory an expert takes "
            f"{self.expert_cpu_real_s * 1e3:.2f} ms there, so {self.host_memory_bytes_per_s / 1e6:.1f} MB/s here; "
            f"a worker's prefetch depth for these proportions: {self.prefetch_depth} experts"
        )

    def as_dict(self) -> dict:
        derived = {"load_to_compute": self.load_to_compute, "prefetch_depth": self.prefetch_depth}
        return {**dataclasses.asdict(self), **derived}


def real_times(profile: Profile, model: ModelSizes | None = None) -> tuple[float, float, float]:
    """(expert decode compute, expert load, hidden-state hop) in seconds on ``profile`` for Mixtral-8x7B."""
    model = model or mixtral_8x7b()
    expert_bytes = model.expert_bytes(REAL_BITS)
    compute = expert_bytes / profile.gpu.memory_bandwidth  # one token: reading the weights dominates
    load = expert_bytes / profile.host_to_device.effective + profile.host_to_device.latency
    hop = model.hidden_bytes(1, REAL_BITS) / profile.network.effective + profile.network.latency
    return compute, load, hop


def emulation_for(
    profile_name: str,
    expert_compute_here_s: float,
    expert_bytes_here: int,
    hidden_bytes_here: int,
    *,
    expert_flops_here: float | None = None,
) -> Emulation:
    """The token-bucket settings that give this machine ``profile_name``'s proportions (pure).

    ``expert_flops_here`` (one row through one expert of the model run here) scales the host
    CPU's FLOP/s too; without it the CPU path is emulated by its memory bound alone.
    """
    if expert_compute_here_s <= 0 or expert_bytes_here <= 0 or hidden_bytes_here <= 0:
        raise ValueError("expert compute time, expert bytes and hidden bytes must be positive")
    if expert_flops_here is not None and expert_flops_here <= 0:
        raise ValueError("expert FLOPs must be positive")
    profile = get_profile(profile_name)
    compute, load, hop = real_times(profile)
    mixtral = mixtral_8x7b()
    disk_read = mixtral.expert_bytes(REAL_BITS) / profile.disk_read
    cpu_real = mixtral.expert_bytes(REAL_BITS) / profile.host_memory.effective
    cpu_row_real = 2 * mixtral.expert_params / profile.host_cpu_flops
    scale = expert_compute_here_s / compute
    latency = profile.network.latency * scale
    transfer = (hop - profile.network.latency) * scale
    return Emulation(
        profile=profile.name,
        scale=scale,
        expert_compute_here_s=expert_compute_here_s,
        expert_compute_real_s=compute,
        expert_load_real_s=load,
        hop_real_s=hop,
        copy_bytes_per_s=expert_bytes_here / (load * scale),
        link_bytes_per_s=hidden_bytes_here / transfer,
        link_latency_s=latency,
        disk_bytes_per_s=expert_bytes_here / (disk_read * scale),
        expert_cpu_real_s=cpu_real,
        host_memory_bytes_per_s=expert_bytes_here / (cpu_real * scale),
        host_flops=None if expert_flops_here is None else expert_flops_here / (cpu_row_real * scale),
    )


def measure_expert_compute(
    hidden: int, intermediate: int, *, act: str = "silu", repeats: int = 200, working_set_bytes: int = 128 * 2**20
) -> float:
    """Median seconds one expert takes for one decode row here, on one thread as a worker runs.

    The calls cycle over enough distinct experts (``working_set_bytes``) that each one's
    weights come from main memory, not from a cache that still holds them — as on a GPU,
    where a decode step streams an expert's weights from device memory; measuring one
    expert again and again would time the CPU's cache instead, and vary with what else the
    machine runs.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        expert_bytes = 3 * hidden * intermediate * 4
        count = max(2, min(64, working_set_bytes // expert_bytes))
        experts = [
            ExpertWeights(
                torch.randn(2 * intermediate, hidden, generator=generator),
                torch.randn(hidden, intermediate, generator=generator),
            )
            for _ in range(count)
        ]
        row, weight, act_fn = torch.randn(1, hidden, generator=generator), torch.ones(1), activation(act)
        for expert in experts:
            expert_forward(row, weight, expert, act_fn)
        samples = []
        for i in range(repeats):
            expert = experts[i % count]
            start = time.perf_counter()
            expert_forward(row, weight, expert, act_fn)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)
    finally:
        torch.set_num_threads(threads)
