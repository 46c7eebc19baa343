"""A lossless code for expert weights: the exponent bits coded, the rest raw.

An expert's bytes are copied in full precision because output must be exact; a lossless code
keeps it exact and moves fewer bytes. In a trained model's weights the exponent carries little
information (a few of its 256 values hold nearly every weight) while the sign and mantissa are
close to random (DFloat11's and ZipNN's observation). So each word is split into two planes:

- the *exponent plane*, one byte per weight: bf16's 8 exponent bits; fp16's high byte (sign,
  5 exponent bits, the top 2 mantissa bits); fp32's 8 exponent bits (its high half is a bf16);
- the *rest*, stored raw: bf16's sign and 7 mantissa bits in one byte; fp16's low byte; fp32's
  sign and top 7 mantissa bits in one byte, then its low 16 mantissa bits as a little-endian
  uint16 plane.

A stored tensor is ``coded plane + rest``; the rest's length follows from the raw size
(``numel x (itemsize - 1)``), so the coded plane is everything before it. Two codes of the plane
(the manifest names each tensor's):

- ``exponent-plane+palette`` (``PALETTE_CODE``, what a build writes): fixed-width codes of the
  plane's values around their most common ones, and the rare others listed
  (``inference.modelio.exponent_palette``); fp16's plane is first rotated left a bit, its sign to
  the lowest bit, so that its values cluster. It decodes with numpy on a CPU and with torch's
  elementwise kernels on a GPU (``decode_on_device``), so a GPU worker copies the coded bytes;
- ``exponent-plane+zstd`` (``ZSTD_CODE``): the plane through zstandard (level 3, one frame that
  records its content size), what builds wrote before; it still decodes, on the host only.

What was measured before choosing (``benchmarks/expert_codecs.py``, ``benchmarks/results/expert-codecs-*.json``):
on bf16 the zstd plane gives 0.70 of the raw bytes against ZipNN's and DFloat11's 0.67 (Huffman-coded
exponents), plain zstd 0.79; the palette makes the demo model's bf16 experts the size the zstd plane
does (0.705), and its fp16 ones a little larger (0.885 against 0.854).

Decoding refuses, with ``CodecError``, a blob that is not what its manifest says: a raw size that
is not whole words, a blob too short to hold the rest, a plane that does not declare exactly one
byte per weight, a malformed or trailing-data plane. The decoded size is thus bounded by the
manifest's raw size before anything is allocated: a hostile shard cannot make a worker allocate
more than the expert it claims to be.

Pure functions over numpy byte arrays, and torch only in ``decode_on_device``. ``decode_into``
writes into the caller's memory (a fused expert's rows, a staging buffer), so a decode costs no
copy beyond its own output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import zstandard

from inference.constants import CODED_DTYPE_BYTES, EXPONENT_PALETTE_CODEC, EXPONENT_PLANE_CODEC
from inference.modelio import exponent_palette as palette

if TYPE_CHECKING:
    import torch

PALETTE_CODE = EXPONENT_PALETTE_CODEC  # the per-tensor codes a shard manifest records
ZSTD_CODE = EXPONENT_PLANE_CODEC
CODES = (PALETTE_CODE, ZSTD_CODE)
ZSTD_LEVEL = 3  # what the measurements used (benchmarks/expert_codecs.py)
WORD_BYTES = CODED_DTYPE_BYTES  # bytes per word of the dtypes the code takes, by their safetensors names

_compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)


class CodecError(ValueError):
    """A blob that cannot be decoded as its manifest says; the message says why."""


def supports(dtype: str) -> bool:
    """Whether tensors of the safetensors dtype ``dtype`` (``BF16``, ``F16``, ``F32``...) can be coded."""
    return dtype in WORD_BYTES


def rest_nbytes(raw_nbytes: int, dtype: str) -> int:
    """Bytes of the raw (uncompressed) planes of a tensor of ``raw_nbytes`` in ``dtype``."""
    width = _width(dtype)
    if raw_nbytes < 0 or raw_nbytes % width:
        raise CodecError(f"{raw_nbytes} bytes are not whole {dtype} words")
    return raw_nbytes // width * (width - 1)


def frame_bound(nbytes: int) -> int:
    """The most bytes the zstandard frame of ``nbytes`` can take: zstd's ``ZSTD_COMPRESSBOUND`` (zstd.h),
    the output buffer python-zstandard's one-shot ``compress`` allocates, and fails rather than overrun."""
    if nbytes < 0:
        raise ValueError(f"a size is not negative, got {nbytes}")
    margin = (128 * 1024 - nbytes) >> 11 if nbytes < 128 * 1024 else 0  # from 64 bytes down to 0
    return nbytes + (nbytes >> 8) + margin


