"""Memory per role of a deployment, from tensor sizes, and whether the nodes can hold it.

Before anything is downloaded, the control plane must know how much host RAM, GPU memory
and disk each role needs, and refuse a node that falls short. The numbers follow from the
tensor sizes and from what each role really keeps (``memory_from_checkpoint`` reads them
from a checkpoint's headers; ``memory_from_config`` computes the same tensors from a
config alone, so a plan for Mixtral-8x22B needs no 280 GB download):

- *main*: every non-expert tensor (routers included) in the checkpoint dtype, in RAM while
  it loads and on its GPU with the KV caches of the ``max_batch`` sequences it runs at once
  (continuous batching, ``DeploymentSettings.max_batch``), each at its full ``context_tokens`` tokens:
  ``max_batch * kv_cache_bytes(context_tokens)``.
- *shadow*: the whole model in the shadow dtype (``SHADOW_DTYPES``; int8/nf4 quantize the
  2-D linear weights, nf4 with each expert's w1 and w3 fused as one [2I, H] tensor, as
  ``inference.shadow.quant`` does). It converts tensor by tensor while it reads and moves each to its
  device, so on a GPU box its RAM holds a tensor or two; on a CPU, the converted model too.
  With it, in the dtype it computes in, the KV caches of the sequences it follows: up to
  ``shadow_max_states(max_batch)`` (``SHADOW_STATES_PER_SEQUENCE * max_batch``: as many as
  main runs, the bound ``inference.runtime.roles.shadow`` keeps), each counted at ``context_tokens``
  (a state's cache never outgrows its sequence, which main keeps within the model's context).
  Its shard on disk is the converted model (the shard build pre-converts it), or the
  checkpoint's tensors when the shadow dtype is the checkpoint's own.
- *worker i*: the experts ``placement(...).owned(i)`` gives it, in RAM (or on disk with
  ``expert_store="disk"``, each read on a GPU box through up to ``staging_buffers`` pinned
  buffers, ``inference.runtime.staging``; or ``hot_experts`` of them with ``"hot"``); on its GPU what
  the strategy keeps resident
  (``inference.policies.strategies``): ``max_resident_experts`` in flight for the cacheless ones (0,
  the default: the worker's prefetch depth from its group, ``inference.policies.depth.resolve_depth``),
  plus up to ``cache_experts`` per layer it serves for ``lru-offload``, every expert it is
  home to for ``full-cache``. Where its shard stores the experts coded (``expert_codec``), its
  RAM and disk hold the coded bytes (``with_stored_experts`` reads them from a built set's
  manifests; before it is built, ``with_coded_bound`` counts the most they can be) and its RAM
  the decoded experts in flight besides; its GPU, which decodes what it copies, the coded bytes of
  its depth of experts and one tensor's decode scratch (``expert_codec.device_decode_scratch``).

Every process also pays ``RUNTIME_OVERHEAD_BYTES`` of RAM (Python, torch, transformers) and,
on a GPU, ``CUDA_CONTEXT_BYTES`` of device memory.
The tensors and their bytes per dtype are ``tensor_sizes``'; whether a node can hold a role is
``fit``'s (``check_fit``: the shortfalls as sentences that name the node, the role, the resource
and by how much it falls short). Run ``python -m inference.building.memory --model mixtral-8x7b --workers 8
[--max-batch 8] [--context 4096]`` for the table of a known model.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from inference.building.tensor_sizes import (
    CAST_BYTES,
    CHECKPOINT_DTYPE_BYTES,
    TensorSize,
    checkpoint_tensors,
    config_tensors,
    family_tensors,
    shadow_weight_bytes,
    with_coded_bound,
    with_stored_experts,
)
from inference.constants import (
    DEFAULT_CONTEXT_TOKENS,
    EXPERT_STORES,
    MAX_BATCH,
    SHADOW_DTYPES,
    SHADOW_STATES_PER_SEQUENCE,
)
from inference.modelio.checkpoint import Checkpoint, CheckpointError, parse_expert_key
from inference.modelio.families.releases import RELEASES
from inference.modelio.prerouter_shape import PrerouterShape
from inference.policies.depth import resolve_depth
from inference.policies.placement import Placement, placement
from inference.policies.strategies import expert_store_for, get_strategy, home_worker
from inference.settings import DEFAULTS
from inference.sim.model_sizes import KNOWN_MODELS, ModelSizes, from_hf_config

GB = 10**9  # what the console and the messages print (decimal, as disks are sold)
RUNTIME_OVERHEAD_BYTES = 600 * 10**6  # one role process: Python + torch + transformers, before weights
# What a process's CUDA context, kernels, cuBLAS workspace and allocator take on its GPU beyond
# its tensors: measured by the GPU check (nvidia-smi, per process) on an H200 with torch 2.11 and
# CUDA 13, serving a model whose tensors are a few MB: main 747 MB, shadow 757 MB, each worker
# 820 MB (benchmarks/results/gpu-h200-tiny.json). The largest, for every role; other GPUs,
# drivers and torch versions differ by some tens of MB.
CUDA_CONTEXT_BYTES = 820 * 10**6
DEFAULT_MAX_BATCH = DEFAULTS.max_batch  # sequences main runs at once, each with its own KV cache


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


@dataclass(frozen=True)
class MemoryPlan:
    """Memory per role of one deployment shape (model, workers, shadow dtype, strategy)."""

    model: str
    checkpoint_dtype_bytes: int
    shadow_dtype: str
    strategy: str
    n_workers: int
    context_tokens: int  # KV cache tokens per sequence
    max_batch: int  # sequences main runs at once (the shadow follows shadow_max_states(max_batch))
    expert_store: str
    expert_bytes: int  # one expert (w1 + w2 + w3) in the checkpoint dtype
    total_bytes: int  # every tensor of the checkpoint
    roles: tuple[RoleMemory, ...]

    @property
    def main(self) -> RoleMemory:
        return self.role("main")

    @property
    def shadow(self) -> RoleMemory:
        return self.role("shadow")

    @property
    def workers(self) -> tuple[RoleMemory, ...]:
        return tuple(r for r in self.roles if r.role.startswith("worker-"))

    def role(self, name: str) -> RoleMemory:
        for role in self.roles:
            if role.role == name:
                return role
        raise KeyError(f"no role {name!r} in this plan (roles: {', '.join(r.role for r in self.roles)})")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "checkpoint_dtype_bytes": self.checkpoint_dtype_bytes,
            "shadow_dtype": self.shadow_dtype,
            "strategy": self.strategy,
            "n_workers": self.n_workers,
            "context_tokens": self.context_tokens,
            "max_batch": self.max_batch,
            "kv_cache": kv_sizing(self.max_batch, self.context_tokens),
            "expert_store": self.expert_store,
            "expert_bytes": self.expert_bytes,
            "total_bytes": self.total_bytes,
            "overhead_bytes": RUNTIME_OVERHEAD_BYTES,
            "roles": [r.to_dict() for r in self.roles],
        }


# --- KV caches ------------------------------------------------------------------------------


def kv_cache_bytes(sizes: ModelSizes, element_bytes: int, context_tokens: int, sequences: int = 1) -> int:
    """Keys and values of every layer for ``sequences`` sequences of ``context_tokens`` tokens each."""
    return sequences * sizes.layers * 2 * sizes.kv_heads * sizes.head_dim * element_bytes * context_tokens


def kv_text(sequences: int, context_tokens: int) -> str:
    """``KV cache for 8 sequences of 4096 tokens``: what a role's KV share is sized for."""
    return f"KV cache for {sequences} sequence{'' if sequences == 1 else 's'} of {context_tokens} tokens"


