"""Split an MoE checkpoint (any supported family) into per-role shards, and check shards before they are used.

Each process of a deployment needs only part of the model: *main* everything except the
expert weights (routers included), the *shadow* the whole model (converted to its dtype
as it loads, or already converted here: ``shadow_dtypes``), and worker ``i`` the experts
that ``placement(...).owned(i)`` assigns it.
``build_shards`` writes one directory per role so that each machine copies only its own
share. It reads the source one tensor at a time and writes each role's weights in parts
of bounded size, buffering one part at a time, so memory stays around ``max_file_bytes``
whatever the model's size.

Every role directory carries a ``manifest.json`` with the size and SHA-256 of each of its
files; ``verify_shard`` refuses a directory that doesn't match it, because a
half-copied expert would otherwise silently produce wrong tokens.

Layout::

    out_dir/shards.json          the set: model summary, placement, roles and their dirs
    out_dir/main/                manifest.json, config + tokenizer files, part-00001.safetensors, ...
    out_dir/shadow/              same, with every tensor
    out_dir/shadow-{dtype}/      the shadow's model converted to dtype (inference.shadow_model's records)
    out_dir/worker-{i}/          manifest.json, config.json, parts with the owned experts

Importing this module does not import torch: the control plane's web and Celery processes
read manifests and shard names from it; only the functions that write or read tensors
(a shard build, a role loading its shard) import torch, when they run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference.checkpoint import (
    CONFIG_FILE,
    EXPERT_PROJS,
    Checkpoint,
    CheckpointError,
    expert_key_name,
    is_expert_key,
)
from inference.constants import MAIN_EXTRAS, OWN_SHADOW_DTYPE, SHADOW_DTYPES
from inference.placement import LayerExpert, Placement, placement, placement_from_dict

if TYPE_CHECKING:
    import torch

SHARD_FORMAT = "odmoe-shard/1"
SET_FORMAT = "odmoe-shards/1"
MANIFEST_FILE = "manifest.json"
SET_FILE = "shards.json"
ROLES = ("main", "shadow", "worker")
DEFAULT_MAX_FILE_BYTES = 2 * 1024**3

# main and the shadow tokenize and generate; workers only need the model shape.
TOKENIZER_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)

_PART_RE = re.compile(r"part-\d{5}\.safetensors")
_ROLE_DIR_RE = re.compile(r"main|shadow(-(" + "|".join(SHADOW_DTYPES) + r"))?|worker-\d{1,4}")
# What a shard's manifest may name as a file: a plain name in the shard's own directory.
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HASH_CHUNK = 1024 * 1024
# A safetensors header holds a JSON entry per tensor (name, dtype, shape, offsets) plus
# a little framing; counting it keeps every part within max_file_bytes.
_HEADER_BASE_BYTES = 128
_HEADER_ENTRY_BYTES = 128

ProgressFn = Callable[[int, int], None]


class ShardError(Exception):
    """Shards can't be built, or a shard directory is missing, corrupted, or not the one expected."""


