"""Rotating pinned staging buffers for expert copies from pageable host memory.

A GPU's copy engine copies asynchronously only from page-locked memory. A worker that reads
its experts from disk at each load (``DiskStore``) stages each one through one of a few pinned
buffers of its own, used in turn: while the copy engine moves buffer *i* to the device, the
loader's thread reads the next expert of the pass from disk into buffer *i + 1*. A buffer is
written again only once the copy out of it has finished (the event recorded after it on the
copy stream), so a worker's pinned host memory is exactly ``slots x`` its largest expert,
whatever it owns and however long it runs. The buffers are page-locked where they lie
(``inference.runtime.store.page_lock``), not taken from torch's pinned allocator, which rounds each
block up to a power of two (a Mixtral-8x7B bf16 expert's 224 MiB gate_up and 112 MiB down
would take 256 and 128) and keeps freed blocks cached.

A store that can read an expert straight into given memory (``read_into``: the disk store,
with ``os.preadv``) fills the buffer with no copy in between, unless a cast to the compute
dtype is due; any other store's expert is copied in.

On CPU the same ring runs unpinned and with no events (a copy is done when it returns); the
loader uses it there only when asked (``ExpertLoader(staging_slots=...)``), which is how the
tests run the CUDA path's order of reads, copies and reuse.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import torch

from inference.runtime.coded_expert import page_lock
from inference.runtime.experts import ExpertWeights


class _Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _ReadsInto(Protocol):
    def read_into(self, layer: int, expert: int, out: ExpertWeights) -> None: ...


def expert_views(buffer: torch.Tensor, like: tuple[torch.Size, torch.Size, torch.dtype]) -> ExpertWeights:
    """An expert's (gate_up, down) as views of a flat byte ``buffer``: gate_up first, down right after."""
    gate_up_shape, down_shape, dtype = like
    item = torch.empty((), dtype=dtype).element_size()
    gate_up_bytes = gate_up_shape.numel() * item
    down_bytes = down_shape.numel() * item
    if gate_up_bytes + down_bytes > buffer.numel():
        raise ValueError(f"an expert of {gate_up_bytes + down_bytes} bytes does not fit a {buffer.numel()}-byte buffer")
    gate_up = buffer[:gate_up_bytes].view(dtype).view(gate_up_shape)
    down = buffer[gate_up_bytes : gate_up_bytes + down_bytes].view(dtype).view(down_shape)
    return ExpertWeights(gate_up, down)


class StagingRing:
    """``slots`` host buffers of ``slot_bytes`` each, handed out in turn for copies to a device."""

    def __init__(self, slots: int, slot_bytes: int, *, pin: bool) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a staging ring needs at least 1 slot of at least 1 byte, got {slots} x {slot_bytes}")
        self.slot_bytes = slot_bytes
        self._buffers = [torch.empty(slot_bytes, dtype=torch.uint8) for _ in range(slots)]
        if pin:
            for buffer in self._buffers:
                page_lock(buffer)
        self._copied: list[_Event | None] = [None] * slots  # the last copy out of each buffer
        self._next = 0
        # One expert is staged and its copy queued at a time: ``preload`` and the copy thread
        # may both copy, and a buffer must not be handed out again between ``take`` and ``copied``.
        self.lock = threading.Lock()
        self.stalls = 0  # takes that waited for a copy out of the buffer to finish
        self.stall_ms = 0.0

    @property
    def slots(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def take(self) -> int:
        """The next buffer in turn, once the copy out of it (if any) has finished; call under ``lock``."""
        slot = self._next
        self._next = (slot + 1) % self.slots
        event = self._copied[slot]
        if event is not None and not event.query():
            started = time.perf_counter()
            event.synchronize()
            self.stalls += 1
            self.stall_ms += (time.perf_counter() - started) * 1000
        self._copied[slot] = None
        return slot

    def stage(self, slot: int, store: object, layer: int, expert: int) -> ExpertWeights:
        """Put expert ``(layer, expert)`` of ``store`` into buffer ``slot``; its tensors are views of it."""
        buffer = self._buffers[slot]
        if hasattr(store, "read_into") and hasattr(store, "expert_layout"):
            out = expert_views(buffer, store.expert_layout(layer, expert))  # type: ignore[attr-defined]
            reader: _ReadsInto = store  # type: ignore[assignment]
            reader.read_into(layer, expert, out)
            return out
        host: ExpertWeights = store.get(layer, expert)  # type: ignore[attr-defined]
        out = expert_views(buffer, (host.gate_up.shape, host.down.shape, host.gate_up.dtype))
        out.gate_up.copy_(host.gate_up)
        out.down.copy_(host.down)
        return out

    def copied(self, slot: int, event: _Event | None) -> None:
        """The copy out of buffer ``slot`` is queued; ``event`` completes when it is done (None: done)."""
        self._copied[slot] = event
