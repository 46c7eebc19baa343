"""Read and check the per-role shards that ``inference.building.sharding`` builds.

A shard set is a directory of role shards (``shards.json`` lists them: ``ShardSet``); every
role directory carries a ``manifest.json`` with the size and SHA-256 of each of its files.
``verify_shard`` refuses a directory that doesn't match it, because a half-copied expert
would otherwise silently produce wrong tokens; ``load_role_tensors`` reads a verified shard
one tensor at a time. This is what the roles, the agent and the control plane need of a
shard; building one (``inference.building.sharding``) needs the checkpoint and the shadow's
conversion besides. Importing this module does not import torch (the control plane's web and
Celery processes read manifests and shard names from it); reading tensors does.

Layout::

    out_dir/shards.json          the set: model summary, placement, roles and their dirs
    out_dir/main/                manifest.json, config + tokenizer files, part-00001.safetensors, ...
    out_dir/shadow/              same, with every tensor
    out_dir/shadow-{dtype}/      the shadow's model converted to dtype (``RECORDS_FORMAT``)
    out_dir/worker-{i}/          manifest.json, config.json, parts with the owned experts

A worker shard built with an expert code (``expert_codec``) stores each expert tensor under its
own name as a flat ``U8`` tensor of its coded bytes; its manifest's ``stored`` maps each such name
to a ``StoredTensor`` (the code, the decoded dtype and shape, raw and stored bytes), and
``load_role_tensors`` decodes them (``inference.modelio.expert_codec``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference.constants import (
    CODED_DTYPE_BYTES,
    EXPERT_CODEC_OF_CODE,
    EXPERT_CODECS,
    MAIN_EXTRAS,
    NF4_BLOCKSIZE,
    OWN_SHADOW_DTYPE,
    SHADOW_DTYPES,
)
from inference.policies.placement import LayerExpert, Placement, placement_from_dict

if TYPE_CHECKING:
    import torch

SHARD_FORMAT = "odmoe-shard/1"
SET_FORMAT = "odmoe-shards/1"
MANIFEST_FILE = "manifest.json"
SET_FILE = "shards.json"
ROLES = ("main", "shadow", "worker")

# The converted layout of a pre-converted shadow shard, record by record (what
# ``inference.shadow.shadow_model.convert_tensors`` yields and such a shard stores): a kept tensor under
# its Transformers name in its shadow dtype; a quantized linear as ``{path}.weight_data`` /
# ``{path}.weight_state`` (``QuantizedLinear``'s buffers); expert E of layer L as
# ``model.layers.L.mlp.experts.{gate_up|down}.E`` whatever the family, ``.qdata`` / ``.qstate``
# appended when quantized.
# Written into a pre-converted shard's manifest and checked on load: a shard converted by
# another version's layout or quantizer is refused, not misread.
RECORDS_FORMAT = f"odmoe-shadow-records/1; nf4 blocks of {NF4_BLOCKSIZE}, high nibble first; int8 per row"

_ROLE_DIR_RE = re.compile(r"main|shadow(-(" + "|".join(SHADOW_DTYPES) + r"))?|worker-\d{1,4}")
# What a shard's manifest may name as a file: a plain name in the shard's own directory.
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HASH_CHUNK = 1024 * 1024


class ShardError(Exception):
    """Shards can't be built, or a shard directory is missing, corrupted, or not the one expected."""


@dataclass(frozen=True)
class Role:
    """One process's share of the model: ``main``, ``shadow``, or ``worker`` ``worker``.

    A shadow with a ``shadow_dtype`` is the shadow's model already converted to that dtype
    (``inference.shadow.shadow_model``): what a deployment with that shadow dtype downloads.
    """

    role: str
    worker: int | None = None
    shadow_dtype: str | None = None

    @property
    def dirname(self) -> str:
        if self.shadow_dtype is not None:
            return f"shadow-{self.shadow_dtype}"
        return self.role if self.worker is None else f"worker-{self.worker}"


@dataclass(frozen=True)
class StoredTensor:
    """How a worker shard stores one tensor coded: a flat ``U8`` tensor of ``stored_bytes`` that
    decodes (``codec``) to ``raw_bytes`` of ``dtype`` (a safetensors dtype name) in ``shape``."""

    codec: str
    dtype: str
    shape: tuple[int, ...]
    raw_bytes: int
    stored_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
        }


def stored_tensors(manifest: dict[str, Any], where: str = "shard manifest") -> dict[str, StoredTensor]:
    """The tensors a manifest says are stored coded, checked: ``ShardError`` names a bad entry."""
    table = manifest.get("stored") or {}
    if not isinstance(table, dict):
        raise ShardError(f"{where}: 'stored' must map tensor names to their codes")
    return {name: _stored_entry(where, name, entry) for name, entry in table.items()}