@dataclass(frozen=True)
class Role:
    """One process's share of the model: ``main``, ``shadow``, or ``worker`` ``worker``.

    A shadow with a ``shadow_dtype`` is the shadow's model already converted to that dtype
    (``inference.shadow_model``): what a deployment with that shadow dtype downloads.
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
class ShardSet:
    """A built set of role shards (what ``shards.json`` describes)."""

    root: Path
    placement: Placement
    model: dict[str, Any]
    shadow_dtypes: tuple[str, ...] = ()  # the pre-converted shadows built beside the full one

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
        return _roles(self.placement.n_workers, self.shadow_dtypes)

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
            return cls(root, placement_from_dict(data["placement"]), dict(data["model"]), dtypes)
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardError(f"{root / SET_FILE}: malformed shard set index ({exc!r})") from exc


# -- building -------------------------------------------------------------------------


def build_shards(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    workers: int,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    progress: ProgressFn | None = None,
    shadow_dtypes: Sequence[str] = (),
) -> ShardSet:
    """Write the main, shadow and worker shards of the checkpoint in ``model_dir``.

    ``out_dir`` must be new, empty, or a shard set built earlier (which is replaced);
    anything else is refused and nothing is deleted. ``progress(done, total)`` is
    called with tensor bytes read so far, ending at ``done == total``. Each of
    ``shadow_dtypes`` also gets a shadow shard converted to it once, here (``shadow-nf4``...):
    a shadow box then downloads 26 GB of nf4 instead of the 93 GB of a bf16 Mixtral-8x7B,
    and starts without converting anything.
    """
    if workers < 1:
        raise ShardError(f"at least one worker is needed, got workers={workers}")
    unknown = [d for d in shadow_dtypes if d not in SHADOW_DTYPES]
    if unknown:
        raise ShardError(f"unknown shadow dtype {unknown[0]!r}; allowed: {', '.join(SHADOW_DTYPES)}")
    shadow_dtypes = tuple(dict.fromkeys(shadow_dtypes))
    if max_file_bytes < 1:
        raise ShardError(f"max_file_bytes must be positive, got {max_file_bytes}")
    out = Path(out_dir)
    try:
        ckpt = Checkpoint(model_dir)
        plan = placement(ckpt.n_layers, ckpt.n_experts, ckpt.top_k, workers)
        _check_experts_present(ckpt)
        role_keys = {role: keys_for_role(ckpt, plan, role) for role in _roles(workers, shadow_dtypes)}
        # Sizing reads every header, so a damaged source file fails here, before any output.
        total = sum(ckpt.nbytes(key) for keys in role_keys.values() for key in keys)
        written = sum(_role_bytes(ckpt, role, keys) for role, keys in role_keys.items())
    except (CheckpointError, ValueError) as exc:
        raise ShardError(f"cannot shard {model_dir}: {exc}") from exc
    _prepare_out_dir(out)
    _check_free_space(out, written)

    report = _Progress(total, progress)
    try:
        for role, keys in role_keys.items():
            _build_role(ckpt, plan, role, keys, out / role.dirname, max_file_bytes, report)
    except CheckpointError as exc:
        raise ShardError(f"cannot shard {model_dir}: {exc}") from exc
    report.finish()
    # Written last: a directory without shards.json is an interrupted build.
    shard_set = ShardSet(out, plan, _model_summary(ckpt), shadow_dtypes)
    _write_json_atomic(out / SET_FILE, _set_index(shard_set))
    return shard_set


def add_shadow_shards(
    model_dir: str | os.PathLike[str],
    root: str | os.PathLike[str],
    shadow_dtypes: Sequence[str],
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    progress: ProgressFn | None = None,
) -> ShardSet:
    """Add pre-converted shadow shards to the set built at ``root`` (those it lacks).

    A deployment with another shadow dtype needs only its shadow converted, not the whole set
    rebuilt. A half-written ``shadow-{dtype}`` from an interrupted run is replaced; the set's
    index is rewritten last, so it never lists a shard that is not complete.
    """
    shard_set = ShardSet.load(root)
    unknown = [d for d in shadow_dtypes if d not in SHADOW_DTYPES]
    if unknown:
        raise ShardError(f"unknown shadow dtype {unknown[0]!r}; allowed: {', '.join(SHADOW_DTYPES)}")
    missing = [d for d in dict.fromkeys(shadow_dtypes) if d not in shard_set.shadow_dtypes]
    if not missing:
        return shard_set
    try:
        ckpt = Checkpoint(model_dir)
        keys = ckpt.keys()
        total = len(missing) * sum(ckpt.nbytes(key) for key in keys)
        written = sum(_role_bytes(ckpt, Role("shadow", shadow_dtype=d), keys) for d in missing)
    except (CheckpointError, ValueError) as exc:
        raise ShardError(f"cannot shard {model_dir}: {exc}") from exc
    _check_free_space(shard_set.root, written)
    report = _Progress(total, progress)
    for dtype in missing:
        role = Role("shadow", shadow_dtype=dtype)
        directory = shard_set.root / role.dirname
        if directory.exists():
            shutil.rmtree(directory)
        try:
            _build_role(ckpt, shard_set.placement, role, keys, directory, max_file_bytes, report)
        except CheckpointError as exc:
            raise ShardError(f"cannot shard {model_dir}: {exc}") from exc
    report.finish()
    shard_set = ShardSet(shard_set.root, shard_set.placement, shard_set.model, (*shard_set.shadow_dtypes, *missing))
    _write_json_atomic(shard_set.root / SET_FILE, _set_index(shard_set))
    return shard_set


def shadow_dtypes_to_build(config: dict[str, Any], shadow_dtype: str) -> tuple[str, ...]:
    """The pre-converted shadow shard a ``shadow_dtype`` shadow needs: none in the checkpoint's own dtype."""
    own = OWN_SHADOW_DTYPE.get(config.get("dtype") or config.get("torch_dtype"))
    return () if shadow_dtype == own else (shadow_dtype,)