def stored_bound(raw_nbytes: int, dtype: str) -> int:
    """The most bytes ``encode`` can make of a tensor of ``raw_nbytes`` in ``dtype``, whatever its values:
    the raw plane behind the palette's header (the encoder's fallback when no code is smaller) and the raw
    rest. A little more than ``raw_nbytes`` (the header): a code that saves nothing still costs it, so the
    raw size is not a bound of the coded one."""
    rest = rest_nbytes(raw_nbytes, dtype)  # whole words, or CodecError
    return palette.bound(raw_nbytes - rest) + rest


def device_decode_scratch(words: int) -> int:
    """The most device memory ``decode_on_device`` takes for a tensor of ``words`` weights beside its coded
    bytes and its output: the decoded plane and the join's temporaries (up to four planes' worth, fp16's
    rotation included) or one chunk's scratch of the plane's decode, whichever phase is larger, bounded by
    their sum."""
    return 4 * words + palette.CHUNK_SCRATCH_BYTES


def encode(raw: np.ndarray | bytes | memoryview, dtype: str, code: str = PALETTE_CODE) -> bytes:
    """The stored form of a tensor's little-endian bytes ``raw`` in ``dtype``: the coded plane, then the rest.
    ``code`` is the palette (what a build writes) or, to make a set as earlier builds did, zstandard."""
    data = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1)
    rest_nbytes(data.size, dtype)  # whole words, or CodecError
    exponent, rest = _split(data, dtype)
    if code == PALETTE_CODE:
        return palette.encode_plane(_to_palette(exponent, dtype)) + rest.tobytes()
    if code == ZSTD_CODE:
        return _compressor.compress(exponent.tobytes()) + rest.tobytes()
    raise CodecError(f"unknown code {code!r}; the codes are {', '.join(CODES)}")


def decode(blob: bytes | memoryview | np.ndarray, dtype: str, raw_nbytes: int, *, code: str) -> np.ndarray:
    """The raw bytes (uint8) of a tensor stored as ``blob`` with ``code``, which must decode to ``raw_nbytes``."""
    out = np.empty(raw_nbytes, dtype=np.uint8)
    decode_into(blob, dtype, out, code=code)
    return out


def decode_into(blob: bytes | memoryview | np.ndarray, dtype: str, out: np.ndarray, *, code: str) -> None:
    """Decode ``blob``, stored with ``code``, into ``out``: a contiguous uint8 array of exactly the raw size."""
    if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous:
        raise CodecError("decode_into needs a flat, contiguous uint8 output")
    data = np.frombuffer(blob, dtype=np.uint8) if not isinstance(blob, np.ndarray) else blob.reshape(-1)
    if code == PALETTE_CODE:
        decode_palette_into(data, _palette_layout(data, dtype, out.size), dtype, out)
    elif code == ZSTD_CODE:
        _decode_zstd_into(data, dtype, out)
    else:
        raise CodecError(f"unknown code {code!r}; the codes are {', '.join(CODES)}")


def device_decodes(code: str) -> bool:
    """Whether tensors stored with ``code`` decode on a device (the palette; zstandard decodes on the host only)."""
    return code == PALETTE_CODE


