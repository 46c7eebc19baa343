"""Plain-read safetensors: the same tensors as the reference reader, and every malformed header
refused with TensorFileError (never a crash)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.modelio.tensorfile import TensorFileError, iter_tensors, read_header


def test_every_dtype_reads_as_the_reference_reader_does(tmp_path: Path) -> None:
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7, 2).to(torch.bfloat16),
        "f16": torch.randn(4).to(torch.float16),
        "i8": torch.randint(-100, 100, (6, 1), dtype=torch.int8),
        "u8": torch.randint(0, 255, (9,), dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
    }
    file = tmp_path / "t.safetensors"
    save_file(tensors, file)
    want = load_file(file)
    got = dict(iter_tensors(file))
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert dict(iter_tensors(file, ["bf16"])).keys() == {"bf16"}
    assert read_header(file)["f32"].nbytes == 60


def _file(tmp_path: Path, header: object, data: bytes = b"\0" * 16) -> Path:
    raw = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ({"t": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}}, "unsupported dtype"),
        ({"t": {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}}, "malformed shape"),
        ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, "do not match"),
        ({"t": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, "do not match"),
        ({"t": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}, "unsupported dtype"),
        ({"t": "nothing"}, "bad header entry"),
        (["not", "an", "object"], "not a JSON object"),
    ],
)
def test_a_malformed_header_is_refused(tmp_path: Path, header: object, reason: str) -> None:
    with pytest.raises(TensorFileError, match=reason):
        list(iter_tensors(_file(tmp_path, header)))


def test_a_truncated_or_garbage_file_is_refused(tmp_path: Path) -> None:
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(TensorFileError, match="too short"):
        read_header(short)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(TensorFileError, match="does not fit"):
        read_header(huge)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}")
    with pytest.raises(TensorFileError, match="not valid JSON"):
        read_header(garbage)