def keys_for_role(ckpt: Checkpoint, plan: Placement, role: Role) -> list[str]:
    """The checkpoint tensor names that ``role``'s shard holds."""
    if role.role == "shadow":
        return ckpt.keys()
    if role.role == "main":
        return [key for key in ckpt if not is_expert_key(key)]
    assert role.worker is not None
    return [
        expert_key_name(layer, expert, proj)
        for layer, expert in sorted(plan.owned(role.worker))
        for proj in EXPERT_PROJS
    ]


def _role_bytes(ckpt: Checkpoint, role: Role, keys: list[str]) -> int:
    """Tensor bytes ``role``'s shard will hold: a converted shadow's in its dtype, the rest as read."""
    if role.shadow_dtype is None:
        return sum(ckpt.nbytes(key) for key in keys)
    from inference.memory import checkpoint_tensors, shadow_weight_bytes  # sizes only; imported when used

    return shadow_weight_bytes(checkpoint_tensors(ckpt), role.shadow_dtype)


def _roles(workers: int, shadow_dtypes: Sequence[str] = ()) -> list[Role]:
    shadows = [Role("shadow"), *(Role("shadow", shadow_dtype=d) for d in shadow_dtypes)]
    return [Role("main"), *shadows, *(Role("worker", i) for i in range(workers))]


def _check_experts_present(ckpt: Checkpoint) -> None:
    # A worker shard silently missing an expert, or holding one of another shape than the
    # config's, would only fail mid-generation.
    want = ckpt.family.projection_shapes(ckpt.config)
    missing = []
    for layer in range(ckpt.n_layers):
        for expert in range(ckpt.n_experts):
            for proj in EXPERT_PROJS:
                key = expert_key_name(layer, expert, proj)
                if key not in ckpt:
                    missing.append((layer, expert, proj))
                elif ckpt.shape(key) != want[proj]:  # a fused tensor's whole shape is checked here too
                    raise CheckpointError(
                        f"expert {expert} of layer {layer}: its {_PROJ_WORDS[proj]} is {list(ckpt.shape(key))}, "
                        f"the config says {list(want[proj])}"
                    )
    if missing:
        layer, expert, proj = missing[0]
        source = ckpt.expert_source(expert_key_name(layer, expert, proj))
        where = f" (looked for {source.name!r})" if source is not None else ""
        raise CheckpointError(
            f"{len(missing)} expert projection(s) are missing, e.g. expert {expert}'s {_PROJ_WORDS[proj]} in "
            f"layer {layer}{where}; expected the {ckpt.family.model_type} release's expert layout"
        )


_PROJ_WORDS = {"w1": "w1 (gate)", "w2": "w2 (down)", "w3": "w3 (up)"}


