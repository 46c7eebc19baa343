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
The tensors and their bytes per dtype are ``tensor_sizes``'; each role's share of them
``role_memory``'s (this module checks a plan's options and puts its roles together); whether a
node can hold a role is ``fit``'s (``check_fit``: the shortfalls as sentences that name the node, the role, the resource
and by how much it falls short). Run ``python -m inference.building.memory --model mixtral-8x7b --workers 8
[--max-batch 8] [--context 4096]`` for the table of a known model.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inference.building.role_memory import (
    RUNTIME_OVERHEAD_BYTES,
    ExpertBytes,
    RoleMemory,
    checkpoint_element_bytes,
    kv_text,
    main_memory,
    shadow_max_states,
    shadow_memory,
    worker_memory,
)
from inference.building.tensor_sizes import (
    CHECKPOINT_DTYPE_BYTES,
    TensorSize,
    checkpoint_tensors,
    config_tensors,
    family_tensors,
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
from inference.modelio.checkpoint import Checkpoint, CheckpointError
from inference.modelio.families.releases import RELEASES
from inference.policies.placement import placement
from inference.policies.strategies import expert_store_for, get_strategy
from inference.settings import DEFAULTS, DeploymentSettings
from inference.sim.model_sizes import KNOWN_MODELS, ModelSizes, from_hf_config

GB = 10**9  # what the console and the messages print (decimal, as disks are sold)
DEFAULT_MAX_BATCH = DEFAULTS.max_batch  # sequences main runs at once, each with its own KV cache


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


# --- plans -----------------------------------------------------------------------------------


def memory_from_checkpoint(
    ckpt: Checkpoint | str | os.PathLike[str],
    *,
    workers: int,
    settings: DeploymentSettings = DEFAULTS,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    shards: str | os.PathLike[str] | None = None,
) -> MemoryPlan:
    """Memory per role for ``ckpt`` served by ``workers`` workers under ``settings``, from its real
    tensor sizes.

    With ``shards``, a shard set built from it: the workers' experts as it stores them
    (``with_stored_experts``; fewer bytes where it was built with an ``expert_codec``), and a
    ``settings.expert_codec`` other than "none" that is not the set's is refused. Without, an
    ``expert_codec`` other than "none" counts each expert it would code at its bound
    (``with_coded_bound``), before the set is built.

    Main's KV caches are for ``settings.max_batch`` sequences, the shadow's for
    ``shadow_max_states(max_batch)`` (``SHADOW_STATES_PER_SEQUENCE * max_batch``: as many as main
    runs), of ``context_tokens`` tokens each.
    """
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint(ckpt)
    tensors = checkpoint_tensors(ckpt)
    if shards is not None:
        tensors = with_stored_experts(tensors, shards, settings.expert_codec)
    else:
        tensors = with_coded_bound(ckpt, tensors, settings.expert_codec)
    sizes = from_hf_config(ckpt.config)
    return plan_memory(
        tensors, sizes, name=ckpt.path.name, workers=workers, settings=settings, context_tokens=context_tokens
    )


def memory_from_config(
    config: Mapping[str, Any] | ModelSizes | str,
    *,
    workers: int,
    dtype: str | None = None,
    settings: DeploymentSettings = DEFAULTS,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
) -> MemoryPlan:
    """The same plan from a config alone (a ``config.json`` dict, sizes, or a known model's name).

    ``dtype`` is the checkpoint's (``float32``, ``bfloat16``, ``float16``); by default the
    config's ``dtype`` (or ``torch_dtype``) field, else ``bfloat16`` as the releases are. No shard
    set exists yet: a ``settings.expert_codec`` is not counted.
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
        tensors, sizes, name=sizes.name, workers=workers, settings=settings, context_tokens=context_tokens
    )


def plan_memory(
    tensors: Sequence[TensorSize],
    sizes: ModelSizes,
    *,
    name: str,
    workers: int,
    settings: DeploymentSettings = DEFAULTS,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
) -> MemoryPlan:
    """Memory per role from a model's tensors and shape under a deployment's ``settings`` (what both
    entry points share). What it reads of them: the shadow's dtype, the strategy, the expert store
    (``expert_store`` "" is the strategy's own, ``inference.policies.strategies.expert_store_for``)
    and its ``hot_experts`` and ``staging_buffers``, ``max_resident_experts``, ``cache_experts`` and
    ``max_batch``.

    Every sequence main runs holds its own KV cache, as does every sequence the shadow follows:
    main's is ``max_batch * kv_cache_bytes(context_tokens)`` (every running sequence at its full
    context, the worst case), the shadow's ``shadow_max_states(max_batch)`` times one sequence's.
    """
    expert_store = _checked_options(tensors, settings, context_tokens)
    plan = placement(sizes.layers, sizes.experts, sizes.top_k, workers)
    held = ExpertBytes.of(tensors)
    element = checkpoint_element_bytes(tensors)
    max_batch, shadow_dtype = settings.max_batch, settings.shadow_dtype
    main = main_memory(sizes, settings.strategy, element, held.dense, context_tokens, max_batch)
    shadow = shadow_memory(tensors, sizes, shadow_dtype, element, context_tokens, max_batch)
    workers_memory = [worker_memory(plan, worker, held, settings, expert_store) for worker in range(workers)]
    return MemoryPlan(
        model=name,
        checkpoint_dtype_bytes=element,
        shadow_dtype=shadow_dtype,
        strategy=settings.strategy,
        n_workers=workers,
        context_tokens=context_tokens,
        max_batch=max_batch,
        expert_store=expert_store,
        expert_bytes=held.expert_bytes,
        total_bytes=sum(t.nbytes for t in tensors),
        roles=(main, shadow, *workers_memory),
    )


def _checked_options(tensors: Sequence[TensorSize], settings: DeploymentSettings, context_tokens: int) -> str:
    """The expert store a plan counts (``settings.expert_store``, or the strategy's own for ""); a
    ValueError naming the choices or the bounds for a setting out of them."""
    strategy = settings.strategy
    get_strategy(strategy)  # a ValueError naming the choices
    expert_store = expert_store_for(strategy, settings.expert_store)
    if settings.shadow_dtype not in SHADOW_DTYPES:
        raise ValueError(f"shadow dtype must be one of {', '.join(SHADOW_DTYPES)}, got {settings.shadow_dtype!r}")
    if expert_store not in EXPERT_STORES:
        raise ValueError(f"expert_store must be one of {', '.join(EXPERT_STORES)}, got {expert_store!r}")
    counts = (settings.max_resident_experts, settings.cache_experts, context_tokens)
    if min(counts) < 0 or settings.hot_experts < 1 or settings.staging_buffers < 1:
        raise ValueError(
            "max_resident_experts >= 0 (0: from each worker's group), cache_experts >= 0, context_tokens >= 0, "
            "hot_experts >= 1 and staging_buffers >= 1 are required"
        )
    if not 1 <= settings.max_batch <= MAX_BATCH:
        raise ValueError(f"max_batch must be from 1 to {MAX_BATCH}, got {settings.max_batch}")
    if not tensors:
        raise ValueError("the model has no tensors")
    return expert_store


# --- the table -------------------------------------------------------------------------------


def table(
    config: Mapping[str, Any] | ModelSizes | str,
    *,
    workers: Sequence[int],
    settings: DeploymentSettings = DEFAULTS,
    dtype: str | None = None,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
) -> str:
    """A Markdown table of memory per role (GB), one row per worker count and shadow dtype (the rest
    of ``settings`` as given)."""
    head = (
        "| workers | shadow | main host | main GPU | main disk | shadow host | shadow GPU | shadow disk "
        "| worker host | worker GPU | worker disk |"
    )
    lines = [head, "|" + "---:|" * 11]
    for count in workers:
        for shadow_dtype in SHADOW_DTYPES:
            shadow = dataclasses.replace(settings, shadow_dtype=shadow_dtype)
            plan = memory_from_config(
                config, workers=count, dtype=dtype, settings=shadow, context_tokens=context_tokens
            )
            cells = [str(count), shadow_dtype]
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
    settings = dataclasses.replace(
        DEFAULTS,
        strategy=args.strategy,
        expert_store=args.expert_store,
        max_batch=args.max_batch,
        hot_experts=args.hot_experts,
    )
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
                shadow = dataclasses.replace(settings, shadow_dtype=dtype)
                plan = memory_from_checkpoint(ckpt, workers=count, settings=shadow, context_tokens=args.context)
                print(
                    f"{count} workers, {dtype} shadow: "
                    + ", ".join(
                        f"{r.role} {_num(r.host_bytes)}/{_num(r.gpu_bytes)}/{_num(r.disk_bytes)} GB" for r in plan.roles
                    )
                )
        return 0
    print(f"{args.model} ({args.dtype}), {args.strategy}, {kv}; GB = 10^9 bytes\n")
    print(table(args.model, workers=args.workers, settings=settings, dtype=args.dtype, context_tokens=args.context))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
