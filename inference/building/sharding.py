"""Split an MoE checkpoint (any supported family) into per-role shards.

Each process of a deployment needs only part of the model: *main* everything except the
expert weights (routers included), the *shadow* the whole model (converted to its dtype
as it loads, or already converted here: ``shadow_dtypes``), and worker ``i`` the experts
that ``placement(...).owned(i)`` assigns it.
``build_shards`` writes one directory per role so that each machine copies only its own
share. It reads the source one tensor at a time and writes each role's weights in parts
of bounded size, buffering one part at a time, so memory stays around ``max_file_bytes``
whatever the model's size.

Every role directory carries a ``manifest.json`` with the size and SHA-256 of each of its
files; reading and checking a shard (``verify_shard``, ``load_role_tensors``) is
``inference.modelio.shards``, which the roles, the agent and the control plane use without this module.

Layout::

    out_dir/shards.json          the set: model summary, placement, roles and their dirs
    out_dir/main/                manifest.json, config + tokenizer files, part-00001.safetensors, ...
    out_dir/shadow/              same, with every tensor
    out_dir/shadow-{dtype}/      the shadow's model converted to dtype (inference.shadow.shadow_model's records)
    out_dir/worker-{i}/          manifest.json, config.json, parts with the owned experts

Importing this module does not import torch: the control plane's web and Celery processes
read manifests and shard names from it; only the functions that write or read tensors
(a shard build, a role loading its shard) import torch, when they run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference.building.tensor_sizes import checkpoint_tensors, shadow_weight_bytes
from inference.constants import EXPERT_CODECS, MAIN_EXTRAS, SHADOW_DTYPES
from inference.modelio.checkpoint import (
    CONFIG_FILE,
    EXPERT_PROJS,
    Checkpoint,
    CheckpointError,
    expert_key_name,
    is_expert_key,
)
from inference.modelio.shards import (
    MANIFEST_FILE,
    RECORDS_FORMAT,
    SET_FILE,
    SET_FORMAT,
    SHARD_FORMAT,
    Role,
    ShardError,
    ShardSet,
    StoredTensor,
    file_sha256,
    is_role_dirname,
    shard_roles,
)
from inference.policies.placement import Placement, placement

if TYPE_CHECKING:
    import torch

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
# A safetensors header holds a JSON entry per tensor (name, dtype, shape, offsets) plus
# a little framing; counting it keeps every part within max_file_bytes.
_HEADER_BASE_BYTES = 128
_HEADER_ENTRY_BYTES = 128

ProgressFn = Callable[[int, int], None]


# -- building -------------------------------------------------------------------------


def build_shards(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    workers: int,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    progress: ProgressFn | None = None,
    shadow_dtypes: Sequence[str] = (),
    expert_codec: str = "none",
) -> ShardSet:
    """Write the main, shadow and worker shards of the checkpoint in ``model_dir``.

    ``out_dir`` must be new, empty, or a shard set built earlier (which is replaced);
    anything else is refused and nothing is deleted. ``progress(done, total)`` is
    called with tensor bytes read so far, ending at ``done == total``. Each of
    ``shadow_dtypes`` also gets a shadow shard converted to it once, here (``shadow-nf4``...):
    a shadow box then downloads 26 GB of nf4 instead of the 93 GB of a bf16 Mixtral-8x7B,
    and starts without converting anything. ``expert_codec`` (``EXPERT_CODECS``) is how the worker
    shards store their experts: ``"exponent-plane"`` writes each one coded, lossless
    (``inference.modelio.expert_codec``), and lists it in the manifest's ``stored``.
    """
    if expert_codec not in EXPERT_CODECS:
        raise ShardError(f"unknown expert codec {expert_codec!r}; allowed: {', '.join(EXPERT_CODECS)}")
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
        role_keys = {role: keys_for_role(ckpt, plan, role) for role in shard_roles(workers, shadow_dtypes)}
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
            codec = expert_codec if role.role == "worker" else "none"
            _build_role(ckpt, plan, role, keys, out / role.dirname, max_file_bytes, report, codec)
    except CheckpointError as exc:
        raise ShardError(f"cannot shard {model_dir}: {exc}") from exc
    report.finish()
    # Written last: a directory without shards.json is an interrupted build.
    shard_set = ShardSet(out, plan, _model_summary(ckpt), shadow_dtypes, expert_codec)
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
    shard_set = ShardSet(
        shard_set.root,
        shard_set.placement,
        shard_set.model,
        (*shard_set.shadow_dtypes, *missing),
        shard_set.expert_codec,
    )
    _write_json_atomic(shard_set.root / SET_FILE, _set_index(shard_set))
    return shard_set


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
    return shadow_weight_bytes(checkpoint_tensors(ckpt), role.shadow_dtype)


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
    expert_codec: str = "none",
) -> None:
    directory.mkdir()
    writer = _PartWriter(directory, max_file_bytes)
    stored: dict[str, StoredTensor] = {}

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in ckpt.iter_tensors(keys):
            report.add(tensor.numel() * tensor.element_size())
            yield name, tensor

    records: Iterable[tuple[str, torch.Tensor]] = read()
    if role.shadow_dtype is not None:
        import torch

        # Transformers (the model skeleton): kept out of the processes that import this module for
        # its names (the control plane's web process), loaded only by a build that converts.
        from inference.shadow.shadow_model import convert_tensors

        records = convert_tensors(records, ckpt.hf_config(), role.shadow_dtype, torch.device("cpu"))
    if expert_codec != "none":
        records = _coded(records, stored)
    for name, tensor in records:
        writer.add(name, tensor)
    writer.flush()
    extras = (CONFIG_FILE,) if role.role == "worker" else (CONFIG_FILE, *TOKENIZER_FILES)
    if role.role == "main":
        extras = (*extras, *MAIN_EXTRAS)  # the approximate strategies' tables and heads, where made
    for name in extras:
        if (ckpt.path / name).is_file():
            shutil.copyfile(ckpt.path / name, directory / name)
    _write_json_atomic(directory / MANIFEST_FILE, _manifest(directory, role, plan, stored))


def _coded(
    records: Iterable[tuple[str, torch.Tensor]], stored: dict[str, StoredTensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each expert tensor of ``records`` as its coded bytes (a flat uint8 tensor), noted in ``stored``;
    any other tensor, or one of a dtype the code does not take, as it is."""
    import torch

    from inference.modelio.expert_codec import PALETTE_CODE, encode, supports
    from inference.modelio.tensorfile import DTYPES

    names = {dtype: name for name, dtype in DTYPES.items()}
    for name, tensor in records:
        dtype = names.get(tensor.dtype, "")
        if not (is_expert_key(name) and supports(dtype)):
            yield name, tensor
            continue
        raw = tensor.contiguous().view(torch.uint8).numpy().reshape(-1)
        blob = encode(raw, dtype)
        stored[name] = StoredTensor(PALETTE_CODE, dtype, tuple(tensor.shape), raw.size, len(blob))
        yield name, torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _manifest(directory: Path, role: Role, plan: Placement, stored: dict[str, StoredTensor]) -> dict[str, Any]:
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
        manifest["records"] = RECORDS_FORMAT  # how the converted tensors are laid out and quantized
    if stored:
        manifest["stored"] = {name: entry.to_dict() for name, entry in sorted(stored.items())}
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
        "expert_codec": shard_set.expert_codec,
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


def _is_ours(entry: Path) -> bool:
    """Whether ``entry`` is something ``build_shards`` writes (so replacing it loses nothing)."""
    if entry.is_symlink():
        return False
    if entry.is_file():
        return entry.name in (SET_FILE, SET_FILE + ".tmp")
    if not (entry.is_dir() and is_role_dirname(entry.name)):
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


# -- small helpers ----------------------------------------------------------------------


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    # Write-then-rename, so a crash never leaves a half-written manifest that parses.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "add_shadow_shards",
    "build_shards",
    "keys_for_role",
]
