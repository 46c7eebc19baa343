"""A fixed-width code for an exponent plane, decodable by elementwise tensor operations on any device.

An expert's exponent plane (``inference.modelio.expert_codec``: one byte per weight) holds a few
values: a trained layer's weights lie within a few octaves of their scale. So each byte is coded in
``k`` bits as its offset from a ``base``: the ``2**k - 1`` consecutive values from ``base`` up are
codes ``0 .. 2**k - 2``, and code ``2**k - 1`` *escapes* a byte outside that window, whose value is
kept, in order, in an escape list. The encoder picks ``k`` (1 to 7) and the window that make the
smallest plane, or stores the plane raw (``k = 8``) when no code is smaller. On the demo model's
bf16 experts this takes the plane to the size zstandard makes of it (``k = 3``, about 2 % escapes).

Unlike an entropy code, decoding needs no sequential state: each weight's code sits at a fixed bit
position, and an escape's value is found by counting the escapes before it (a prefix sum). So a GPU
decodes it with torch's own elementwise kernels, in chunks of ``CHUNK`` weights, after copying the
coded bytes (``decode_plane_torch``); the CPU decodes it with numpy (``decode_plane``).

Layout of a coded plane (little-endian)::

    header  16 bytes: b"EXPP", k (u8), base (u8), 0 (u16, reserved), escapes (u64)
    planes  k bit planes of ceil(n / 8) bytes each: bit j of weight i's code is bit i % 8 of
            byte i // 8 of plane j (k = 8: the plane's n bytes as they are)
    escapes the escaped bytes, in weight order

``layout`` checks a blob before anything is decoded: the header, every size against the manifest's
weight count, a window that fits in a byte, and that the planes hold exactly as many escape codes as
the header declares (counted on the host, bit planes ANDed, a pass over ``k * n / 8`` bytes). A device
decode of a checked blob cannot read past its escape list, so a hostile shard is refused, never obeyed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch only where a device decodes: the control plane reads bounds from here without it
    import torch

HEADER = struct.Struct("<4sBBHQ")  # magic, k, base, reserved (0), escapes
MAGIC = b"EXPP"
RAW = 8  # k for a plane stored as it is
CHUNK = 1 << 22  # weights a device decode takes at once
# Its scratch for one chunk, bytes a weight: the codes as int64 words, a plane's gather and its shift
# (1 each) and its int32 indices (1/2), the decoded and escaped planes (1 each), the escapes' prefix sum
# (4, and 4 for cumsum's own int32 copy of the mask), their gathered values and the selection (1 each),
# and the previous chunk's indices until they are rebound (4): under 16.
CHUNK_SCRATCH_BYTES = 16 * CHUNK


class PaletteError(ValueError):
    """A coded plane that is not what its manifest says; the message says why."""


@dataclass(frozen=True)
class Layout:
    """Where a checked coded plane's parts lie in its blob, and what decodes them."""

    words: int  # weights (bytes of the decoded plane)
    k: int
    base: int
    escapes: int
    plane_bytes: int  # bytes of one bit plane (k < 8), or of the raw plane (k = 8)
    chunk_escapes: tuple[int, ...]  # escapes before each CHUNK-weight chunk (k < 8)

    @property
    def escapes_at(self) -> int:
        return HEADER.size + self.k * self.plane_bytes if self.k < RAW else HEADER.size + self.plane_bytes

    @property
    def end(self) -> int:
        """Bytes of the coded plane: what follows it in a blob is not its own."""
        return self.escapes_at + self.escapes


def bound(words: int) -> int:
    """The most bytes ``encode_plane`` makes of a plane of ``words`` bytes, whatever they hold."""
    return HEADER.size + words