def expert_codec_of(manifest: dict[str, Any], where: str = "shard manifest") -> str:
    """The expert codec (``EXPERT_CODECS``) a shard's manifest says its experts are stored with: "none"
    when it lists no coded tensor, else the codec of the one code they are stored with
    (``EXPERT_CODEC_OF_CODE``). ``ShardError`` for an entry this version does not read."""
    codes = {entry.codec for entry in stored_tensors(manifest, where).values()}
    if not codes:
        return "none"
    if len(codes) > 1:
        raise ShardError(f"{where}: its tensors are stored with several codes ({', '.join(sorted(codes))})")
    return EXPERT_CODEC_OF_CODE[codes.pop()]


def _stored_entry(where: str, name: Any, entry: Any) -> StoredTensor:
    bad = f"{where}: stored tensor {name!r}"
    if not isinstance(name, str) or not isinstance(entry, dict):
        raise ShardError(f"{bad} has a malformed entry")
    codec, dtype, shape = entry.get("codec"), entry.get("dtype"), entry.get("shape")
    raw, stored = entry.get("raw_bytes"), entry.get("stored_bytes")
    if codec not in EXPERT_CODEC_OF_CODE:
        raise ShardError(f"{bad} has code {codec!r}; this version reads {', '.join(map(repr, EXPERT_CODEC_OF_CODE))}")
    if dtype not in CODED_DTYPE_BYTES:
        raise ShardError(f"{bad} has dtype {dtype!r}; coded tensors are {', '.join(CODED_DTYPE_BYTES)}")
    # type(...) is int: a JSON true is a bool, which isinstance(..., int) would let through.
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ShardError(f"{bad} has a malformed shape {shape!r}")
    if not (type(raw) is int and type(stored) is int and stored > 0):
        raise ShardError(f"{bad} has malformed sizes {raw!r} / {stored!r}")
    numel = 1
    for d in shape:
        numel *= d
    if raw != numel * CODED_DTYPE_BYTES[dtype]:
        raise ShardError(f"{bad}: {raw} raw bytes do not fit a {dtype} tensor of shape {shape}")
    return StoredTensor(codec, dtype, tuple(shape), raw, stored)


@dataclass(frozen=True)
class ShardSet:
    """A built set of role shards (what ``shards.json`` describes)."""

    root: Path
    placement: Placement
    model: dict[str, Any]
    shadow_dtypes: tuple[str, ...] = ()  # the pre-converted shadows built beside the full one
    expert_codec: str = "none"  # how the worker shards store their experts (EXPERT_CODECS)

    @property
    def main(self) -> Path:
        return self.root / "main"

    @property
    def shadow(self) -> Path:
        return self.root / "shadow"

    def shadow_for(self, dtype: str) -> Path:
        """The shadow shard to run a ``dtype`` shadow from: pre-converted if built, else the full one."""
        return self.root / Role("shadow", shadow_dtype=dtype).dirname if dtype in self.shadow_dtypes else self.shadow

    def worker(self, index: int) -> Path:
        if not 0 <= index < self.placement.n_workers:
            raise ShardError(f"worker {index} is not in this shard set ({self.placement.n_workers} workers)")
        return self.root / f"worker-{index}"

    def roles(self) -> list[Role]:
        return shard_roles(self.placement.n_workers, self.shadow_dtypes)

    @classmethod
    def load(cls, root: str | os.PathLike[str]) -> ShardSet:
        """Read ``root/shards.json`` (the role directories themselves are checked by ``verify_shard``)."""
        root = Path(root)
        data = _read_json(root / SET_FILE, "shard set index")
        if not isinstance(data, dict) or data.get("format") != SET_FORMAT:
            found = data.get("format") if isinstance(data, dict) else None
            raise ShardError(f"{root / SET_FILE}: format is {found!r}, expected {SET_FORMAT!r}")
        try:
            dtypes = tuple(str(d) for d in data.get("shadow_dtypes", []))
            codec = data.get("expert_codec", "none")
            if codec not in EXPERT_CODECS:
                raise ValueError(f"expert_codec {codec!r} is not one of {', '.join(EXPERT_CODECS)}")
            return cls(root, placement_from_dict(data["placement"]), dict(data["model"]), dtypes, codec)
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardError(f"{root / SET_FILE}: malformed shard set index ({exc!r})") from exc


def shard_roles(workers: int, shadow_dtypes: Sequence[str] = ()) -> list[Role]:
    """The roles of a set with ``workers`` workers and these pre-converted shadows, in build order."""
    shadows = [Role("shadow"), *(Role("shadow", shadow_dtype=d) for d in shadow_dtypes)]
    return [Role("main"), *shadows, *(Role("worker", i) for i in range(workers))]


