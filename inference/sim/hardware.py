"""Hardware profiles: a node's GPU, its host->GPU link, the network between nodes, the host's memory and CPU.

Each figure has a `peak` (spec sheet: what the roofline-ideal model uses) and, for links, an
`effective` rate (what a real transfer achieves: what the efficiency-adjusted model uses). Values come
from `inference.sim.sources`, where each one's origin is written down.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from inference.sim.sources import value


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bandwidth: float  # B/s
    fp16_flops: float  # FLOP/s, dense tensor
    memory: float  # B


@dataclass(frozen=True)
class Link:
    peak: float  # B/s
    effective: float  # B/s
    latency: float  # s, one way

    def rate(self, ideal: bool) -> float:
        return self.peak if ideal else self.effective


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    gpu: Gpu
    host_to_device: Link
    network: Link
    # Sequential read of the node's local SSD, what the "disk" expert store streams experts from;
    # assumed for every profile: a mainstream PCIe 3.0 x4 NVMe drive.
    disk_read: float = value("nvme_ssd_seq_read")  # B/s
    # The worker host's own memory and CPU, what hybrid execution computes an expert with when it
    # is not copied to the GPU (assumed for the desktop profiles: dual-channel DDR4-3200, 8 cores).
    host_memory: Link = Link(value("ddr4_3200_dual_channel_peak"), value("ddr4_3200_dual_channel_effective"), 0.0)
    host_cpu_flops: float = value("desktop_cpu_fp32_flops")  # FLOP/s

    def as_dict(self) -> dict:
        return asdict(self)


def _rtx3090() -> Gpu:
    return Gpu(
        "RTX 3090",
        value("rtx3090_memory_bandwidth"),
        value("rtx3090_fp16_tensor_flops"),
        value("rtx3090_memory"),
    )


def _pcie4() -> Link:
    return Link(value("pcie4_x16_peak"), value("pcie4_x16_pinned_effective"), value("pcie4_x16_copy_latency"))


def _ethernet_1g() -> Link:
    return Link(value("ethernet_1g_peak"), value("ethernet_1g_effective"), value("ethernet_1g_latency"))


def _profiles() -> dict[str, Profile]:
    rtx3080 = Gpu(
        "RTX 3080 10GB",
        value("rtx3080_memory_bandwidth"),
        value("rtx3080_fp16_tensor_flops"),
        value("rtx3080_memory"),
    )
    orin = Gpu(
        "Jetson AGX Orin 64GB",
        value("orin_memory_bandwidth"),
        value("orin_fp16_tensor_flops"),
        value("orin_memory"),
    )
    unified = value("orin_unified_copy_bandwidth")
    profiles = [
        Profile(
            "3090-pcie4-1gbe",
            "The OD-MoE paper's testbed: RTX 3090 per node, PCIe 4.0 x16, 1 Gb Ethernet",
            _rtx3090(),
            _pcie4(),
            _ethernet_1g(),
        ),
        Profile(
            "3090-pcie4-10gbe",
            "RTX 3090 per node, PCIe 4.0 x16, 10 Gb Ethernet",
            _rtx3090(),
            _pcie4(),
            Link(value("ethernet_10g_peak"), value("ethernet_10g_effective"), value("ethernet_10g_latency")),
        ),
        Profile(
            "3080-pcie4-1gbe",
            "RTX 3080 10GB per node, PCIe 4.0 x16, 1 Gb Ethernet",
            rtx3080,
            _pcie4(),
            _ethernet_1g(),
        ),
        Profile(
            "orin-wifi6",
            "Jetson AGX Orin 64GB per node (unified memory, no PCIe hop), Wi-Fi 6 between nodes",
            orin,
            Link(unified, unified, 0.0),
            Link(value("wifi6_peak"), value("wifi6_effective"), value("wifi6_latency")),
            host_memory=Link(value("orin_memory_bandwidth"), value("orin_cpu_memory_effective"), 0.0),
            host_cpu_flops=value("orin_cpu_fp32_flops"),
        ),
    ]
    return {profile.name: profile for profile in profiles}


PROFILES = _profiles()
DEFAULT_PROFILE = "3090-pcie4-1gbe"  # the OD-MoE paper's testbed


def list_profiles() -> list[dict]:
    """Every profile as a JSON-able dict (name, description, GPU, links)."""
    return [profile.as_dict() for profile in PROFILES.values()]


def get_profile(name: str | Profile) -> Profile:
    if isinstance(name, Profile):
        return name
    if name not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; choose one of {', '.join(PROFILES)}")
    return PROFILES[name]


def with_host_to_device(profile: Profile, bandwidth: float) -> Profile:
    """The same profile with another host->GPU bandwidth (both peak and effective), for what-if sweeps."""
    if bandwidth <= 0:
        raise ValueError("host-to-device bandwidth must be positive")
    link = Link(bandwidth, bandwidth, profile.host_to_device.latency)
    return dataclasses.replace(profile, host_to_device=link)
