"""The files of a shard set: each role's parts, extras and manifest, then the set's index.

``write_role`` writes one planned share (``inference.building.shard_plan.RoleShare``) from the
records it is handed, in ``part-NNNNN.safetensors`` files of bounded size, buffering one part at a
time, so memory stays around ``max_file_bytes`` whatever the model's size; then the config and
tokenizer files the role needs, then its ``manifest.json`` (every file's size and SHA-256).
``write_set_index`` writes ``shards.json`` last: a directory without it is an interrupted build.
Reading and checking what is written is ``inference.modelio.shards``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference.building.shard_plan import RoleShare, ShardPlan
from inference.constants import MAIN_EXTRAS
from inference.modelio.checkpoint import CONFIG_FILE
from inference.modelio.shards import (
    MANIFEST_FILE,
    RECORDS_FORMAT,
    SET_FILE,
    SET_FORMAT,
    SHARD_FORMAT,
    StoredTensor,
    file_sha256,
)

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

PART_RE = re.compile(r"part-\d{5}\.safetensors")
# A safetensors header holds a JSON entry per tensor (name, dtype, shape, offsets) plus
# a little framing; counting it keeps every part within max_file_bytes.
_HEADER_BASE_BYTES = 128
_HEADER_ENTRY_BYTES = 128


def write_role(
    plan: ShardPlan,
    share: RoleShare,
    records: Iterable[tuple[str, torch.Tensor]],
    stored: dict[str, StoredTensor],
    source: Path,
    max_file_bytes: int,
) -> None:
    """``share``'s directory, new, with ``records`` in parts, the files it needs from the
    checkpoint at ``source`` and its manifest; ``stored``: how coded records are stored (filled as
    ``records`` are read, so complete when they end)."""
    directory = share.directory
    directory.mkdir()
    writer = _PartWriter(directory, max_file_bytes)
    for name, tensor in records:
        writer.add(name, tensor)
    writer.flush()
    extras = (CONFIG_FILE,) if share.role.role == "worker" else (CONFIG_FILE, *TOKENIZER_FILES)
    if share.role.role == "main":
        extras = (*extras, *MAIN_EXTRAS)  # the approximate strategies' tables and heads, where made
    for name in extras:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)
    write_json_atomic(directory / MANIFEST_FILE, _manifest(plan, share, stored))


def write_set_index(plan: ShardPlan) -> None:
    """The set's ``shards.json``, written once every shard is."""
    index = {
        "format": SET_FORMAT,
        "model": plan.model,
        "placement": plan.placement.to_dict(),
        "shadow_dtypes": list(plan.shadow_dtypes),
        "expert_codec": plan.expert_codec,
        "roles": [{"role": role.role, "worker": role.worker, "dir": role.dirname} for role in plan.roles],
    }
    write_json_atomic(plan.root / SET_FILE, index)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    # Write-then-rename, so a crash never leaves a half-written manifest that parses.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


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


def _manifest(plan: ShardPlan, share: RoleShare, stored: dict[str, StoredTensor]) -> dict[str, Any]:
    role, directory = share.role, share.directory
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
        "placement": plan.placement.to_dict(),
        "experts": [list(pair) for pair in share.experts] if share.experts is not None else None,
        "files": files,
    }
    if role.shadow_dtype is not None:
        manifest["records"] = RECORDS_FORMAT  # how the converted tensors are laid out and quantized
    if stored:
        manifest["stored"] = {name: entry.to_dict() for name, entry in sorted(stored.items())}
    return manifest