def shadow_max_states(max_batch: int) -> int:
    """The most sequences (each with its own KV cache) the shadow follows when main runs ``max_batch``."""
    return SHADOW_STATES_PER_SEQUENCE * max_batch


# --- plans -----------------------------------------------------------------------------------


def memory_from_checkpoint(
    ckpt: Checkpoint | str | os.PathLike[str],
    *,
    workers: int,
    shadow_dtype: str = DEFAULTS.shadow_dtype,
    strategy: str = DEFAULTS.strategy,
    max_resident_experts: int = DEFAULTS.max_resident_experts,
    cache_experts: int = DEFAULTS.cache_experts,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    expert_store: str = DEFAULTS.expert_store,
    max_batch: int = DEFAULT_MAX_BATCH,
    hot_experts: int = DEFAULTS.hot_experts,
    staging_buffers: int = DEFAULTS.staging_buffers,
    shards: str | os.PathLike[str] | None = None,
    expert_codec: str = DEFAULTS.expert_codec,
) -> MemoryPlan:
    """Memory per role for ``ckpt`` served by ``workers`` workers, from its real tensor sizes.

    With ``shards``, a shard set built from it: the workers' experts as it stores them
    (``with_stored_experts``; fewer bytes where it was built with an ``expert_codec``), and an
    ``expert_codec`` other than "none" that is not the set's is refused. Without, an
    ``expert_codec`` other than "none" counts each expert it would code at its bound
    (``with_coded_bound``), before the set is built.

    Main's KV caches are for ``max_batch`` sequences, the shadow's for ``shadow_max_states(max_batch)``
    (``SHADOW_STATES_PER_SEQUENCE * max_batch``: as many as main runs), of ``context_tokens`` tokens each.
    """
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint(ckpt)
    tensors = checkpoint_tensors(ckpt)
    if shards is not None:
        tensors = with_stored_experts(tensors, shards, expert_codec)
    else:
        tensors = with_coded_bound(ckpt, tensors, expert_codec)
    sizes = from_hf_config(ckpt.config)
    return plan_memory(
        tensors,
        sizes,
        name=ckpt.path.name,
        workers=workers,
        shadow_dtype=shadow_dtype,
        strategy=strategy,
        max_resident_experts=max_resident_experts,
        cache_experts=cache_experts,
        context_tokens=context_tokens,
        expert_store=expert_store,
        max_batch=max_batch,
        hot_experts=hot_experts,
        staging_buffers=staging_buffers,
    )


