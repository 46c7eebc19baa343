"""The lossless expert code (inference/modelio/expert_codec.py): every bit pattern of every dtype
and every family's expert tensors decode to the same bytes, with both codes of the exponent plane
and, for the palette, with numpy and with torch's kernels (what a GPU runs, here on the CPU); a
malformed or hostile blob is refused with a clear error before anything larger than the manifest's
raw size is allocated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from inference.modelio import expert_codec, exponent_palette
from inference.modelio.checkpoint import Checkpoint, is_expert_key
from inference.modelio.expert_codec import (
    PALETTE_CODE,
    ZSTD_CODE,
    CodecError,
    decode,
    decode_into,
    decode_on_device,
    encode,
    palette_layout,
    rest_nbytes,
)
from inference.modelio.families import FAMILIES
from inference.tools.tiny import make_tiny

FAMILY_SHAPE = dict(layers=2, hidden=36, intermediate=22, experts=4, top_k=2, heads=3, kv_heads=1, head_dim=12)
SAFETENSORS = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
CODES = [PALETTE_CODE, ZSTD_CODE]


def _round_trips(raw: np.ndarray, dtype: str, code: str) -> bool:
    """Whether ``raw`` decodes to itself from its ``code`` encoding, with numpy and, for the palette,
    with torch's kernels as a device decodes it."""
    blob = encode(raw, dtype, code)
    if not np.array_equal(decode(blob, dtype, raw.size, code=code), raw):
        return False
    if code != PALETTE_CODE:
        return True
    coded = np.frombuffer(blob, dtype=np.uint8)
    on_device = torch.full((raw.size,), 0xAB, dtype=torch.uint8)
    decode_on_device(
        torch.from_numpy(coded.copy()), palette_layout(coded, dtype, raw.size, code=code), dtype, on_device
    )
    return np.array_equal(on_device.numpy(), raw)


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_every_16_bit_pattern_round_trips(dtype: str, code: str) -> None:
    # NaNs with payloads, both infinities, both zeros, subnormals: all 65536 words, twice.
    words = np.tile(np.arange(65536, dtype="<u2"), 2)
    assert _round_trips(words.view(np.uint8), dtype, code)


@pytest.mark.parametrize("code", CODES)
def test_fp32_bit_patterns_round_trip(code: str) -> None:
    rng = np.random.default_rng(41)
    words = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype("<u4")
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 1, 0x807FFFFF], dtype="<u4")
    assert _round_trips(np.concatenate([words, special]).view(np.uint8), "F32", code)


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_an_empty_tensor_round_trips(dtype: str, code: str) -> None:
    assert _round_trips(np.empty(0, dtype=np.uint8), dtype, code)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_palette_decodes_on_a_device_across_its_chunks(dtype: str) -> None:
    # More weights than two of a device decode's chunks and not a whole byte of codes, with the
    # escapes a weight matrix has (tiny and huge values, infinities) spread over every chunk.
    generator = torch.Generator().manual_seed(3)
    weights = torch.randn(2 * exponent_palette.CHUNK + 13, generator=generator).mul(0.02)
    weights[::4099] = float("inf")
    weights[1::7919] = 1e-30
    weights[-1] = -float("inf")  # the last chunk (13 weights) has one too
    raw = weights.to(getattr(torch, dtype)).view(torch.uint8).numpy().reshape(-1)
    name = SAFETENSORS[getattr(torch, dtype)]
    coded = np.frombuffer(encode(raw, name), dtype=np.uint8)
    where = palette_layout(coded, name, raw.size, code=PALETTE_CODE)
    assert where.k < 8 and len(where.chunk_escapes) == 3 and where.escapes > where.chunk_escapes[2] > 0
    assert _round_trips(raw, name, PALETTE_CODE)


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
        for code in CODES:
            blob = encode(raw, name, code)
            out = np.full(raw.size, 0xAB, dtype=np.uint8)
            decode_into(blob, name, out, code=code)
            assert np.array_equal(out, raw)
        assert _round_trips(raw, name, PALETTE_CODE)