def encode_plane(plane: np.ndarray) -> bytes:
    """The coded form of ``plane`` (flat uint8): the smallest of k = 1..7 and the raw plane."""
    n = plane.size
    histogram = np.bincount(plane, minlength=256).astype(np.int64)
    best = (n, RAW, 0, n)  # (bytes, k, base, covered)
    for k in range(1, RAW):
        window = (1 << k) - 1
        covered = np.convolve(histogram, np.ones(window, dtype=np.int64), mode="valid")  # [base] = sum of the window
        base = int(np.argmax(covered))
        size = k * _plane_bytes(n) + (n - int(covered[base]))
        if size < best[0]:
            best = (size, k, base, int(covered[base]))
    _, k, base, covered = best
    if k == RAW:
        return HEADER.pack(MAGIC, RAW, 0, 0, 0) + plane.tobytes()
    escape = (1 << k) - 1
    codes = plane - np.uint8(base)  # wraps below base: those are escapes too
    outside = codes >= escape
    codes[outside] = escape
    escaped = plane[outside]
    planes = b"".join(np.packbits((codes >> j) & 1, bitorder="little").tobytes() for j in range(k))
    return HEADER.pack(MAGIC, k, base, 0, escaped.size) + planes + escaped.tobytes()


def layout(blob: np.ndarray, words: int) -> Layout:
    """The checked layout of the coded plane of ``words`` bytes at the start of ``blob`` (flat uint8)."""
    if blob.size < HEADER.size:
        raise PaletteError(f"a {blob.size}-byte blob cannot hold a coded plane's {HEADER.size}-byte header")
    magic, k, base, reserved, escapes = HEADER.unpack(blob[: HEADER.size].tobytes())
    if magic != MAGIC:
        raise PaletteError(f"the plane's header starts {magic!r}, not {MAGIC!r}")
    if reserved:
        raise PaletteError(f"the plane's header has {reserved} where this version writes 0")
    if not 1 <= k <= RAW:
        raise PaletteError(f"the plane's code width is {k} bits, not 1 to {RAW}")
    if k == RAW:
        if base or escapes:
            raise PaletteError("a raw plane declares a window or escapes")
        found = Layout(words, k, 0, 0, words, ())
    else:
        if base + (1 << k) - 1 > 256:
            raise PaletteError(f"the window of {(1 << k) - 1} values from {base} does not fit in a byte")
        if escapes > words:
            raise PaletteError(f"the plane declares {escapes} escapes for {words} weights")
        found = Layout(words, k, base, escapes, _plane_bytes(words), ())
    if blob.size < found.end:
        raise PaletteError(f"the coded plane needs {found.end} bytes, the blob holds {blob.size}")
    if k == RAW:
        return found
    chunks = _escapes_per_chunk(blob, found)
    if int(chunks.sum()) != escapes:
        raise PaletteError(f"the planes hold {int(chunks.sum())} escape codes, the header declares {escapes}")
    before = np.concatenate([[0], np.cumsum(chunks)[:-1]]).astype(np.int64)
    return Layout(words, k, base, escapes, found.plane_bytes, tuple(int(x) for x in before))


def decode_plane(blob: np.ndarray, where: Layout) -> np.ndarray:
    """The plane (flat uint8, ``where.words`` bytes) that the checked ``blob`` codes, with numpy: the bit
    planes spread into codes through ``_SPREAD_NP`` as ``decode_plane_torch`` does, then the escapes."""
    n = where.words
    if where.k == RAW:
        return blob[HEADER.size : HEADER.size + n]
    planes = blob[HEADER.size : where.escapes_at].reshape(where.k, where.plane_bytes)
    words = _SPREAD_NP[planes[0]]
    for j in range(1, where.k):
        words |= _SPREAD_NP[planes[j]] << np.uint64(j)  # little-endian words on any host
    codes = words.view(np.uint8)[:n]  # little-endian: weight 8i + b is byte b of word i
    escaped = codes == (1 << where.k) - 1
    codes += np.uint8(where.base)  # an escape's sum wraps; it is written over below
    codes[escaped] = blob[where.escapes_at : where.end]
    return codes


