"""What each role keeps, in bytes: main's, the shadow's and a worker's share of a model's tensors.

The parts of a memory plan (``inference.building.memory``, which says what each role holds and
why): a role's ``RoleMemory`` (host RAM, GPU memory, disk, and the RAM it needs on a CPU-only
node), the KV caches it is sized for, and each expert's bytes as the checkpoint holds it, as a
worker's shard stores it (coded: fewer) and as torch's pinned host allocator holds it
(``ExpertBytes``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from inference.building.tensor_sizes import CAST_BYTES, TensorSize, shadow_weight_bytes
from inference.constants import SHADOW_STATES_PER_SEQUENCE
from inference.modelio.checkpoint import parse_expert_key
from inference.modelio.prerouter_shape import PrerouterShape
from inference.policies.depth import resolve_depth
from inference.policies.placement import Placement
from inference.policies.strategies import get_strategy, home_worker
from inference.settings import DeploymentSettings
from inference.sim.model_sizes import ModelSizes

RUNTIME_OVERHEAD_BYTES = 600 * 10**6  # one role process: Python + torch + transformers, before weights
# What a process's CUDA context, kernels, cuBLAS workspace and allocator take on its GPU beyond
# its tensors: measured by the GPU check (nvidia-smi, per process) on an H200 with torch 2.11 and
# CUDA 13, serving a model whose tensors are a few MB: main 747 MB, shadow 757 MB, each worker
# 820 MB (benchmarks/results/gpu-h200-tiny.json). The largest, for every role; other GPUs,
# drivers and torch versions differ by some tens of MB.
CUDA_CONTEXT_BYTES = 820 * 10**6


@dataclass(frozen=True)
class RoleMemory:
    """What one role needs, in bytes: host RAM, GPU memory and disk (its shard).

    ``cpu_bytes`` is the RAM it needs instead when its node has no GPU: main and the shadow
    then compute from the weights they loaded (plus the KV caches); a worker still copies
    each expert it computes into a fresh buffer, so it needs its RAM plus its "GPU" bytes.
    ``kv_sequences`` KV caches of ``kv_tokens`` tokens each are counted in (none for a worker).
    """

    role: str  # main, shadow or worker-N (the shard's name)
    host_bytes: int
    gpu_bytes: int
    disk_bytes: int
    cpu_bytes: int
    kv_sequences: int = 0
    kv_tokens: int = 0

    @property
    def label(self) -> str:
        """``worker 2`` for ``worker-2``: how a message names the role."""
        return self.role.replace("-", " ")

    @property
    def kv_text(self) -> str:
        """``KV cache for 8 sequences of 4096 tokens``: what its KV share is sized for ("" without one)."""
        return kv_text(self.kv_sequences, self.kv_tokens) if self.kv_sequences else ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kv_cache_bytes(sizes: ModelSizes, element_bytes: int, context_tokens: int, sequences: int = 1) -> int:
    """Keys and values of every layer for ``sequences`` sequences of ``context_tokens`` tokens each."""
    return sequences * sizes.layers * 2 * sizes.kv_heads * sizes.head_dim * element_bytes * context_tokens


def kv_text(sequences: int, context_tokens: int) -> str:
    """``KV cache for 8 sequences of 4096 tokens``: what a role's KV share is sized for."""
    return f"KV cache for {sequences} sequence{'' if sequences == 1 else 's'} of {context_tokens} tokens"


def shadow_max_states(max_batch: int) -> int:
    """The most sequences (each with its own KV cache) the shadow follows when main runs ``max_batch``."""
    return SHADOW_STATES_PER_SEQUENCE * max_batch


