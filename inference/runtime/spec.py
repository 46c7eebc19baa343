"""A role's launch spec: what an agent (or ``generate``) hands to ``serve-role``.

The spec names the role, its shard, the peer table (every role's inbox address), the role's
data-plane keys (``inference.runtime.curve``: its own pair, and by principal the public keys of the
roles it talks with and of its own client) and the runtime settings. It is JSON on disk (the
agent writes it readable by its own user only: it holds the role's secret key); ``load_spec``
validates it and says what is wrong. A spec without keys is refused: no role serves an
unauthenticated data plane. The settings are ``inference.settings.DeploymentSettings``, the
one declaration the control plane shares (re-exported here by that one name).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from inference.constants import COMPUTE_DTYPES
from inference.runtime.curve import CurveError, EndpointKeys, check_endpoint_keys, endpoint_keys_from_json
from inference.runtime.permissions import CLIENT, correspondents
from inference.settings import DeploymentSettings, SpecError, check_max_per_user, check_types, validate_settings

__all__ = [
    "ROLES",
    "Addresses",
    "DeploymentSettings",
    "RoleSpec",
    "SpecError",
    "check_max_per_user",
    "load_spec",
    "validate_settings",
]

ROLES = ("main", "shadow", "worker")


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
    settings: DeploymentSettings = field(default_factory=DeploymentSettings)
    # The role's data-plane keys (inference.runtime.curve). Required: None is only how a spec that
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
    """What main and the workers compute in, for a ``DeploymentSettings.dtype``.

    "auto" is what Transformers' ``from_pretrained(dtype="auto")`` picks: the config's
    ``dtype`` (or older ``torch_dtype``) when it names one, else None (the tensors' own dtype).
    """
    if setting != "auto":
        return getattr(torch, setting)
    named = (config or {}).get("dtype") or (config or {}).get("torch_dtype")
    return getattr(torch, named) if named in COMPUTE_DTYPES[1:] else None


def validate_spec(spec: RoleSpec) -> RoleSpec:
    check_types(spec, "")
    check_types(spec.addresses, "addresses.")
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
    role talks with (``inference.runtime.permissions``) and of its own client."""
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
            settings=DeploymentSettings(**data.get("settings", {})),
            curve=endpoint_keys_from_json(data["curve"]) if data.get("curve") is not None else None,
        )
    except KeyError as exc:
        raise SpecError(f"spec file {path} lacks the field {exc}") from None
    except CurveError as exc:
        raise SpecError(f"spec file {path}: curve: {exc}") from None
    except TypeError as exc:
        raise SpecError(f"spec file {path} has an unknown or misplaced field: {exc}") from None
    return validate_spec(spec)