def memory_from_config(
    config: Mapping[str, Any] | ModelSizes | str,
    *,
    workers: int,
    dtype: str | None = None,
    shadow_dtype: str = DEFAULTS.shadow_dtype,
    strategy: str = DEFAULTS.strategy,
    max_resident_experts: int = DEFAULTS.max_resident_experts,
    cache_experts: int = DEFAULTS.cache_experts,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    expert_store: str = DEFAULTS.expert_store,
    max_batch: int = DEFAULT_MAX_BATCH,
    hot_experts: int = DEFAULTS.hot_experts,
    staging_buffers: int = DEFAULTS.staging_buffers,
) -> MemoryPlan:
    """The same plan from a config alone (a ``config.json`` dict, sizes, or a known model's name).

    ``dtype`` is the checkpoint's (``float32``, ``bfloat16``, ``float16``); by default the
    config's ``dtype`` (or ``torch_dtype``) field, else ``bfloat16`` as the releases are.
    """
    if isinstance(config, str):
        if config not in KNOWN_MODELS:
            raise ValueError(f"unknown model {config!r}; use one of {', '.join(sorted(KNOWN_MODELS))}")
        config = {**RELEASES[config], "_name_or_path": config} if config in RELEASES else KNOWN_MODELS[config]()
    if isinstance(config, ModelSizes):
        sizes = config
        tensors = config_tensors(sizes, dtype or "bfloat16")
    else:
        sizes = from_hf_config(dict(config))
        dtype = dtype or config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        tensors = family_tensors(config, dtype)
    return plan_memory(
        tensors,
        sizes,
        name=sizes.name,
        workers=workers,
        shadow_dtype=shadow_dtype,
        strategy=strategy,
        max_resident_experts=max_resident_experts,
        cache_experts=cache_experts,
        context_tokens=context_tokens,
        expert_store=expert_store,
        max_batch=max_batch,
        hot_experts=hot_experts,
        staging_buffers=staging_buffers,
    )