class _Progress:
    """Counts tensor bytes written and forwards them to the caller's callback."""

    def __init__(self, total: int, callback: ProgressFn | None) -> None:
        self.total, self.done, self._callback = total, 0, callback
        if callback is not None:
            callback(0, total)

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self._callback is not None:
            self._callback(self.done, self.total)

    def finish(self) -> None:
        if self._callback is not None and self.done != self.total:
            self._callback(self.total, self.total)


class _PartWriter:
    """Writes tensors into ``part-NNNNN.safetensors`` files of at most ``max_bytes`` each.

    Only the current part's tensors are held in memory. A tensor larger than the limit
    gets a part of its own (it can't be split without changing its name).
    """

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.files: list[Path] = []
        self._buffer: dict[str, torch.Tensor] = {}
        self._size = _HEADER_BASE_BYTES

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size() + len(name.encode()) + _HEADER_ENTRY_BYTES
        if self._buffer and self._size + size > self.max_bytes:
            self.flush()
        self._buffer[name] = tensor.contiguous()
        self._size += size

    def flush(self) -> None:
        if not self._buffer:
            return
        from safetensors.torch import save_file  # imports torch: only a shard build writes tensors

        path = self.directory / f"part-{len(self.files) + 1:05d}.safetensors"
        save_file(self._buffer, path, metadata={"format": "pt"})
        self.files.append(path)
        self._buffer, self._size = {}, _HEADER_BASE_BYTES


def _build_role(
    ckpt: Checkpoint,
    plan: Placement,
    role: Role,
    keys: list[str],
    directory: Path,
    max_file_bytes: int,
    report: _Progress,
) -> None:
    directory.mkdir()
    writer = _PartWriter(directory, max_file_bytes)

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in ckpt.iter_tensors(keys):
            report.add(tensor.numel() * tensor.element_size())
            yield name, tensor

    records: Iterable[tuple[str, torch.Tensor]] = read()
    if role.shadow_dtype is not None:
        import torch

        from inference.shadow_model import convert_tensors  # needs transformers: imported when used

        records = convert_tensors(records, ckpt.hf_config(), role.shadow_dtype, torch.device("cpu"))
    for name, tensor in records:
        writer.add(name, tensor)
    writer.flush()
    extras = (CONFIG_FILE,) if role.role == "worker" else (CONFIG_FILE, *TOKENIZER_FILES)
    if role.role == "main":
        extras = (*extras, *MAIN_EXTRAS)  # the approximate strategies' tables and heads, where made
    for name in extras:
        if (ckpt.path / name).is_file():
            shutil.copyfile(ckpt.path / name, directory / name)
    _write_json_atomic(directory / MANIFEST_FILE, _manifest(directory, role, plan))


