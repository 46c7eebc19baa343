"""A role's launch spec: what an agent (or ``generate``) hands to ``serve-role``.

The spec names the role, its shard, the peer table (every role's inbox address), the role's
data-plane keys (``inference.curve``: its own pair, and by principal the public keys of the
roles it talks with and of its own client) and the runtime settings. It is JSON on disk (the
agent writes it readable by its own user only: it holds the role's secret key); ``load_spec``
validates it and says what is wrong. A spec without keys is refused: no role serves an
unauthenticated data plane.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from inference.constants import (
    BATCH_ARITHMETICS,
    COMPUTE_DTYPES,
    DEFAULT_MAX_PER_USER,
    DEFAULT_MAX_WAITING,
    EXPERT_STORES,
    MAX_BATCH,
    SHADOW_DTYPES,
)
from inference.curve import CurveError, EndpointKeys, check_endpoint_keys, endpoint_keys_from_json
from inference.permissions import CLIENT, correspondents
from inference.routing import ARITHMETICS
from inference.strategies import DEFAULT_STRATEGY, RUNTIME_STRATEGIES, expert_store_for, predictor_for
from inference.typecheck import checker

ROLES = ("main", "shadow", "worker")


class SpecError(ValueError):
    """A spec file that cannot be used, with the reason."""


@dataclass(frozen=True)
class Settings:
    shadow_dtype: str = "fp32"
    token_period: int = 1
    kv_period: int = 1
    device: str = "auto"  # "auto" picks CUDA when present, else CPU
    dtype: str = "auto"  # what main and workers compute in: "auto" = the checkpoint's dtype
    # Experts a worker holds on its device at once (computing, copying, copied ahead); 0: its
    # prefetch depth, from its group and the model's top-k (inference.depth: 2 for Mixtral on
    # groups of 2 or more), which the memory plans and the fit check reserve too.
    max_resident_experts: int = 0
    # Pinned host buffers a GPU worker with the "disk" store reads each expert into on its way to
    # the device, used in turn (inference.staging); a copy pass holds at most the worker's
    # resolved depth (above), so no more than that many are made.
    staging_buffers: int = 3
    timeout_s: float = 60.0  # the longest any role waits for a peer before failing
    lookahead: int = 2  # how many steps the shadow may run ahead of main
    # When aligned every step, the shadow runs the next step on its own guess of main's token
    # before main's alignment arrives, so early layers' predictions are out in time.
    speculate: bool = True
    threads: int = 1  # torch intra-op threads per role process
    copy_bytes_per_s: float | None = None  # emulated host->device bandwidth, None = real copies
    # How main sums expert outputs: as Transformers' grouped (default) or eager experts do;
    # "auto" picks grouped unless torch's grouped GEMM cannot run the model's shapes.
    experts_arithmetic: str = "auto"
    # Prefill rows per expert per message (mini-batches overlap transfer and compute); 0 = whole.
    prefill_chunk: int = 64
    # What workers keep on the device and who predicts: see inference/strategies.py.
    strategy: str = DEFAULT_STRATEGY
    # Who names the experts to load ahead (inference.strategies.PREDICTORS): "" = the
    # strategy's own (odmoe: the shadow; lru-offload: main's next-layer router).
    predictor: str = ""
    # importance (approximate): a routed expert whose routing weight is below this and that
    # no worker holds is replaced by the most similar one that is held (inference.importance);
    # 0 substitutes nothing. 0.3 was chosen before anything was measured; benchmarks.quality
    # reports other values beside it.
    importance_threshold: float = 0.3
    cache_experts: int = 2  # lru-offload: experts each worker keeps per layer
    # Emulated network uplink of every role (bytes/s and one-way latency); None = the real one.
    link_bytes_per_s: float | None = None
    link_latency_s: float = 0.0
    # Where workers keep their experts: "ram" (read at start), "disk" (read at each load) or
    # "hot" (read from disk, the last ``hot_experts`` kept in RAM, predicted ones pinned);
    # "" = the strategy's own (prerouter: "hot", the others "ram").
    expert_store: str = ""
    hot_experts: int = 16
    disk_bytes_per_s: float | None = None  # emulated disk read bandwidth of the "disk" and "hot" stores
    # Continuous batching (inference.batching): sequences main runs at once, and requests it
    # holds beyond them before it refuses new ones.
    max_batch: int = 8
    max_waiting: int = DEFAULT_MAX_WAITING
    # Generations one user may have in main at once, running and waiting (inference.batching.
    # admission); more are refused as "too many generations", not "full". Below max_batch +
    # max_waiting, so that one user sending many leaves room for the others: 32 lets an
    # evaluation harness or a batch client send 32 at once and leaves 40 places to everyone else.
    max_per_user: int = DEFAULT_MAX_PER_USER
    # How a worker computes an expert's rows of several sequences: "exact" (each sequence's
    # rows on their own, so every token is its own run's) or "fused" (one GEMM over all of
    # them: the expert's weights read once, but a GEMM over several rows may round
    # differently from one over a single row, e.g. fp32 on CPU).
    batch_arithmetic: str = "exact"
    # Prompt tokens a joining sequence prefills per batch step (chunked prefill), so a long
    # prompt holds the batch's decoding up for one piece at a time instead of its whole
    # prefill; 0 = the whole prompt in one step. Not exact by construction: a prompt
    # prefilled in pieces rounds differently from one prefilled whole (fp32 on CPU: last-token
    # logits differ by about 4e-6), so its tokens can differ from Transformers' own run.
    prefill_step: int = 0
    # Hybrid CPU/GPU execution (inference.hybrid): a worker computes a requested expert on its
    # own CPU from host memory when that finishes before its copy to the device would (a late
    # expert, above all). Exact on CPU workers; on CUDA the CPU's kernels may round otherwise,
    # hence off by default. Needs the "ram" expert store.
    hybrid: bool = False
    # Emulated rates of the worker host's CPU path (bytes/s it streams weights at, FLOP/s);
    # None = measured by the worker at start.
    host_memory_bytes_per_s: float | None = None
    host_flops: float | None = None


@dataclass(frozen=True)
class Addresses:
    main: str
    workers: list[str]
    shadow: str | None = None


@dataclass(frozen=True)
class RoleSpec:
    deployment: str
    role: str
    shard_dir: str
    addresses: Addresses
    worker: int | None = None
    settings: Settings = field(default_factory=Settings)
    # The role's data-plane keys (inference.curve). Required: None is only how a spec that
    # lacks them reads before ``validate_spec`` refuses it.
    curve: EndpointKeys | None = None

    @property
    def name(self) -> str:
        return f"worker-{self.worker}" if self.role == "worker" else self.role

    @property
    def roles(self) -> list[str]:
        """Every role of the peer table by its principal name: main, the shadow if any, the workers."""
        shadow = ["shadow"] if self.addresses.shadow is not None else []
        return ["main", *shadow, *(f"worker-{i}" for i in range(len(self.addresses.workers)))]

    @property
    def bind_address(self) -> str:
        if self.role == "main":
            return self.addresses.main
        if self.role == "shadow":
            assert self.addresses.shadow is not None
            return self.addresses.shadow
        assert self.worker is not None
        return self.addresses.workers[self.worker]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def compute_dtype(setting: str, config: dict | None = None) -> torch.dtype | None:
    """What main and the workers compute in, for a ``Settings.dtype``.

    "auto" is what Transformers' ``from_pretrained(dtype="auto")`` picks: the config's
    ``dtype`` (or older ``torch_dtype``) when it names one, else None (the tensors' own dtype).
    """
    if setting != "auto":
        return getattr(torch, setting)
    named = (config or {}).get("dtype") or (config or {}).get("torch_dtype")
    return getattr(torch, named) if named in COMPUTE_DTYPES[1:] else None


def _check_types(obj: object, where: str) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        nested = dataclasses.is_dataclass(hints[f.name]) or dataclasses.is_dataclass(value)
        if not nested and not checker(hints[f.name])(value):
            raise SpecError(f"{where}{f.name} has the wrong type: {value!r:.60} (expected {hints[f.name]})")


def check_max_per_user(max_per_user: int, max_batch: int, max_waiting: int) -> None:
    """``SpecError`` unless one user's bound leaves others a place: 1 <= it < max_batch + max_waiting."""
    if not 1 <= max_per_user < max_batch + max_waiting:
        raise SpecError(
            f"max_per_user must be at least 1 and below max_batch + max_waiting ({max_batch} + {max_waiting}), "
            f"so that one user leaves room for others; got {max_per_user}"
        )


def validate_settings(s: Settings) -> Settings:
    """Raise ``SpecError`` saying what is wrong with the runtime settings ``s``."""
    _check_types(s, "settings.")
    if s.shadow_dtype not in SHADOW_DTYPES:
        raise SpecError(f"shadow_dtype must be one of {', '.join(SHADOW_DTYPES)}, got {s.shadow_dtype!r}")
    for name in ("token_period", "kv_period"):
        if getattr(s, name) < 0:
            raise SpecError(f"{name} must be >= 0 (0 = never align)")
    if not 1 <= s.max_batch <= MAX_BATCH or s.max_waiting < 0:
        raise SpecError(f"max_batch must be from 1 to {MAX_BATCH} and max_waiting >= 0")
    check_max_per_user(s.max_per_user, s.max_batch, s.max_waiting)
    if s.prefill_step < 0:
        raise SpecError("prefill_step must be >= 0 (0 = the whole prompt in one step)")
    if s.prefill_chunk < 0:
        raise SpecError("prefill_chunk must be >= 0 (0 = no mini-batches)")
    if s.max_resident_experts < 0 or s.timeout_s <= 0 or s.threads < 1 or s.lookahead < 0 or s.staging_buffers < 1:
        raise SpecError(
            "max_resident_experts >= 0 (0: from the worker's group), staging_buffers, threads >= 1, "
            "timeout_s > 0 and lookahead >= 0 are required"
        )
    if s.dtype not in COMPUTE_DTYPES:
        raise SpecError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {s.dtype!r}")
    if s.strategy not in RUNTIME_STRATEGIES:
        raise SpecError(f"strategy must be one of {', '.join(RUNTIME_STRATEGIES)}, got {s.strategy!r}")
    if not 0 <= s.importance_threshold <= 1:
        raise SpecError(f"importance_threshold must be from 0 to 1, got {s.importance_threshold}")
    try:
        predictor_for(s.strategy, s.predictor)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    if s.cache_experts < 0:
        raise SpecError("cache_experts must be >= 0")
    if s.hot_experts < 1:
        raise SpecError(f"hot_experts must be >= 1 (experts a hot store keeps in RAM), got {s.hot_experts}")
    if s.expert_store and s.expert_store not in EXPERT_STORES:
        raise SpecError(f"expert_store must be one of {', '.join(EXPERT_STORES)}, got {s.expert_store!r}")
    if s.hybrid and expert_store_for(s.strategy, s.expert_store) != "ram":
        raise SpecError(
            "hybrid execution computes experts from host memory and needs the ram expert store, "
            f"not {expert_store_for(s.strategy, s.expert_store)!r}"
        )
    for name in ("copy_bytes_per_s", "link_bytes_per_s", "disk_bytes_per_s", "host_memory_bytes_per_s", "host_flops"):
        value = getattr(s, name)
        if value is not None and value <= 0:
            raise SpecError(f"{name} must be > 0 (or null for no emulation), got {value}")
    if s.link_latency_s < 0:
        raise SpecError("link_latency_s must be >= 0")
    if s.batch_arithmetic not in BATCH_ARITHMETICS:
        raise SpecError(f"batch_arithmetic must be one of {', '.join(BATCH_ARITHMETICS)}, got {s.batch_arithmetic!r}")
    if s.experts_arithmetic not in ARITHMETICS:
        raise SpecError(f"experts_arithmetic must be one of {', '.join(ARITHMETICS)}, got {s.experts_arithmetic!r}")
    if s.device not in ("auto", "cpu") and not s.device.startswith("cuda"):
        raise SpecError(f"device must be auto, cpu or cuda[:N], got {s.device!r}")
    return s


def validate_spec(spec: RoleSpec) -> RoleSpec:
    _check_types(spec, "")
    _check_types(spec.addresses, "addresses.")
    if spec.role not in ROLES:
        raise SpecError(f"role must be one of {', '.join(ROLES)}, got {spec.role!r}")
    if not spec.addresses.workers:
        raise SpecError("the peer table lists no workers; at least one is needed")
    if spec.role == "worker" and (spec.worker is None or not 0 <= spec.worker < len(spec.addresses.workers)):
        raise SpecError(f"worker index {spec.worker!r} is not in the peer table (0..{len(spec.addresses.workers) - 1})")
    if spec.role == "shadow" and spec.addresses.shadow is None:
        raise SpecError("role is shadow but the peer table has no shadow address")
    validate_settings(spec.settings)
    validate_keys(spec)
    if not Path(spec.shard_dir).is_dir():
        raise SpecError(f"shard directory {spec.shard_dir} does not exist")
    return spec


def validate_keys(spec: RoleSpec) -> EndpointKeys:
    """The spec's keys, or ``SpecError``: a pair, and the public keys of exactly the roles this
    role talks with (``inference.permissions``) and of its own client."""
    if spec.curve is None:
        raise SpecError(
            "the spec has no data-plane keys (curve): a role never serves an unauthenticated data plane; "
            "the control plane and the local launcher give every role its own"
        )
    try:
        check_endpoint_keys(spec.curve)
    except CurveError as exc:
        raise SpecError(f"curve: {exc}") from None
    expected = {*correspondents(spec.name, spec.roles), CLIENT}
    missing, extra = expected - set(spec.curve.peers), set(spec.curve.peers) - expected
    if missing or extra:
        said = [f"lacks {', '.join(sorted(missing))}"] if missing else []
        said += [f"has {', '.join(sorted(extra))}, which {spec.name} does not talk with"] if extra else []
        raise SpecError(f"curve: the public keys of {spec.name}'s peers {' and '.join(said)}")
    return spec.curve


def write_private(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` readable and writable by this user only (a spec holds a secret key)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # also when the file was there before, with other modes
    with os.fdopen(fd, "w") as out:
        out.write(text)


def load_spec(path: str | Path) -> RoleSpec:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(f"spec file {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"spec file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(f"spec file {path} must hold a JSON object")
    unknown = set(data) - {f.name for f in dataclasses.fields(RoleSpec)}
    if unknown:
        raise SpecError(f"spec file {path} has unknown fields: {', '.join(sorted(unknown))}")
    try:
        spec = RoleSpec(
            deployment=str(data["deployment"]),
            role=data["role"],
            shard_dir=str(data["shard_dir"]),
            addresses=Addresses(**data["addresses"]),
            worker=data.get("worker"),
            settings=Settings(**data.get("settings", {})),
            curve=endpoint_keys_from_json(data["curve"]) if data.get("curve") is not None else None,
        )
    except KeyError as exc:
        raise SpecError(f"spec file {path} lacks the field {exc}") from None
    except CurveError as exc:
        raise SpecError(f"spec file {path}: curve: {exc}") from None
    except TypeError as exc:
        raise SpecError(f"spec file {path} has an unknown or misplaced field: {exc}") from None
    return validate_spec(spec)
