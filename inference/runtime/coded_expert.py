"""An expert's bytes as a worker's store holds them: page-locked for fast copies to a GPU
(``page_lock``), or coded (``CodedExpert``: a shard's ``expert_codec`` bytes, decoded into the fused
tensors at each ``get``, or on the GPU after the copy carried them, ``CodedExpert.decode_on``).
The stores are ``store``'s (in RAM) and ``disk_store``'s (read from the shard).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from inference.modelio.expert_codec import (
    CodecError,
    decode_into,
    decode_on_device,
    decode_palette_into,
    device_decodes,
    palette_layout,
)
from inference.modelio.exponent_palette import Layout
from inference.modelio.shards import (
    ShardError,
    StoredTensor,
)
from inference.runtime.experts import ExpertWeights

LayerExpert = tuple[int, int]


def page_lock(tensor: torch.Tensor) -> None:
    """Page-lock ``tensor``'s own host memory for fast, asynchronous copies to a GPU (exactly its bytes).

    ``cudaHostRegister`` (portable, as torch's own ``_pin_memory_utils`` does); the memory is
    unregistered when the tensor is freed. ``tensor.is_pinned()`` is then true, so
    ``.to(device, non_blocking=True)`` copies it asynchronously.
    """
    pointer = tensor.data_ptr()
    torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(pointer, tensor.nbytes, 1)))
    weakref.finalize(tensor, _page_unlock, pointer)


def _page_unlock(pointer: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(pointer)


def missing_expert(layer: int, expert: int) -> KeyError:
    return KeyError(f"expert {expert} of layer {layer} is not in this worker's store")


@dataclass(frozen=True)
class Span:
    """Where one tensor's bytes lie: an open part file and an absolute byte range (``nbytes`` read);
    ``coded``: how they decode, when the shard stores the tensor coded."""

    fd: int
    offset: int
    nbytes: int
    coded: StoredTensor | None = None

    @property
    def raw_nbytes(self) -> int:
        return self.coded.raw_bytes if self.coded is not None else self.nbytes


@dataclass(frozen=True)
class CodedExpert:
    """An expert's three coded tensors (w1, w3, w2) as the shard stores them, and how they decode."""

    gate_up_shape: tuple[int, int]
    down_shape: tuple[int, int]
    dtype: torch.dtype
    blobs: tuple[np.ndarray, np.ndarray, np.ndarray]  # w1, w3, w2: flat uint8
    codes: tuple[StoredTensor, StoredTensor, StoredTensor]
    locked: tuple[torch.Tensor, ...] = ()  # the blobs' memory as page-locked tensors, kept alive (``page_locked``)

    @property
    def nbytes(self) -> int:
        return sum(code.raw_bytes for code in self.codes)

    @property
    def stored_nbytes(self) -> int:
        return sum(blob.size for blob in self.blobs)

    def decode(self, *, pin: bool = False) -> ExpertWeights:
        """The expert as fused tensors, decoded into fresh ones (``ShardError`` if a blob is bad)."""
        gate_up = torch.empty(self.gate_up_shape, dtype=self.dtype, pin_memory=pin)
        down = torch.empty(self.down_shape, dtype=self.dtype, pin_memory=pin)
        self.decode_into(gate_up, down)
        return ExpertWeights(gate_up, down)

    def decode_into(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        rows = byte_array(gate_up)
        first = self.codes[0].raw_bytes
        outs = (rows[:first], rows[first:], byte_array(down))
        if self.decodes_on_device:  # the palette: its layouts are checked once, whichever side decodes
            for blob, code, where, out in zip(self.blobs, self.codes, self.layouts, outs, strict=True):
                decode_palette_into(blob, where, code.dtype, out)
            return
        for blob, code, out in zip(self.blobs, self.codes, outs, strict=True):
            try:
                decode_into(blob, code.dtype, out, code=code.codec)
            except CodecError as exc:
                raise ShardError(f"a coded expert does not decode: {exc}") from None

    @property
    def decodes_on_device(self) -> bool:
        """Whether a GPU decodes this expert (its tensors' code is the palette; zstandard decodes on the host)."""
        return all(device_decodes(code.codec) for code in self.codes)

    @functools.cached_property
    def layouts(self) -> tuple[Layout, Layout, Layout]:
        """Each palette-coded blob's layout, checked on the host once, before it is first decoded on the host
        or copied to a device (``ShardError`` if one is bad): an expert held in RAM is not checked again."""
        try:
            return tuple(  # type: ignore[return-value]
                palette_layout(blob, code.dtype, code.raw_bytes, code=code.codec)
                for blob, code in zip(self.blobs, self.codes, strict=True)
            )
        except CodecError as exc:
            raise ShardError(f"a coded expert does not decode: {exc}") from None

    def decode_on(self, device: torch.device) -> ExpertWeights:
        """The expert on ``device``: its coded bytes copied there (``copy_to``) and decoded there
        (``decode_copied``), both on the current stream."""
        return self.decode_copied(self.copy_to(device))

    def copy_to(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The blobs, checked (``layouts``), copied to ``device`` on the current stream: asynchronously
        from page-locked blobs, which must then live until the stream has copied them."""
        self.layouts  # noqa: B018 - a bad blob is refused before anything is copied
        return tuple(torch.from_numpy(blob).to(device, non_blocking=True) for blob in self.blobs)  # type: ignore[return-value]

    def decode_copied(self, blobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> ExpertWeights:
        """The expert decoded from its blobs on their device (``copy_to``) by torch's kernels, queued on the
        current stream, into fused tensors allocated there."""
        device = blobs[0].device
        gate_up = torch.empty(self.gate_up_shape, dtype=self.dtype, device=device)
        down = torch.empty(self.down_shape, dtype=self.dtype, device=device)
        rows = gate_up.view(-1).view(torch.uint8)
        first = self.codes[0].raw_bytes
        outs = (rows[:first], rows[first:], down.view(-1).view(torch.uint8))
        for blob, code, where, out in zip(blobs, self.codes, self.layouts, outs, strict=True):
            decode_on_device(blob, where, code.dtype, out)
        return ExpertWeights(gate_up, down)

    def page_locked(self) -> CodedExpert:
        """This expert with its blobs moved into one page-aligned buffer of whole pages, page-locked once
        (``page_lock``) for asynchronous copies: registered ranges of separate small blobs could share a
        page, which ``cudaHostRegister`` refuses."""
        total = sum(blob.size for blob in self.blobs)
        pages = -(-max(total, 1) // PAGE) * PAGE
        backing = np.empty(pages + PAGE, dtype=np.uint8)
        start = -backing.ctypes.data % PAGE
        buffer = backing[start : start + pages]
        blobs, offset = [], 0
        for blob in self.blobs:
            buffer[offset : offset + blob.size] = blob
            blobs.append(buffer[offset : offset + blob.size])
            offset += blob.size
        locked = torch.from_numpy(buffer)
        page_lock(locked)  # registered while the tensor lives: the returned expert holds it
        return dataclasses.replace(self, blobs=tuple(blobs), locked=(locked,))


PAGE = 4096


def byte_array(tensor: torch.Tensor) -> np.ndarray:
    """A writable flat uint8 numpy view of a contiguous CPU tensor's storage (any dtype, bf16 included)."""
    return tensor.view(-1).view(torch.uint8).numpy()