def _manifest(directory: Path, role: Role, plan: Placement) -> dict[str, Any]:
    experts = sorted(plan.owned(role.worker)) if role.worker is not None else None
    files = [
        {"path": path.name, "size": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(directory.iterdir())
        if path.name != MANIFEST_FILE
    ]
    manifest = {
        "format": SHARD_FORMAT,
        "role": role.role,
        "worker": role.worker,
        "shadow_dtype": role.shadow_dtype,
        "placement": plan.to_dict(),
        "experts": [list(pair) for pair in experts] if experts is not None else None,
        "files": files,
    }
    if role.shadow_dtype is not None:
        from inference.shadow_model import RECORDS_FORMAT

        manifest["records"] = RECORDS_FORMAT  # how the converted tensors are laid out and quantized
    return manifest


def _model_summary(ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "model_type": ckpt.config.get("model_type"),
        "layers": ckpt.n_layers,
        "experts": ckpt.n_experts,
        "top_k": ckpt.top_k,
        "hidden": ckpt.hidden_size,
    }


def _set_index(shard_set: ShardSet) -> dict[str, Any]:
    return {
        "format": SET_FORMAT,
        "model": shard_set.model,
        "placement": shard_set.placement.to_dict(),
        "shadow_dtypes": list(shard_set.shadow_dtypes),
        "roles": [{"role": role.role, "worker": role.worker, "dir": role.dirname} for role in shard_set.roles()],
    }


def _prepare_out_dir(out: Path) -> None:
    """Make ``out`` an empty directory, clearing a previous shard set but nothing else."""
    if out.exists() and not out.is_dir():
        raise ShardError(f"output path {out} exists and is not a directory")
    if not out.exists():
        out.mkdir(parents=True)
        return
    entries = sorted(out.iterdir())
    foreign = [entry.name for entry in entries if not _is_ours(entry)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ShardError(
            f"output directory {out} is not empty and is not a shard set (it contains {shown}); "
            "choose a new or empty directory. Nothing was deleted."
        )
    for entry in entries:
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def is_role_dirname(name: str) -> bool:
    """Whether ``name`` is a role shard's directory name (main, shadow, shadow-nf4, worker-3...)."""
    return isinstance(name, str) and _ROLE_DIR_RE.fullmatch(name) is not None


def is_plain_file_name(name: str) -> bool:
    """Whether ``name`` may be a shard file: no directories, no ``..``, nothing hidden."""
    return isinstance(name, str) and _FILE_NAME_RE.fullmatch(name) is not None and ".." not in name


def _is_ours(entry: Path) -> bool:
    """Whether ``entry`` is something ``build_shards`` writes (so replacing it loses nothing)."""
    if entry.is_symlink():
        return False
    if entry.is_file():
        return entry.name in (SET_FILE, SET_FILE + ".tmp")
    if not (entry.is_dir() and _ROLE_DIR_RE.fullmatch(entry.name)):
        return False
    ours = {MANIFEST_FILE, MANIFEST_FILE + ".tmp", CONFIG_FILE, *TOKENIZER_FILES}
    return all(
        child.is_file() and not child.is_symlink() and (child.name in ours or _PART_RE.fullmatch(child.name))
        for child in entry.iterdir()
    )


def _check_free_space(out: Path, needed: int) -> None:
    free = shutil.disk_usage(out).free
    if free < needed:
        raise ShardError(
            f"not enough disk space in {out}: the shards need {needed / 1e9:.1f} GB, {free / 1e9:.1f} GB are free"
        )


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
    return _iter_parts(directory, sorted(parts), wanted)


def role_experts(manifest: dict[str, Any]) -> list[LayerExpert]:
    """The (layer, expert) pairs a worker manifest says its shard holds."""
    return [(int(layer), int(expert)) for layer, expert in manifest.get("experts") or []]


def _iter_parts(directory: Path, parts: list[str], wanted: set[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    # Plain reads, not safe_open's memory map: a role's resident memory is then what it keeps
    # (see inference.tensorfile), not every page of every part it has read.
    from inference.tensorfile import TensorFileError, iter_tensors  # torch: only a role reads tensors

    found: set[str] = set()
    for part in parts:
        file = directory / part
        try:
            for name, tensor in iter_tensors(file, wanted):
                found.add(name)
                yield name, tensor
        except (TensorFileError, OSError) as exc:  # a ShardError can't occur in here
            raise ShardError(f"shard {directory}: cannot read {part}: {exc}") from exc
    if wanted is not None and wanted - found:
        missing = sorted(wanted - found)
        raise ShardError(f"shard {directory} lacks {len(missing)} requested tensor(s), e.g. {missing[0]!r}")


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


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    # Write-then-rename, so a crash never leaves a half-written manifest that parses.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "MANIFEST_FILE",
    "SET_FILE",
    "SET_FORMAT",
    "SHARD_FORMAT",
    "Role",
    "ShardError",
    "ShardSet",
    "add_shadow_shards",
    "build_shards",
    "is_plain_file_name",
    "is_role_dirname",
    "keys_for_role",
    "load_role_tensors",
    "read_manifest",
    "role_experts",
    "shadow_dtypes_to_build",
    "verify_shard",
]