def decode_plane_torch(blob: torch.Tensor, where: Layout) -> torch.Tensor:
    """``decode_plane`` with torch operations on ``blob``'s device (flat uint8, the blob as ``layout``
    checked it): a GPU decodes the coded bytes it was copied, ``CHUNK`` weights at a time.

    A plane byte's 8 bits become 8 bytes through a 256-entry table (each bit in its own byte of an
    int64, little-endian: weight ``8i + b`` in byte ``b``), so the ``k`` planes make each weight's code
    in ``k`` gathers and shifts of whole int64 words. An escaped weight's value is the chunk's next
    listed one: the count of escapes up to it (a prefix sum) indexes the chunk's part of the list,
    behind a zero for the weights before its first; ``layout`` counted each chunk's escapes, so no
    index passes its part.
    """
    import torch

    n = where.words
    if where.k == RAW:
        return blob[HEADER.size : HEADER.size + n]
    spread = _spread_table(blob.device)
    planes = blob[HEADER.size : where.escapes_at].view(where.k, where.plane_bytes)
    escaped_values = blob[where.escapes_at : where.end]
    escape = (1 << where.k) - 1
    before = [*where.chunk_escapes, where.escapes]  # escapes before each chunk, and in all
    nothing = torch.zeros(1, dtype=torch.uint8, device=blob.device)
    out = torch.empty(n, dtype=torch.uint8, device=blob.device)
    for chunk, start in enumerate(range(0, n, CHUNK)):
        stop = min(start + CHUNK, n)
        first, last = start // 8, (stop + 7) // 8
        words = torch.index_select(spread, 0, planes[0, first:last].int())
        for j in range(1, where.k):
            words |= torch.index_select(spread, 0, planes[j, first:last].int()) << j
        codes = words.view(torch.uint8)[: stop - start]  # the last byte's padding bits fall past the chunk
        decoded = codes + where.base  # uint8: an escape's sum wraps, and is replaced below
        if before[chunk + 1] > before[chunk]:
            escaped = codes == escape
            index = torch.cumsum(escaped, 0, dtype=torch.int32)  # 1.. at the chunk's escapes, 0 before the first
            listed = torch.cat([nothing, escaped_values[before[chunk] : before[chunk + 1]]])
            # ``layout`` counted the chunk's escapes, so no index passes its part; the clamp keeps a device
            # from ever reading past it (a CUDA index out of range is an assert that ends the process's context).
            index.clamp_(max=listed.numel() - 1)
            decoded = torch.where(escaped, listed.index_select(0, index), decoded)
        out[start:stop] = decoded
    return out


_SPREAD: dict[str, torch.Tensor] = {}


def _spread_table(device: torch.device) -> torch.Tensor:
    """Byte ``p`` -> an int64 whose byte ``b`` is bit ``b`` of ``p``, on ``device`` (made once per device)."""
    import torch

    key = str(device)
    table = _SPREAD.get(key)
    if table is None:
        values = [sum(((p >> b) & 1) << (8 * b) for b in range(8)) for p in range(256)]
        table = _SPREAD[key] = torch.tensor(values, dtype=torch.int64, device=device)
    return table


def _plane_bytes(words: int) -> int:
    return (words + 7) // 8


def _escapes_per_chunk(blob: np.ndarray, where: Layout) -> np.ndarray:
    """How many weights of each CHUNK-weight chunk hold the escape code (every bit plane set)."""
    planes = blob[HEADER.size : where.escapes_at].reshape(where.k, where.plane_bytes)
    every = np.bitwise_and.reduce(planes, axis=0)
    tail = where.words % 8
    if tail:  # the last byte's bits past the last weight are padding, whatever they hold
        every[-1] &= np.uint8((1 << tail) - 1)
    if not every.size:
        return np.zeros(1, dtype=np.int64)
    return np.add.reduceat(np.bitwise_count(every), np.arange(0, every.size, CHUNK // 8), dtype=np.int64)


# Byte p -> a uint64 whose byte b is bit b of p: 8 codes' bits of one plane, each in its own byte.
_SPREAD_NP = np.array([sum(((p >> b) & 1) << (8 * b) for b in range(8)) for p in range(256)], dtype="<u8")


__all__ = [
    "CHUNK",
    "CHUNK_SCRATCH_BYTES",
    "HEADER",
    "MAGIC",
    "Layout",
    "PaletteError",
    "bound",
    "decode_plane",
    "decode_plane_torch",
    "encode_plane",
    "layout",
]
