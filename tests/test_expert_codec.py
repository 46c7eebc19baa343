"""The lossless expert code (inference/modelio/expert_codec.py): every bit pattern of every dtype
and every family's expert tensors decode to the same bytes, and a malformed or hostile blob is
refused with a clear error before anything larger than the manifest's raw size is allocated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from inference.modelio import expert_codec
from inference.modelio.checkpoint import Checkpoint, is_expert_key
from inference.modelio.expert_codec import CodecError, decode, decode_into, encode, rest_nbytes
from inference.modelio.families import FAMILIES
from inference.tools.tiny import make_tiny

FAMILY_SHAPE = dict(layers=2, hidden=36, intermediate=22, experts=4, top_k=2, heads=3, kv_heads=1, head_dim=12)
SAFETENSORS = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_every_16_bit_pattern_round_trips(dtype: str) -> None:
    # NaNs with payloads, both infinities, both zeros, subnormals: all 65536 words, twice.
    words = np.tile(np.arange(65536, dtype="<u2"), 2)
    raw = words.view(np.uint8)
    assert np.array_equal(decode(encode(raw, dtype), dtype, raw.size), raw)


def test_fp32_bit_patterns_round_trip() -> None:
    rng = np.random.default_rng(41)
    words = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype("<u4")
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 1, 0x807FFFFF], dtype="<u4")
    raw = np.concatenate([words, special]).view(np.uint8)
    assert np.array_equal(decode(encode(raw, "F32"), "F32", raw.size), raw)


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_an_empty_tensor_round_trips(dtype: str) -> None:
    raw = np.empty(0, dtype=np.uint8)
    assert decode(encode(raw, dtype), dtype, 0).size == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_familys_experts_decode_bit_exact(family: str, dtype: str, tmp_path: Path) -> None:
    model = make_tiny(tmp_path / family, family=family, dtype=dtype, seed=7, **FAMILY_SHAPE)
    ckpt = Checkpoint(model)
    experts = [key for key in ckpt if is_expert_key(key)]
    assert experts
    for _, tensor in ckpt.iter_tensors(experts):
        name = SAFETENSORS[tensor.dtype]
        raw = tensor.contiguous().view(torch.uint8).numpy().reshape(-1)
        blob = encode(raw, name)
        out = np.full(raw.size, 0xAB, dtype=np.uint8)
        decode_into(blob, name, out)
        assert np.array_equal(out, raw)


def test_trained_bf16_weights_take_fewer_bytes() -> None:
    # A weight matrix's exponents cluster (normal values around one scale): the plane compresses.
    weights = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)).mul(0.05).to(torch.bfloat16)
    raw = weights.view(torch.uint8).numpy().reshape(-1)
    assert len(encode(raw, "BF16")) < 0.75 * raw.size


def _blob(n: int = 512) -> tuple[np.ndarray, bytes]:
    raw = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).view(torch.uint8).numpy()
    return raw.reshape(-1), encode(raw.reshape(-1), "BF16")


def test_the_frame_bound_is_zstds_own_and_no_encoding_exceeds_its_stored_bound() -> None:
    """``stored_bound`` bounds every encoding, random (incompressible) bytes included, which come out a
    few bytes larger than raw: the raw size is no bound of a coded tensor, this one is."""
    lib = pytest.importorskip("zstandard._cffi").lib  # the wheel's libzstd, through its cffi binding
    for n in (0, 1, 1000, 128 * 1024 - 1, 128 * 1024, 128 * 1024 + 1, 10**6, 2**27 + 5):
        assert expert_codec.frame_bound(n) == lib.ZSTD_compressBound(n), n
    rng = np.random.default_rng(0)
    for dtype, width in expert_codec.WORD_BYTES.items():
        for words in (1, 1000, 70_000):
            raw = rng.integers(0, 256, words * width, dtype=np.uint8)
            coded = len(encode(raw, dtype))
            assert raw.size < coded <= expert_codec.stored_bound(raw.size, dtype), (dtype, words)
    with pytest.raises(CodecError):
        expert_codec.stored_bound(3, "BF16")


def test_a_dtype_it_does_not_code_is_refused_by_name() -> None:
    with pytest.raises(CodecError, match="not 'I8'"):
        encode(np.zeros(4, dtype=np.uint8), "I8")
    assert not expert_codec.supports("I8") and expert_codec.supports("BF16")


def test_a_raw_size_of_no_whole_words_is_refused() -> None:
    with pytest.raises(CodecError, match="not whole F32 words"):
        rest_nbytes(6, "F32")


def test_a_blob_too_short_for_its_rest_is_refused() -> None:
    raw, blob = _blob()
    with pytest.raises(CodecError, match="cannot hold"):
        decode(blob[: raw.size // 2], "BF16", raw.size)


def test_a_corrupted_frame_is_refused() -> None:
    raw, blob = _blob()
    broken = bytearray(blob)
    broken[:4] = b"\0\0\0\0"  # the frame's magic number
    with pytest.raises(CodecError, match="not a zstandard frame"):
        decode(bytes(broken), "BF16", raw.size)


def test_a_frame_declaring_more_than_the_manifest_says_is_refused_before_decompressing() -> None:
    # A hostile shard: a tiny frame that would expand to 64 MiB, for a tensor said to be 1 KB.
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 26))
    rest = bytes(rest_nbytes(1024, "BF16"))
    with pytest.raises(CodecError, match="declares 67108864 bytes"):
        decode(bomb + rest, "BF16", 1024)


def test_a_frame_without_a_declared_size_is_refused() -> None:
    raw, _ = _blob()
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(raw.size // 2))
    with pytest.raises(CodecError, match="declares -1 bytes"):
        decode(frame + bytes(rest_nbytes(raw.size, "BF16")), "BF16", raw.size)


def test_a_truncated_frame_is_refused() -> None:
    raw, blob = _blob()
    rest = rest_nbytes(raw.size, "BF16")
    frame = blob[: len(blob) - rest]
    with pytest.raises(CodecError):
        decode(frame[:-3] + blob[len(blob) - rest :], "BF16", raw.size)


def test_decode_into_wants_a_flat_byte_output() -> None:
    raw, blob = _blob()
    with pytest.raises(CodecError, match="flat, contiguous uint8"):
        decode_into(blob, "BF16", np.empty(raw.size // 2, dtype=np.uint16))