def palette_layout(blob: np.ndarray, dtype: str, raw_nbytes: int, *, code: str) -> palette.Layout:
    """The checked layout of a palette-coded blob, which ``decode_palette_into`` and ``decode_on_device`` take:
    ``CodecError`` if the blob is malformed, or if its code is not the palette."""
    if not device_decodes(code):
        raise CodecError(f"{code!r} decodes on the host only; a device decodes {PALETTE_CODE!r}")
    return _palette_layout(blob.reshape(-1), dtype, raw_nbytes)


def decode_palette_into(blob: np.ndarray, where: palette.Layout, dtype: str, out: np.ndarray) -> None:
    """Decode the palette-coded ``blob`` (flat uint8, checked by ``palette_layout``) into ``out`` on the host:
    a caller that keeps the layout decodes again without checking again."""
    _join(_from_palette(palette.decode_plane(blob, where), dtype), blob[where.end :], dtype, out)


def decode_on_device(blob: torch.Tensor, where: palette.Layout, dtype: str, out: torch.Tensor) -> None:
    """Decode the palette-coded ``blob`` (flat uint8 on the device, checked by ``palette_layout``) into ``out``
    (a flat uint8 view of the expert's memory there), with torch's kernels on that device's current stream."""
    exponent = _from_palette_torch(palette.decode_plane_torch(blob, where), dtype)
    _join_torch(exponent, blob[where.end :], dtype, out)


