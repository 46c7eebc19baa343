"""A lossless code for expert weights: the exponent bits through zstandard, the rest raw.

An expert's bytes are copied in full precision because output must be exact; a lossless code
keeps it exact and moves fewer bytes. In a trained model's weights the exponent carries little
information (a few of its 256 values hold nearly every weight) while the sign and mantissa are
close to random (DFloat11's and ZipNN's observation). So each word is split into two planes:

- the *exponent plane*, one byte per weight: bf16's 8 exponent bits; fp16's high byte (sign,
  5 exponent bits, the top 2 mantissa bits); fp32's 8 exponent bits (its high half is a bf16);
- the *rest*, stored raw: bf16's sign and 7 mantissa bits in one byte; fp16's low byte; fp32's
  sign and top 7 mantissa bits in one byte, then its low 16 mantissa bits as a little-endian
  uint16 plane.

The exponent plane goes through zstandard (level 3, one frame that records its content size);
the rest follows it unchanged. A stored tensor is ``frame + rest``: the rest's length follows
from the raw size (``numel x (itemsize - 1)``), so the frame is everything before it. What was
measured before choosing (``benchmarks/expert_codecs.py``, ``benchmarks/results/expert-codecs-*.json``):
on bf16 this gives 0.70 of the raw bytes against ZipNN's and DFloat11's 0.67 (Huffman-coded
exponents), and needs only the zstandard wheel; plain zstd gives 0.79.

Decoding refuses, with ``CodecError``, a blob that is not what its manifest says: a raw size that
is not whole words, a blob too short to hold the rest, a frame whose header does not declare
exactly one byte per weight, a corrupted or trailing-data frame. The decompressed size is thus
bounded by the manifest's raw size before anything is allocated: a hostile shard cannot make a
worker allocate more than the expert it claims to be.

Pure functions over numpy byte arrays; no torch. ``decode_into`` writes into the caller's memory
(a fused expert's rows, a staging buffer), so a decode costs no copy beyond its own output.
"""

from __future__ import annotations

import numpy as np
import zstandard

from inference.constants import CODED_DTYPE_BYTES, EXPONENT_PLANE_CODEC

EXPONENT_PLANE = EXPONENT_PLANE_CODEC  # the per-tensor codec name a shard manifest records
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
    the exponent plane's frame at its bound (one byte per weight, incompressible) and the raw rest. A little
    more than ``raw_nbytes`` (a 256th of the plane and a frame header): a code that saves nothing still costs
    its frame, so the raw size is not a bound of the coded one."""
    rest = rest_nbytes(raw_nbytes, dtype)  # whole words, or CodecError
    return frame_bound(raw_nbytes - rest) + rest


def encode(raw: np.ndarray | bytes | memoryview, dtype: str) -> bytes:
    """The stored form of a tensor's little-endian bytes ``raw`` in ``dtype``: frame then rest."""
    data = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1)
    rest_nbytes(data.size, dtype)  # whole words, or CodecError
    exponent, rest = _split(data, dtype)
    return _compressor.compress(exponent.tobytes()) + rest.tobytes()


def decode(blob: bytes | memoryview | np.ndarray, dtype: str, raw_nbytes: int) -> np.ndarray:
    """The raw bytes (uint8) of a tensor stored as ``blob``, which must decode to ``raw_nbytes``."""
    out = np.empty(raw_nbytes, dtype=np.uint8)
    decode_into(blob, dtype, out)
    return out


def decode_into(blob: bytes | memoryview | np.ndarray, dtype: str, out: np.ndarray) -> None:
    """Decode ``blob`` into ``out``, a contiguous uint8 array of exactly the raw size."""
    if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous:
        raise CodecError("decode_into needs a flat, contiguous uint8 output")
    width = _width(dtype)
    rest_size = rest_nbytes(out.size, dtype)
    words = out.size // width
    data = memoryview(blob).cast("B") if not isinstance(blob, np.ndarray) else memoryview(blob.reshape(-1))
    frame_size = len(data) - rest_size
    if frame_size < 1:
        raise CodecError(f"a {len(data)}-byte blob cannot hold the {rest_size} raw bytes of a {out.size}-byte {dtype}")
    frame = data[:frame_size]
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
    rest = np.frombuffer(data[frame_size:], dtype=np.uint8)
    _join(np.frombuffer(exponent, dtype=np.uint8), rest, dtype, out)


def _width(dtype: str) -> int:
    try:
        return WORD_BYTES[dtype]
    except KeyError:
        raise CodecError(f"{EXPONENT_PLANE} codes {', '.join(WORD_BYTES)} tensors, not {dtype!r}") from None


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
    "EXPONENT_PLANE",
    "WORD_BYTES",
    "ZSTD_LEVEL",
    "CodecError",
    "decode",
    "decode_into",
    "encode",
    "frame_bound",
    "rest_nbytes",
    "stored_bound",
    "supports",
]