def pinned_block_bytes(nbytes: int) -> int:
    """What torch's pinned host allocator takes for a tensor of ``nbytes``: the next power of two
    (``CachingHostAllocator`` rounds every block so, and keeps freed blocks for reuse)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


@dataclass(frozen=True)
class ExpertBytes:
    """Each expert's bytes (by (layer, expert)) as the checkpoint holds it, as its worker shard stores
    it (coded: fewer) and as torch's pinned host allocator holds it; which are coded; the dense rest."""

    experts: dict[tuple[int, int], int]
    stored: dict[tuple[int, int], int]
    pinned: dict[tuple[int, int], int]
    coded: set[tuple[int, int]]
    dense: int
    decode_scratch: int  # the largest coded tensor's decode scratch on a GPU (0: none coded)
    expert_bytes: int  # the largest expert as the checkpoint holds it
    largest_coded: int  # the most bytes a coded expert takes as stored (0: none coded)
    largest_pinned: int  # the largest expert as the pinned allocator holds it

    @classmethod
    def of(cls, tensors: Sequence[TensorSize]) -> ExpertBytes:
        experts: dict[tuple[int, int], int] = {}
        stored: dict[tuple[int, int], int] = {}
        pinned: dict[tuple[int, int], int] = {}
        coded: set[tuple[int, int]] = set()
        dense = 0
        for tensor in tensors:
            key = parse_expert_key(tensor.name)
            if key is None:
                dense += tensor.nbytes
                continue
            pair = (key.layer, key.expert)
            experts[pair] = experts.get(pair, 0) + tensor.nbytes
            stored[pair] = stored.get(pair, 0) + tensor.stored_nbytes
            if tensor.stored is not None:
                coded.add(pair)
            pinned[pair] = pinned.get(pair, 0) + pinned_block_bytes(tensor.nbytes)
        scratch = max((_device_decode_scratch(t) for t in tensors if t.stored is not None), default=0)
        return cls(
            experts,
            stored,
            pinned,
            coded,
            dense,
            scratch,
            expert_bytes=max(experts.values(), default=0),
            largest_coded=max((stored[pair] for pair in coded), default=0),
            largest_pinned=max(pinned.values(), default=0),
        )


def main_memory(
    sizes: ModelSizes, strategy: str, element: int, dense: int, context_tokens: int, max_batch: int
) -> RoleMemory:
    """Main's share: the dense weights (and the prerouter's), its KV caches, the runtime."""
    main_kv = kv_cache_bytes(sizes, element, context_tokens, max_batch)
    # The prerouter's heads and recovery adapter sit on main beside its weights (and on disk in its shard).
    extra = prerouter_bytes(sizes, element) if get_strategy(strategy).routes_by_prediction else 0
    return RoleMemory(
        "main",
        host_bytes=dense + extra + RUNTIME_OVERHEAD_BYTES,
        gpu_bytes=dense + extra + main_kv + CUDA_CONTEXT_BYTES,
        disk_bytes=dense + extra,
        cpu_bytes=dense + extra + main_kv + RUNTIME_OVERHEAD_BYTES,
        kv_sequences=max_batch,
        kv_tokens=context_tokens,
    )


def shadow_memory(
    tensors: Sequence[TensorSize],
    sizes: ModelSizes,
    shadow_dtype: str,
    element: int,
    context_tokens: int,
    max_batch: int,
) -> RoleMemory:
    """The shadow's share: the whole model in its dtype, the KV caches of the sequences it follows."""
    shadow_weights = shadow_weight_bytes(tensors, shadow_dtype)
    shadow_states = shadow_max_states(max_batch)
    shadow_kv = kv_cache_bytes(sizes, CAST_BYTES.get(shadow_dtype, element), context_tokens, shadow_states)
    # The shadow moves each tensor to its device as it reads it: on a GPU box its RAM holds a
    # tensor or two in flight (an expert's w1 waits for its w3), on a CPU the whole model too.
    in_flight = 2 * max(t.nbytes for t in tensors)
    return RoleMemory(
        "shadow",
        host_bytes=in_flight + RUNTIME_OVERHEAD_BYTES,
        gpu_bytes=shadow_weights + shadow_kv + CUDA_CONTEXT_BYTES,
        # The shard build converts the shadow's shard once unless it is the checkpoint's own dtype.
        disk_bytes=sum(t.nbytes for t in tensors) if CAST_BYTES.get(shadow_dtype) == element else shadow_weights,
        cpu_bytes=shadow_weights + in_flight + RUNTIME_OVERHEAD_BYTES + shadow_kv,
        kv_sequences=shadow_states,
        kv_tokens=context_tokens,
    )