def shadow_dtypes_to_build(config: dict[str, Any], shadow_dtype: str) -> tuple[str, ...]:
    """The pre-converted shadow shard a ``shadow_dtype`` shadow needs: none in the checkpoint's own dtype."""
    own = OWN_SHADOW_DTYPE.get(config.get("dtype") or config.get("torch_dtype"))
    return () if shadow_dtype == own else (shadow_dtype,)


def is_role_dirname(name: str) -> bool:
    """Whether ``name`` is a role shard's directory name (main, shadow, shadow-nf4, worker-3...)."""
    return isinstance(name, str) and _ROLE_DIR_RE.fullmatch(name) is not None


def is_plain_file_name(name: str) -> bool:
    """Whether ``name`` may be a shard file: no directories, no ``..``, nothing hidden."""
    return isinstance(name, str) and _FILE_NAME_RE.fullmatch(name) is not None and ".." not in name


# -- verifying and loading -------------------------------------------------------------


def verify_shard(
    role_dir: str | os.PathLike[str],
    *,
    expect_role: str | None = None,
    expect_worker: int | None = None,
) -> dict[str, Any]:
    """Check ``role_dir`` against its manifest and return the manifest.

    Cheap checks (identity, presence and size of every file, no unlisted weights) run
    before any file is hashed, so the common failures are reported at once.
    """
    directory = Path(role_dir)
    manifest = read_manifest(directory)
    _check_identity(directory, manifest, expect_role, expect_worker)
    entries = [_file_entry(directory, entry) for entry in manifest["files"]]
    listed = {path for path, _, _ in entries}
    unlisted = sorted(p.name for p in directory.glob("*.safetensors") if p.name not in listed)
    if unlisted:
        raise ShardError(
            f"shard {directory}: weights file {unlisted[0]} is not listed in {MANIFEST_FILE}; "
            "the directory mixes files from different builds — fetch or build it again"
        )
    for path, size, _ in entries:
        file = directory / path
        if not file.is_file():
            raise ShardError(f"shard {directory}: file {path} listed in {MANIFEST_FILE} is missing")
        actual = file.stat().st_size
        if actual != size:
            raise ShardError(
                f"shard {directory}: file {path} size mismatch: expected {size} bytes, got {actual}; "
                "the file is truncated or was modified — fetch or build it again"
            )
    for path, _, digest in entries:
        actual_digest = file_sha256(directory / path)
        if actual_digest != digest:
            raise ShardError(
                f"shard {directory}: file {path} sha256 mismatch: expected {digest}, got {actual_digest}; "
                "the shard is corrupted — fetch or build it again"
            )
    return manifest