@pytest.mark.parametrize("code", CODES)
def test_trained_bf16_weights_take_fewer_bytes(code: str) -> None:
    # A weight matrix's exponents cluster (normal values around one scale): the plane compresses.
    weights = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)).mul(0.05).to(torch.bfloat16)
    raw = weights.view(torch.uint8).numpy().reshape(-1)
    assert len(encode(raw, "BF16", code)) < 0.75 * raw.size


def _blob(n: int = 512, code: str = PALETTE_CODE) -> tuple[np.ndarray, bytes]:
    raw = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).view(torch.uint8).numpy()
    return raw.reshape(-1), encode(raw.reshape(-1), "BF16", code)


def test_the_frame_bound_is_zstds_own() -> None:
    lib = pytest.importorskip("zstandard._cffi").lib  # the wheel's libzstd, through its cffi binding
    for n in (0, 1, 1000, 128 * 1024 - 1, 128 * 1024, 128 * 1024 + 1, 10**6, 2**27 + 5):
        assert expert_codec.frame_bound(n) == lib.ZSTD_compressBound(n), n


def test_no_encoding_exceeds_its_stored_bound() -> None:
    """``stored_bound`` (the palette's, what a build writes) bounds every encoding, random
    (incompressible) bytes included, which come out a few bytes larger than raw: the raw size is no
    bound of a coded tensor, this one is."""
    rng = np.random.default_rng(0)
    for dtype, width in expert_codec.WORD_BYTES.items():
        for words in (1, 1000, 70_000):
            raw = rng.integers(0, 256, words * width, dtype=np.uint8)
            coded = len(encode(raw, dtype))
            assert raw.size < coded <= expert_codec.stored_bound(raw.size, dtype), (dtype, words)
            assert _round_trips(raw, dtype, PALETTE_CODE)
    with pytest.raises(CodecError):
        expert_codec.stored_bound(3, "BF16")


def test_a_dtype_it_does_not_code_is_refused_by_name() -> None:
    with pytest.raises(CodecError, match="not 'I8'"):
        encode(np.zeros(4, dtype=np.uint8), "I8")
    assert not expert_codec.supports("I8") and expert_codec.supports("BF16")


def test_a_raw_size_of_no_whole_words_is_refused() -> None:
    with pytest.raises(CodecError, match="not whole F32 words"):
        rest_nbytes(6, "F32")


@pytest.mark.parametrize("code", CODES)
def test_a_blob_too_short_for_its_rest_is_refused(code: str) -> None:
    raw, blob = _blob(code=code)
    with pytest.raises(CodecError, match="cannot hold"):
        decode(blob[: raw.size // 2], "BF16", raw.size, code=code)


def test_a_corrupted_frame_is_refused() -> None:
    raw, blob = _blob(code=ZSTD_CODE)
    broken = bytearray(blob)
    broken[:4] = b"\0\0\0\0"  # the frame's magic number
    with pytest.raises(CodecError, match="not a zstandard frame"):
        decode(bytes(broken), "BF16", raw.size, code=ZSTD_CODE)


def test_a_frame_declaring_more_than_the_manifest_says_is_refused_before_decompressing() -> None:
    # A hostile shard: a tiny frame that would expand to 64 MiB, for a tensor said to be 1 KB.
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 26))
    rest = bytes(rest_nbytes(1024, "BF16"))
    with pytest.raises(CodecError, match="declares 67108864 bytes"):
        decode(bomb + rest, "BF16", 1024, code=ZSTD_CODE)