def worker_memory(
    plan: Placement, worker: int, held: ExpertBytes, settings: DeploymentSettings, expert_store: str
) -> RoleMemory:
    """Worker ``worker``'s share: the experts it owns on disk and, as its store keeps them, in RAM;
    on its device the experts its loader and cache hold at most, under ``settings`` and the
    ``expert_store`` the plan counts (``settings.expert_store`` resolved for its strategy)."""
    owned = sum(held.stored.get(pair, 0) for pair in plan.owned(worker))
    members = len(plan.groups[plan.group_of_worker(worker)])
    depth = resolve_depth(settings.max_resident_experts, plan.top_k, members)  # what its loader will hold
    expert_bytes, coded = held.expert_bytes, bool(held.coded)
    on_gpu = _worker_device_bytes(
        plan, worker, settings.strategy, held.experts, expert_bytes, depth, settings.cache_experts
    )
    # A GPU worker copies coded experts ahead of their decodes (up to its depth of them) and decodes one
    # tensor at a time: the most coded bytes an expert takes, and the largest tensor's decode scratch.
    on_gpu += depth * held.largest_coded + held.decode_scratch if coded else 0
    # On a GPU box a disk store's experts pass through the loader's pinned staging buffers
    # (as many as a copy pass holds, at most); a hot store's are read into pinned tensors of
    # their own from torch's allocator, its hot set and the reads whose copies are in flight.
    if expert_store == "disk":
        # A coded expert's bytes are read into buffers of their own (a GPU copies them as they are), up
        # to depth at once, beside the staging buffers.
        host = (min(settings.staging_buffers, depth) + (depth if coded else 0)) * expert_bytes + RUNTIME_OVERHEAD_BYTES
    elif expert_store == "hot":
        owned_pinned = sum(held.pinned.get(pair, 0) for pair in plan.owned(worker))
        most = (settings.hot_experts + depth) * held.largest_pinned
        host = min(owned_pinned, most) + RUNTIME_OVERHEAD_BYTES
    else:
        # Coded experts stay coded in RAM; each load decodes one into a fresh buffer, up to depth at once.
        host = owned + (depth * expert_bytes if coded else 0) + RUNTIME_OVERHEAD_BYTES
    return RoleMemory(f"worker-{worker}", host, on_gpu + CUDA_CONTEXT_BYTES, owned, host + on_gpu)


def prerouter_bytes(sizes: ModelSizes, element_bytes: int, shape: PrerouterShape | None = None) -> int:
    """Main's memory for the prerouter (``inference.runtime.prerouter``, its default shape unless given): the
    heads in float32 and the recovery adapter on the attention projections in the model's dtype."""
    shape = shape or PrerouterShape(sizes.layers, sizes.experts, sizes.top_k, sizes.hidden)
    width, rank, e, h = shape.head_width, shape.lora_rank, sizes.experts, sizes.hidden
    head = h * width + width + width * e + e + 2 * e * e
    q, kv = sizes.query_heads * sizes.head_dim, sizes.kv_heads * sizes.head_dim
    adapter = rank * ((h + q) + 2 * (h + kv) + (q + h))  # q, k, v and o projections
    return sizes.layers * (4 * head + element_bytes * adapter)


def _device_decode_scratch(tensor: TensorSize) -> int:
    """A GPU's scratch for decoding one coded tensor (``inference.modelio.expert_codec``), beside its bytes."""
    from inference.modelio.expert_codec import device_decode_scratch

    return device_decode_scratch(tensor.numel)


def checkpoint_element_bytes(tensors: Sequence[TensorSize]) -> int:
    """The checkpoint dtype's element size, from its largest tensor (what main computes in)."""
    largest = max(tensors, key=lambda t: t.numel)
    return largest.nbytes // max(1, largest.numel)


def _worker_device_bytes(
    plan: Placement,
    worker: int,
    strategy: str,
    experts: Mapping[tuple[int, int], int],
    expert_bytes: int,
    max_resident: int,
    cache_experts: int,
) -> int:
    """Expert bytes ``worker`` keeps on its device at most under ``strategy``."""
    cache = get_strategy(strategy).cache
    in_flight = max_resident * expert_bytes
    if cache == "none":
        return in_flight
    members = plan.groups[plan.group_of_worker(worker)]
    homes = {
        layer: [e for e in range(plan.n_experts) if home_worker(e, members) == worker]
        for layer in plan.decode_layers(worker)
    }
    if cache == "all":  # preloaded once; nothing is ever loaded after that
        return sum(experts.get((layer, e), 0) for layer, mine in homes.items() for e in mine)
    # lru: a layer's cache only ever holds experts this worker computes (its homes there)
    return sum(min(cache_experts, len(mine)) for mine in homes.values()) * expert_bytes + in_flight