def pinned_block_bytes(nbytes: int) -> int:
    """What torch's pinned host allocator takes for a tensor of ``nbytes``: the next power of two
    (``CachingHostAllocator`` rounds every block so, and keeps freed blocks for reuse)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def plan_memory(
    tensors: Sequence[TensorSize],
    sizes: ModelSizes,
    *,
    name: str,
    workers: int,
    shadow_dtype: str,
    strategy: str,
    max_resident_experts: int,
    cache_experts: int,
    context_tokens: int,
    expert_store: str,
    max_batch: int,
    hot_experts: int = DEFAULTS.hot_experts,
    staging_buffers: int = DEFAULTS.staging_buffers,
) -> MemoryPlan:
    """Memory per role from a model's tensors and shape (what both entry points share).

    ``expert_store`` "" is the strategy's own (``inference.policies.strategies.expert_store_for``).

    Every sequence main runs holds its own KV cache, as does every sequence the shadow follows:
    main's is ``max_batch * kv_cache_bytes(context_tokens)`` (every running sequence at its full
    context, the worst case), the shadow's ``shadow_max_states(max_batch)`` times one sequence's.
    """
    get_strategy(strategy)  # a ValueError naming the choices
    expert_store = expert_store_for(strategy, expert_store)
    if shadow_dtype not in SHADOW_DTYPES:
        raise ValueError(f"shadow dtype must be one of {', '.join(SHADOW_DTYPES)}, got {shadow_dtype!r}")
    if expert_store not in EXPERT_STORES:
        raise ValueError(f"expert_store must be one of {', '.join(EXPERT_STORES)}, got {expert_store!r}")
    if max_resident_experts < 0 or cache_experts < 0 or context_tokens < 0 or hot_experts < 1 or staging_buffers < 1:
        raise ValueError(
            "max_resident_experts >= 0 (0: from each worker's group), cache_experts >= 0, context_tokens >= 0, "
            "hot_experts >= 1 and staging_buffers >= 1 are required"
        )
    if not 1 <= max_batch <= MAX_BATCH:
        raise ValueError(f"max_batch must be from 1 to {MAX_BATCH}, got {max_batch}")
    if not tensors:
        raise ValueError("the model has no tensors")
    plan = placement(sizes.layers, sizes.experts, sizes.top_k, workers)
    experts: dict[tuple[int, int], int] = {}
    stored: dict[tuple[int, int], int] = {}  # each expert as its worker shard stores it (coded: fewer)
    coded_pairs: set[tuple[int, int]] = set()
    pinned: dict[tuple[int, int], int] = {}  # each expert as torch's pinned host allocator holds it
    dense = 0
    for tensor in tensors:
        key = parse_expert_key(tensor.name)
        if key is None:
            dense += tensor.nbytes
        else:
            pair = (key.layer, key.expert)
            experts[pair] = experts.get(pair, 0) + tensor.nbytes
            stored[pair] = stored.get(pair, 0) + tensor.stored_nbytes
            if tensor.stored is not None:
                coded_pairs.add(pair)
            pinned[pair] = pinned.get(pair, 0) + pinned_block_bytes(tensor.nbytes)
    element = _checkpoint_element_bytes(tensors)
    expert_bytes = max(experts.values(), default=0)
    total = sum(t.nbytes for t in tensors)

    main_kv = kv_cache_bytes(sizes, element, context_tokens, max_batch)
    # The prerouter's heads and recovery adapter sit on main beside its weights (and on disk in its shard).
    extra = prerouter_bytes(sizes, element) if get_strategy(strategy).routes_by_prediction else 0
    main = RoleMemory(
        "main",
        host_bytes=dense + extra + RUNTIME_OVERHEAD_BYTES,
        gpu_bytes=dense + extra + main_kv + CUDA_CONTEXT_BYTES,
        disk_bytes=dense + extra,
        cpu_bytes=dense + extra + main_kv + RUNTIME_OVERHEAD_BYTES,
        kv_sequences=max_batch,
        kv_tokens=context_tokens,
    )
    shadow_weights = shadow_weight_bytes(tensors, shadow_dtype)
    shadow_states = shadow_max_states(max_batch)
    shadow_kv = kv_cache_bytes(sizes, CAST_BYTES.get(shadow_dtype, element), context_tokens, shadow_states)
    # The shadow moves each tensor to its device as it reads it: on a GPU box its RAM holds a
    # tensor or two in flight (an expert's w1 waits for its w3), on a CPU the whole model too.
    in_flight = 2 * max(t.nbytes for t in tensors)
    shadow = RoleMemory(
        "shadow",
        host_bytes=in_flight + RUNTIME_OVERHEAD_BYTES,
        gpu_bytes=shadow_weights + shadow_kv + CUDA_CONTEXT_BYTES,
        # The shard build converts the shadow's shard once unless it is the checkpoint's own dtype.
        disk_bytes=total if CAST_BYTES.get(shadow_dtype) == element else shadow_weights,
        cpu_bytes=shadow_weights + in_flight + RUNTIME_OVERHEAD_BYTES + shadow_kv,
        kv_sequences=shadow_states,
        kv_tokens=context_tokens,
    )
    roles = [main, shadow]
    coded = bool(coded_pairs)
    # A GPU worker copies coded experts ahead of their decodes (up to its depth of them) and decodes one
    # tensor at a time: the most coded bytes an expert takes, and the largest tensor's decode scratch.
    decode_scratch = max((_device_decode_scratch(t) for t in tensors if t.stored is not None), default=0)
    largest_coded = max((stored[pair] for pair in coded_pairs), default=0)
    for worker in range(workers):
        owned = sum(stored.get(pair, 0) for pair in plan.owned(worker))
        members = len(plan.groups[plan.group_of_worker(worker)])
        depth = resolve_depth(max_resident_experts, plan.top_k, members)  # what its loader will hold
        on_gpu = _worker_device_bytes(plan, worker, strategy, experts, expert_bytes, depth, cache_experts)
        on_gpu += depth * largest_coded + decode_scratch if coded else 0
        # On a GPU box a disk store's experts pass through the loader's pinned staging buffers
        # (as many as a copy pass holds, at most); a hot store's are read into pinned tensors of
        # their own from torch's allocator, its hot set and the reads whose copies are in flight.
        if expert_store == "disk":
            # A coded expert's bytes are read into buffers of their own (a GPU copies them as they are), up
            # to depth at once, beside the staging buffers.
            host = (min(staging_buffers, depth) + (depth if coded else 0)) * expert_bytes + RUNTIME_OVERHEAD_BYTES
        elif expert_store == "hot":
            owned_pinned = sum(pinned.get(pair, 0) for pair in plan.owned(worker))
            held = (hot_experts + depth) * max(pinned.values(), default=0)
            host = min(owned_pinned, held) + RUNTIME_OVERHEAD_BYTES
        else:
            # Coded experts stay coded in RAM; each load decodes one into a fresh buffer, up to depth at once.
            host = owned + (depth * expert_bytes if coded else 0) + RUNTIME_OVERHEAD_BYTES
        roles.append(RoleMemory(f"worker-{worker}", host, on_gpu + CUDA_CONTEXT_BYTES, owned, host + on_gpu))
    return MemoryPlan(
        model=name,
        checkpoint_dtype_bytes=element,
        shadow_dtype=shadow_dtype,
        strategy=strategy,
        n_workers=workers,
        context_tokens=context_tokens,
        max_batch=max_batch,
        expert_store=expert_store,
        expert_bytes=expert_bytes,
        total_bytes=total,
        roles=tuple(roles),
    )


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


def _checkpoint_element_bytes(tensors: Sequence[TensorSize]) -> int:
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


# --- the table -------------------------------------------------------------------------------


def table(config: Mapping[str, Any] | ModelSizes | str, *, workers: Sequence[int], **options: Any) -> str:
    """A Markdown table of memory per role (GB), one row per worker count and shadow dtype."""
    head = (
        "| workers | shadow | main host | main GPU | main disk | shadow host | shadow GPU | shadow disk "
        "| worker host | worker GPU | worker disk |"
    )
    lines = [head, "|" + "---:|" * 11]
    for count in workers:
        for dtype in SHADOW_DTYPES:
            plan = memory_from_config(config, workers=count, shadow_dtype=dtype, **options)
            cells = [str(count), dtype]
            for role in (plan.main, plan.shadow):
                cells += [_num(role.host_bytes), _num(role.gpu_bytes), _num(role.disk_bytes)]
            for field in ("host_bytes", "gpu_bytes", "disk_bytes"):
                values = sorted({getattr(w, field) for w in plan.workers})
                cells.append(_num(values[0]) if len(values) == 1 else f"{_num(values[0])}–{_num(values[-1])}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kv_sizing(max_batch: int, context_tokens: int) -> str:
    """What a plan's KV caches are sized for, in words (the CLI's heading)."""
    return f"main's {kv_text(max_batch, context_tokens)}, the shadow's for {shadow_max_states(max_batch)}"


def _num(n: int) -> str:
    return f"{n / GB:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference.building.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mixtral-8x7b", choices=sorted(KNOWN_MODELS), help="a known release")
    parser.add_argument("--checkpoint", help="a checkpoint directory instead of a known model (real tensor sizes)")
    parser.add_argument("--workers", type=int, nargs="+", default=[8])
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(CHECKPOINT_DTYPE_BYTES))
    parser.add_argument("--strategy", default=DEFAULTS.strategy)
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT_TOKENS, help="KV cache tokens per sequence")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help="sequences main runs at once, each with its own KV cache "
        f"(the shadow follows {SHADOW_STATES_PER_SEQUENCE} x max_batch, each with its own too)",
    )
    stores = ("", *EXPERT_STORES)
    parser.add_argument("--expert-store", default=DEFAULTS.expert_store, choices=stores, help="default: the strategy's")
    parser.add_argument("--hot-experts", type=int, default=DEFAULTS.hot_experts, help="hot store: experts in RAM")
    args = parser.parse_args(argv)
    if not 1 <= args.max_batch <= MAX_BATCH:
        parser.error(f"--max-batch must be from 1 to {MAX_BATCH}")
    options = {
        "strategy": args.strategy,
        "context_tokens": args.context,
        "expert_store": args.expert_store,
        "max_batch": args.max_batch,
        "hot_experts": args.hot_experts,
    }
    kv = kv_sizing(args.max_batch, args.context)
    if args.checkpoint:
        try:
            ckpt = Checkpoint(args.checkpoint)
        except CheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{ckpt.path.name}, {args.strategy}, {kv}; host/GPU/disk GB, GB = 10^9 bytes\n")
        for count in args.workers:
            for dtype in SHADOW_DTYPES:
                plan = memory_from_checkpoint(ckpt, workers=count, shadow_dtype=dtype, **options)
                print(
                    f"{count} workers, {dtype} shadow: "
                    + ", ".join(
                        f"{r.role} {_num(r.host_bytes)}/{_num(r.gpu_bytes)}/{_num(r.disk_bytes)} GB" for r in plan.roles
                    )
                )
        return 0
    print(f"{args.model} ({args.dtype}), {args.strategy}, {kv}; GB = 10^9 bytes\n")
    print(table(args.model, workers=args.workers, dtype=args.dtype, **options))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