def test_a_frame_without_a_declared_size_is_refused() -> None:
    raw, _ = _blob(code=ZSTD_CODE)
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(raw.size // 2))
    with pytest.raises(CodecError, match="declares -1 bytes"):
        decode(frame + bytes(rest_nbytes(raw.size, "BF16")), "BF16", raw.size, code=ZSTD_CODE)


@pytest.mark.parametrize("code", CODES)
def test_a_truncated_plane_is_refused(code: str) -> None:
    raw, blob = _blob(code=code)
    rest = rest_nbytes(raw.size, "BF16")
    plane = blob[: len(blob) - rest]
    with pytest.raises(CodecError):
        decode(plane[:-3] + blob[len(blob) - rest :], "BF16", raw.size, code=code)


def test_decode_into_wants_a_flat_byte_output() -> None:
    raw, blob = _blob()
    with pytest.raises(CodecError, match="flat, contiguous uint8"):
        decode_into(blob, "BF16", np.empty(raw.size // 2, dtype=np.uint16), code=PALETTE_CODE)


def test_an_unknown_code_is_refused_by_name() -> None:
    raw, blob = _blob()
    with pytest.raises(CodecError, match="unknown code 'exponent-plane\\+lz4'"):
        decode(blob, "BF16", raw.size, code="exponent-plane+lz4")
    with pytest.raises(CodecError, match="decodes on the host only"):
        palette_layout(np.frombuffer(_blob(code=ZSTD_CODE)[1], dtype=np.uint8), "BF16", raw.size, code=ZSTD_CODE)


def _palette_header(blob: bytes) -> tuple[bytes, int, int, int, int]:
    return exponent_palette.HEADER.unpack(blob[: exponent_palette.HEADER.size])


def _with_header(blob: bytes, **fields: int | bytes) -> bytes:
    magic, k, base, reserved, escapes = _palette_header(blob)
    values = {"magic": magic, "k": k, "base": base, "reserved": reserved, "escapes": escapes} | fields
    header = exponent_palette.HEADER.pack(*(values[f] for f in ("magic", "k", "base", "reserved", "escapes")))
    return header + blob[exponent_palette.HEADER.size :]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"magic": b"ZSTD"}, "starts b'ZSTD'"),
        ({"k": 0}, "code width is 0 bits"),
        ({"k": 9}, "code width is 9 bits"),
        ({"base": 250}, "does not fit in a byte"),
        ({"escapes": 10**12}, "declares 1000000000000 escapes for 512 weights"),
        ({"reserved": 7}, "has 7 where this version writes 0"),
    ],
)
def test_a_palette_header_that_lies_is_refused_before_decoding(fields: dict, reason: str) -> None:
    raw, blob = _blob()
    assert _palette_header(blob)[1] < 8  # coded, not stored raw
    with pytest.raises(CodecError, match=reason):
        decode(_with_header(blob, **fields), "BF16", raw.size, code=PALETTE_CODE)


def test_a_palette_whose_escape_codes_differ_from_its_list_is_refused() -> None:
    # One more escape code in the planes than escaped values listed: a device decode would read past
    # the list, so the host counts them first and refuses the blob.
    raw, blob = _blob()
    _, k, _, _, escapes = _palette_header(blob)
    coded = np.frombuffer(blob, dtype=np.uint8).copy()
    planes = coded[exponent_palette.HEADER.size : exponent_palette.HEADER.size + k * 64].reshape(k, 64)
    codes = np.bitwise_and.reduce(planes, axis=0)
    weight = int(np.flatnonzero(np.unpackbits(codes, bitorder="little") == 0)[0])  # a weight that is not escaped
    planes[:, weight // 8] |= np.uint8(1 << (weight % 8))
    with pytest.raises(CodecError, match=f"hold {escapes + 1} escape codes, the header declares {escapes}"):
        decode(coded.tobytes(), "BF16", raw.size, code=PALETTE_CODE)


def test_bytes_after_a_palette_blob_are_refused() -> None:
    raw, blob = _blob()
    with pytest.raises(CodecError, match="has 1 byte after its tensor"):
        decode(blob + b"\0", "BF16", raw.size, code=PALETTE_CODE)
