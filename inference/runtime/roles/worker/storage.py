"""What a worker holds its experts in: the store it opens from its shard, the loader that copies
them to the device, and the shard's config they are read with."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from inference.policies.depth import resolve_depth
from inference.policies.placement import Placement
from inference.policies.strategies import expert_store_for
from inference.runtime.cache import DeviceCache
from inference.runtime.loader import ExpertLoader
from inference.runtime.roles.common import release_free_heap
from inference.runtime.spec import RoleSpec, compute_dtype
from inference.runtime.store import open_store


def read_config(shard_dir: str) -> dict:
    with open(Path(shard_dir) / "config.json") as f:
        return json.load(f)


def staged(spec: RoleSpec, device: torch.device) -> bool:
    """Whether experts reach the device through the loader's rotating pinned staging buffers."""
    store_kind = expert_store_for(spec.settings.strategy, spec.settings.expert_store)
    return device.type == "cuda" and store_kind == "disk"


def open_worker_store(spec: RoleSpec, config: dict, device: torch.device):
    """The worker's store of its owned experts, already verified with its identity."""
    store_kind = expert_store_for(spec.settings.strategy, spec.settings.expert_store)
    on_gpu = device.type == "cuda"
    # The "ram" store is page-locked where it lies and a "hot" one's experts are pinned as
    # they are read (a hit is then copied with no memcpy first), both copied from directly; a
    # "disk" store's are read into the loader's rotating pinned staging buffers on their way.
    store = open_store(
        store_kind,
        spec.shard_dir,
        pin=on_gpu and not staged(spec, device),
        verify=False,  # the role verified the shard, with this worker's identity
        read_bytes_per_s=spec.settings.disk_bytes_per_s,
        dtype=compute_dtype(spec.settings.dtype, config),
        hot_experts=spec.settings.hot_experts,
    )
    release_free_heap()
    return store


def device_cache(cache_kind: str, cache_experts: int) -> DeviceCache | None:
    """The device cache a strategy keeps experts in after their request, or None (cacheless)."""
    return {"all": DeviceCache(None), "lru": DeviceCache(cache_experts)}.get(cache_kind)


def make_loader(
    spec: RoleSpec, store, device: torch.device, placement: Placement, group_size: int, cache: DeviceCache | None
) -> ExpertLoader:
    return ExpertLoader(
        store,
        device,
        max_resident=resolve_depth(spec.settings.max_resident_experts, placement.top_k, group_size),
        copy_bytes_per_s=spec.settings.copy_bytes_per_s,
        cache=cache,
        staging_slots=spec.settings.staging_buffers if staged(spec, device) else 0,
    )