def load_role_tensors(
    role_dir: str | os.PathLike[str],
    keys: Iterable[str] | None = None,
    *,
    verify: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from a role shard, one tensor at a time.

    With ``keys``, only those (all must be present, or ``ShardError``). The shard is
    verified first (now, not at the first ``next``) unless ``verify=False`` because the
    caller just ran ``verify_shard`` itself.
    """
    directory = Path(role_dir)
    manifest = verify_shard(directory) if verify else read_manifest(directory)
    parts = [
        entry["path"]
        for entry in manifest["files"]
        if entry["path"].endswith(".safetensors") and entry["path"] not in MAIN_EXTRAS  # weights, not tables
    ]
    wanted = None if keys is None else set(keys)
    return _iter_parts(directory, sorted(parts), wanted, stored_tensors(manifest, f"shard {directory}"))


def role_experts(manifest: dict[str, Any]) -> list[LayerExpert]:
    """The (layer, expert) pairs a worker manifest says its shard holds."""
    return [(int(layer), int(expert)) for layer, expert in manifest.get("experts") or []]


def _iter_parts(
    directory: Path, parts: list[str], wanted: set[str] | None, stored: dict[str, StoredTensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    # Plain reads, not safe_open's memory map: a role's resident memory is then what it keeps
    # (see inference.modelio.tensorfile), not every page of every part it has read.
    from inference.modelio.tensorfile import TensorFileError, iter_tensors  # torch: only a role reads tensors

    found: set[str] = set()
    for part in parts:
        file = directory / part
        try:
            for name, tensor in iter_tensors(file, wanted):
                found.add(name)
                yield name, (_decoded(directory, name, tensor, stored[name]) if name in stored else tensor)
        except (TensorFileError, OSError) as exc:  # a ShardError (a bad coded tensor) passes through
            raise ShardError(f"shard {directory}: cannot read {part}: {exc}") from exc
    if wanted is not None and wanted - found:
        missing = sorted(wanted - found)
        raise ShardError(f"shard {directory} lacks {len(missing)} requested tensor(s), e.g. {missing[0]!r}")


def _decoded(directory: Path, name: str, blob: torch.Tensor, entry: StoredTensor) -> torch.Tensor:
    """A coded tensor as its manifest says it decodes (numpy, zstandard, torch: only a role decodes)."""
    import torch

    from inference.modelio.expert_codec import CodecError, decode
    from inference.modelio.tensorfile import DTYPES

    if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() != entry.stored_bytes:
        raise ShardError(f"shard {directory}: stored tensor {name!r} is not the {entry.stored_bytes} bytes listed")
    try:
        raw = decode(blob.numpy(), entry.dtype, entry.raw_bytes, code=entry.codec)
    except CodecError as exc:
        raise ShardError(f"shard {directory}: stored tensor {name!r} does not decode: {exc}") from None
    return torch.from_numpy(raw).view(DTYPES[entry.dtype]).reshape(entry.shape)


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A role directory's manifest, checked for shape only (``verify_shard`` checks the files)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ShardError(f"shard directory {directory} does not exist")
    manifest = _read_json(directory / MANIFEST_FILE, "shard manifest")
    if not isinstance(manifest, dict):
        raise ShardError(f"shard manifest {directory / MANIFEST_FILE} must be a JSON object")
    if manifest.get("format") != SHARD_FORMAT:
        raise ShardError(
            f"shard manifest {directory / MANIFEST_FILE}: format is {manifest.get('format')!r}, "
            f"expected {SHARD_FORMAT!r}; rebuild the shards with this version"
        )
    if not isinstance(manifest.get("files"), list):
        raise ShardError(f"shard manifest {directory / MANIFEST_FILE} has no 'files' list")
    return manifest


def _check_identity(
    directory: Path, manifest: dict[str, Any], expect_role: str | None, expect_worker: int | None
) -> None:
    role, worker = manifest.get("role"), manifest.get("worker")
    where = f"shard {directory}"
    if role not in ROLES:
        raise ShardError(f"{where}: manifest role is {role!r}, expected one of {ROLES}")
    if (role == "worker") != isinstance(worker, int):
        raise ShardError(f"{where}: manifest role {role!r} does not fit worker {worker!r}")
    if expect_role is not None and role != expect_role:
        raise ShardError(f"{where} is a {role!r} shard, expected a {expect_role!r} shard")
    shadow_dtype = manifest.get("shadow_dtype")
    if shadow_dtype is not None and (role != "shadow" or shadow_dtype not in SHADOW_DTYPES):
        raise ShardError(f"{where}: manifest shadow_dtype {shadow_dtype!r} does not fit role {role!r}")
    if expect_worker is not None and worker != expect_worker:
        raise ShardError(f"{where} belongs to worker {worker!r}, expected worker {expect_worker}")
    if role == "worker":
        # The expert list must be what the placement gives this worker, or main would
        # send it experts it doesn't have.
        try:
            owned = sorted(placement_from_dict(manifest["placement"]).owned(worker))
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardError(f"{where}: manifest placement is malformed ({exc!r})") from exc
        if role_experts(manifest) != owned:
            raise ShardError(f"{where}: manifest experts do not match the placement for worker {worker}")


def _file_entry(directory: Path, entry: Any) -> tuple[str, int, str]:
    """Validate one manifest file entry; return (relative path, size, sha256)."""
    if not isinstance(entry, dict):
        raise ShardError(f"shard manifest {directory / MANIFEST_FILE}: bad file entry {entry!r}")
    path, size, digest = entry.get("path"), entry.get("size"), entry.get("sha256")
    ok_path = is_plain_file_name(path)
    ok_digest = isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest) is not None
    if not (ok_path and isinstance(size, int) and ok_digest) or path == MANIFEST_FILE:
        raise ShardError(f"shard manifest {directory / MANIFEST_FILE}: bad file entry {entry!r}")
    return path, size, digest


# -- small helpers ----------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in chunks (never whole into memory)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# Alike checkpoint.py's _read_json by domain, on purpose: each module reads with its own error.
def _read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ShardError(
            f"{what} {path} is missing; is {path.parent} a shard built by 'python -m inference shard'?"
        ) from None
    except OSError as exc:
        raise ShardError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ShardError(f"{what} {path} is not valid JSON ({exc}); fetch or build the shard again") from exc


__all__ = [
    "MANIFEST_FILE",
    "RECORDS_FORMAT",
    "ROLES",
    "SET_FILE",
    "SET_FORMAT",
    "SHARD_FORMAT",
    "Role",
    "ShardError",
    "ShardSet",
    "StoredTensor",
    "file_sha256",
    "is_plain_file_name",
    "is_role_dirname",
    "load_role_tensors",
    "read_manifest",
    "role_experts",
    "shadow_dtypes_to_build",
    "shard_roles",
    "stored_tensors",
    "verify_shard",
]
