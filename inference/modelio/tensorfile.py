"""Read tensors from a safetensors file with plain reads, one tensor at a time, never mapped.

``safe_open`` memory-maps the whole file, and every page a read touches then counts in the
process's resident set until the file is closed: reading a 2 GB shard part tensor by tensor
makes a role's RSS grow by 2 GB even though it keeps a fraction of it (the shadow keeps a
quantized copy, a worker its fused experts). Here each tensor is read with ``readinto`` into
a buffer of its own, so resident memory is what the caller keeps plus one tensor. The page
cache still holds the file, but it belongs to the kernel, not to the role.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header mapping names to ``dtype``, ``shape`` and ``data_offsets`` relative to
the end of the header, then the data, little-endian, row-major.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# The dtypes our checkpoints and shards hold; anything else is refused by name.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own limit


class TensorFileError(ValueError):
    """The file is not a readable safetensors file; the message names it and says why."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte in the file
    nbytes: int


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorEntry]:
    """Every tensor's entry, from the header alone, in the order of their data in the file."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise TensorFileError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise TensorFileError(f"{path}: header length {length} does not fit the file")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TensorFileError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path}: header is not a JSON object")
    base = 8 + length
    entries = [_entry(path, name, info, base, size) for name, info in header.items() if name != "__metadata__"]
    return {e.name: e for e in sorted(entries, key=lambda e: e.start)}


def iter_tensors(
    path: str | os.PathLike[str], names: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for ``names`` (default: all) in file order, each a fresh buffer."""
    entries = read_header(path)
    wanted = None if names is None else set(names)
    with open(path, "rb", buffering=0) as handle:
        for entry in entries.values():
            if wanted is None or entry.name in wanted:
                yield entry.name, _read(handle, path, entry)


def _read(handle, path: str | os.PathLike[str], entry: TensorEntry) -> torch.Tensor:
    buffer = torch.empty(entry.nbytes, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    handle.seek(entry.start)
    done = 0
    while done < entry.nbytes:
        got = handle.readinto(view[done:])
        if not got:
            raise TensorFileError(f"{path}: file ends inside tensor {entry.name!r}")
        done += got
    return buffer.view(entry.dtype).reshape(entry.shape)


def _entry(path: Path, name: str, info: object, base: int, size: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise TensorFileError(f"{path}: bad header entry for {name!r}")
    name_of_dtype = info.get("dtype")
    dtype = DTYPES.get(name_of_dtype) if isinstance(name_of_dtype, str) else None
    shape, offsets = info.get("shape"), info.get("data_offsets")
    # type(...) is int: a JSON true is a bool, which isinstance(..., int) would let through.
    ok_shape = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
    ok_offsets = isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
    if dtype is None:
        raise TensorFileError(f"{path}: tensor {name!r} has unsupported dtype {name_of_dtype!r}")
    if not (ok_shape and ok_offsets):
        raise TensorFileError(f"{path}: tensor {name!r} has a malformed shape or offsets")
    begin, end = offsets  # type: ignore[misc]
    nbytes = math.prod(shape) * dtype.itemsize  # type: ignore[arg-type]
    if end - begin != nbytes or begin < 0 or base + end > size:
        raise TensorFileError(f"{path}: tensor {name!r} has offsets that do not match its shape or the file")
    return TensorEntry(name, dtype, tuple(shape), base + begin, nbytes)  # type: ignore[arg-type]
