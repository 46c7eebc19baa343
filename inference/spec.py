"""A role's launch spec: what an agent (or ``generate``) hands to ``serve-role``.

The spec names the role, its shard, the peer table (every role's inbox address) and the
runtime settings. It is JSON on disk; ``load_spec`` validates it and says what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from inference.constants import SHADOW_DTYPES
from inference.routing import ARITHMETICS

ROLES = ("main", "shadow", "worker")


class SpecError(ValueError):
    """A spec file that cannot be used, with the reason."""


@dataclass(frozen=True)
class Settings:
    shadow_dtype: str = "fp32"
    token_period: int = 1
    kv_period: int = 1
    device: str = "auto"  # "auto" picks CUDA when present, else CPU
    max_resident_experts: int = 2
    timeout_s: float = 60.0  # the longest any role waits for a peer before failing
    lookahead: int = 2  # how many steps the shadow may run ahead of main
    threads: int = 1  # torch intra-op threads per role process
    copy_bytes_per_s: float | None = None  # emulated host->device bandwidth, None = real copies
    # How main sums expert outputs: as Transformers' grouped (default) or eager experts do;
    # "auto" picks grouped unless torch's grouped GEMM cannot run the model's shapes.
    experts_arithmetic: str = "auto"


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

    @property
    def name(self) -> str:
        return f"worker-{self.worker}" if self.role == "worker" else self.role

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


def validate_spec(spec: RoleSpec) -> RoleSpec:
    if spec.role not in ROLES:
        raise SpecError(f"role must be one of {', '.join(ROLES)}, got {spec.role!r}")
    if not spec.addresses.workers:
        raise SpecError("the peer table lists no workers; at least one is needed")
    if spec.role == "worker" and (spec.worker is None or not 0 <= spec.worker < len(spec.addresses.workers)):
        raise SpecError(f"worker index {spec.worker!r} is not in the peer table (0..{len(spec.addresses.workers) - 1})")
    if spec.role == "shadow" and spec.addresses.shadow is None:
        raise SpecError("role is shadow but the peer table has no shadow address")
    s = spec.settings
    if s.shadow_dtype not in SHADOW_DTYPES:
        raise SpecError(f"shadow_dtype must be one of {', '.join(SHADOW_DTYPES)}, got {s.shadow_dtype!r}")
    for name in ("token_period", "kv_period"):
        if getattr(s, name) < 0:
            raise SpecError(f"{name} must be >= 0 (0 = never align)")
    if s.max_resident_experts < 1 or s.timeout_s <= 0 or s.threads < 1 or s.lookahead < 0:
        raise SpecError("max_resident_experts, threads >= 1, timeout_s > 0 and lookahead >= 0 are required")
    if s.experts_arithmetic not in ARITHMETICS:
        raise SpecError(f"experts_arithmetic must be one of {', '.join(ARITHMETICS)}, got {s.experts_arithmetic!r}")
    if s.device not in ("auto", "cpu") and not s.device.startswith("cuda"):
        raise SpecError(f"device must be auto, cpu or cuda[:N], got {s.device!r}")
    if not Path(spec.shard_dir).is_dir():
        raise SpecError(f"shard directory {spec.shard_dir} does not exist")
    return spec


def load_spec(path: str | Path) -> RoleSpec:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(f"spec file {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"spec file {path} is not valid JSON: {exc}") from None
    try:
        spec = RoleSpec(
            deployment=str(data["deployment"]),
            role=data["role"],
            shard_dir=str(data["shard_dir"]),
            addresses=Addresses(**data["addresses"]),
            worker=data.get("worker"),
            settings=Settings(**data.get("settings", {})),
        )
    except (KeyError, TypeError) as exc:
        raise SpecError(f"spec file {path} is missing or has an unknown field: {exc}") from None
    return validate_spec(spec)