def _palette_layout(data: np.ndarray, dtype: str, raw_nbytes: int) -> palette.Layout:
    """A palette-coded blob's checked plane layout (the raw rest follows it to the blob's end)."""
    width = _width(dtype)
    rest_size = rest_nbytes(raw_nbytes, dtype)
    try:
        where = palette.layout(data, raw_nbytes // width)
    except palette.PaletteError as exc:
        raise CodecError(f"the exponent plane is malformed: {exc}") from None
    if data.size < where.end + rest_size:
        raise CodecError(
            f"a {data.size}-byte blob cannot hold its {where.end}-byte coded plane and the {rest_size} raw bytes "
            f"of a {raw_nbytes}-byte {dtype}"
        )
    if data.size > where.end + rest_size:
        extra = data.size - where.end - rest_size
        raise CodecError(f"a {data.size}-byte blob has {extra} byte{'s' * (extra > 1)} after its tensor")
    return where


def _decode_zstd_into(data: np.ndarray, dtype: str, out: np.ndarray) -> None:
    width = _width(dtype)
    rest_size = rest_nbytes(out.size, dtype)
    words = out.size // width
    frame_size = data.size - rest_size
    if frame_size < 1:
        raise CodecError(f"a {data.size}-byte blob cannot hold the {rest_size} raw bytes of a {out.size}-byte {dtype}")
    frame = memoryview(data[:frame_size])
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise CodecError(f"the exponent plane is not a zstandard frame ({exc})") from None
    if declared != words:  # checked before decompressing: the allocation is bounded by the manifest
        raise CodecError(f"the exponent plane declares {declared} bytes, the tensor has {words} weights")
    try:
        exponent = zstandard.ZstdDecompressor().decompress(frame, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"the exponent plane does not decompress ({exc})") from None
    if len(exponent) != words:
        raise CodecError(f"the exponent plane decompressed to {len(exponent)} bytes, expected {words}")
    _join(np.frombuffer(exponent, dtype=np.uint8), data[frame_size:], dtype, out)


def _to_palette(exponent: np.ndarray, dtype: str) -> np.ndarray:
    """The plane the palette codes: fp16's high byte rotated left one bit (its sign to the lowest bit),
    so that the values of a band of exponents are neighbours; the others' as they are."""
    if dtype != "F16":
        return exponent
    return (exponent << np.uint8(1)) | (exponent >> np.uint8(7))


def _from_palette(plane: np.ndarray, dtype: str) -> np.ndarray:
    if dtype != "F16":
        return plane
    return (plane >> np.uint8(1)) | (plane << np.uint8(7))


def _from_palette_torch(plane: torch.Tensor, dtype: str) -> torch.Tensor:
    if dtype != "F16":
        return plane
    return (plane >> 1) | (plane << 7)  # uint8: the high bits shifted out are dropped


def _join_torch(exponent: torch.Tensor, rest: torch.Tensor, dtype: str, out: torch.Tensor) -> None:
    """``_join`` with torch operations, on the tensors' device: each output byte written from the planes."""
    n = exponent.numel()
    width = _width(dtype)
    words = out.view(n, width)  # little-endian: byte 0 is a word's lowest
    if dtype == "F16":
        words[:, 0] = rest
        words[:, 1] = exponent
        return
    sign_mantissa = rest[:n]
    if dtype == "F32":  # its low 16 mantissa bits, a little-endian uint16 plane after the bf16 half's byte
        words[:, :2] = rest[n:].view(n, 2)
    words[:, width - 2] = (exponent << 7) | (sign_mantissa & 0x7F)  # exponent bit 0, mantissa bits 6..0
    words[:, width - 1] = (sign_mantissa & 0x80) | (exponent >> 1)  # sign, exponent bits 7..1


def _width(dtype: str) -> int:
    try:
        return WORD_BYTES[dtype]
    except KeyError:
        raise CodecError(f"the exponent-plane code takes {', '.join(WORD_BYTES)} tensors, not {dtype!r}") from None


def _split(data: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(the exponent plane, the raw rest) of ``data``'s words, each a flat uint8 array."""
    if dtype == "F16":  # the high byte (sign, 5 exponent bits, 2 mantissa bits), then the low byte
        words = data.view("<u2")
        return (words >> 8).astype(np.uint8), (words & 0xFF).astype(np.uint8)
    if dtype == "BF16":
        exponent, sign_mantissa = _split_bf16(data.view("<u2"))
        return exponent, sign_mantissa
    words = data.view("<u4")  # F32: its high half is a bf16; its low half is mantissa, raw
    exponent, sign_mantissa = _split_bf16((words >> 16).astype(np.uint16))
    low = (words & 0xFFFF).astype("<u2").view(np.uint8)
    return exponent, np.concatenate([sign_mantissa, low])


def _split_bf16(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    exponent = ((words >> 7) & 0xFF).astype(np.uint8)  # bits 14..7
    sign_mantissa = (((words >> 8) & 0x80) | (words & 0x7F)).astype(np.uint8)  # bit 15, bits 6..0
    return exponent, sign_mantissa


def _join(exponent: np.ndarray, rest: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """Write the words that ``exponent`` and ``rest`` split into ``out`` (the inverse of ``_split``).

    Widened with ``astype`` first and combined in place: a ufunc's own ``dtype=`` cast runs through
    its buffered loop, 3x slower here (256 against 706 MB/s for a Mixtral-size bf16 tensor).
    """
    n = exponent.size
    if dtype == "F16":
        words = out.view("<u2")
        np.left_shift(exponent.astype(np.uint16), 8, out=words)
        words |= rest.astype(np.uint16)
        return
    if dtype == "BF16":
        _join_bf16(exponent, rest, out.view("<u2"))
        return
    high = np.empty(n, dtype=np.uint16)
    _join_bf16(exponent, rest[:n], high)
    words = out.view("<u4")
    np.left_shift(high.astype(np.uint32), 16, out=words)
    words |= rest[n:].view("<u2").astype(np.uint32)


def _join_bf16(exponent: np.ndarray, sign_mantissa: np.ndarray, words: np.ndarray) -> None:
    wide = exponent.astype(np.uint16)
    rest = sign_mantissa.astype(np.uint16)
    np.left_shift(wide, 7, out=words)
    np.bitwise_and(rest, 0x7F, out=wide)
    words |= wide
    np.bitwise_and(rest, 0x80, out=rest)
    rest <<= 8
    words |= rest


__all__ = [
    "CODES",
    "PALETTE_CODE",
    "WORD_BYTES",
    "ZSTD_CODE",
    "ZSTD_LEVEL",
    "CodecError",
    "decode",
    "decode_into",
    "decode_on_device",
    "decode_palette_into",
    "device_decode_scratch",
    "device_decodes",
    "encode",
    "frame_bound",
    "palette_layout",
    "rest_nbytes",
    "stored_bound",
    "supports",
]
