"""Split an MoE checkpoint (any supported family) into per-role shards.

Each process of a deployment needs only part of the model: *main* everything except the
expert weights (routers included), the *shadow* the whole model (converted to its dtype
as it loads, or already converted here: ``shadow_dtypes``), and worker ``i`` the experts
that ``placement(...).owned(i)`` assigns it.
``build_shards`` writes one directory per role so that each machine copies only its own
share, in three steps, each a module of its own: the build is planned whole from the
checkpoint's headers (``shard_plan``: placement, each role's tensors and bytes), checked
against the free disk before anything is deleted, then written in one pass over the
checkpoint (``shard_pass``: read one tensor at a time, coded or converted where planned) into
each role's files (``shard_writer``: parts of bounded size, buffering one at a time, so memory
stays around ``max_file_bytes`` whatever the model's size). This module holds the steps'
order and the output directory's checks.

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

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from inference.building.shard_pass import ProgressFn, write_plan
from inference.building.shard_plan import ShardPlan, plan_shadow_shards, plan_shards
from inference.building.shard_writer import DEFAULT_MAX_FILE_BYTES, PART_RE, TOKENIZER_FILES
from inference.constants import EXPERT_CODECS, MAIN_EXTRAS, SHADOW_DTYPES
from inference.modelio.checkpoint import CONFIG_FILE, Checkpoint, CheckpointError
from inference.modelio.shards import MANIFEST_FILE, SET_FILE, ShardError, ShardSet, is_role_dirname


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
    The build is planned whole (``shard_plan``) and checked against the free disk before
    anything is deleted or written.
    """
    if expert_codec not in EXPERT_CODECS:
        raise ShardError(f"unknown expert codec {expert_codec!r}; allowed: {', '.join(EXPERT_CODECS)}")
    if workers < 1:
        raise ShardError(f"at least one worker is needed, got workers={workers}")
    _check_shadow_dtypes(shadow_dtypes)
    if max_file_bytes < 1:
        raise ShardError(f"max_file_bytes must be positive, got {max_file_bytes}")
    out = Path(out_dir)
    replaced = _check_out_dir(out)
    try:
        ckpt = Checkpoint(model_dir)
        plan = plan_shards(ckpt, out, workers, tuple(dict.fromkeys(shadow_dtypes)), expert_codec)
    except (CheckpointError, ValueError) as exc:
        raise ShardError(f"cannot shard {model_dir}: {exc}") from exc
    _check_free_space(out, plan, replaced)
    _clear_out_dir(out)
    _write(ckpt, plan, max_file_bytes, progress)
    return plan.shard_set()


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
    _check_shadow_dtypes(shadow_dtypes)
    missing = [d for d in dict.fromkeys(shadow_dtypes) if d not in shard_set.shadow_dtypes]
    if not missing:
        return shard_set
    try:
        ckpt = Checkpoint(model_dir)
        plan = plan_shadow_shards(ckpt, shard_set, missing)
    except (CheckpointError, ValueError) as exc:
        raise ShardError(f"cannot shard {model_dir}: {exc}") from exc
    half_written = [share.directory for share in plan.shares if share.directory.exists()]
    _check_free_space(shard_set.root, plan, sum(_tree_bytes(directory) for directory in half_written))
    for directory in half_written:
        shutil.rmtree(directory)
    _write(ckpt, plan, max_file_bytes, progress)
    return plan.shard_set()


def _check_shadow_dtypes(shadow_dtypes: Sequence[str]) -> None:
    unknown = [d for d in shadow_dtypes if d not in SHADOW_DTYPES]
    if unknown:
        raise ShardError(f"unknown shadow dtype {unknown[0]!r}; allowed: {', '.join(SHADOW_DTYPES)}")


def _write(ckpt: Checkpoint, plan: ShardPlan, max_file_bytes: int, progress: ProgressFn | None) -> None:
    try:
        write_plan(ckpt, plan, max_file_bytes, progress)
    except CheckpointError as exc:
        raise ShardError(f"cannot shard {ckpt.path}: {exc}") from exc


def _check_out_dir(out: Path) -> int:
    """Refuses an ``out`` that is not a directory, or holds anything but a shard set built
    earlier; the bytes of that set, which the build replaces."""
    if out.exists() and not out.is_dir():
        raise ShardError(f"output path {out} exists and is not a directory")
    if not out.exists():
        return 0
    entries = sorted(out.iterdir())
    foreign = [entry.name for entry in entries if not _is_ours(entry)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ShardError(
            f"output directory {out} is not empty and is not a shard set (it contains {shown}); "
            "choose a new or empty directory. Nothing was deleted."
        )
    return sum(_tree_bytes(entry) for entry in entries)


def _clear_out_dir(out: Path) -> None:
    """Make ``out`` an empty directory (``_check_out_dir`` found nothing in it but a shard set)."""
    out.mkdir(parents=True, exist_ok=True)
    for entry in sorted(out.iterdir()):
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
    ours = {MANIFEST_FILE, MANIFEST_FILE + ".tmp", CONFIG_FILE, *TOKENIZER_FILES, *MAIN_EXTRAS}
    return all(
        child.is_file() and not child.is_symlink() and (child.name in ours or PART_RE.fullmatch(child.name))
        for child in entry.iterdir()
    )


def _check_free_space(out: Path, plan: ShardPlan, replaced: int) -> None:
    """Refuses a build whose shards would not fit ``out``'s disk, counting the ``replaced`` bytes
    it deletes first as free."""
    existing = next(path for path in (out, *out.parents) if path.exists())
    free = shutil.disk_usage(existing).free + replaced
    if free < plan.written_bytes:
        raise ShardError(
            f"not enough disk space in {out}: the shards need {plan.written_bytes / 1e9:.1f} GB, "
            f"{free / 1e9:.1f} GB are free (counting the {replaced / 1e9:.1f} GB the build replaces). "
            "Nothing was deleted."
        )


def _tree_bytes(path: Path) -> int:
    """The bytes of the files at or under ``path``."""
    if path.is_file():
        return path.stat().st_size
    return sum(child.stat().st_size for child in path.rglob("*") if child.is_file())


__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "add_shadow_shards",
    "build_shards",
]
