"""Expert stores: where a worker keeps the weights of the experts it owns, off the GPU.

A store hands out host-side expert weights by (layer, expert) in the fused layout
(``inference.runtime.experts.fuse_expert``). ``HostMemoryStore`` reads the whole shard into RAM up
front (pinned when a GPU will copy from it); ``DiskStore`` keeps only an index of where
each expert lies in the shard's files and reads an expert when the loader asks for it, so
a worker's host memory stays at its overhead plus the experts in flight, whatever it owns.
``HotSetStore`` keeps the last experts a ``DiskStore`` read in RAM (the eviction rule:
``inference.policies.hotset``). ``open_store`` picks one by the ``expert_store`` setting (``"ram"``,
``"disk"``, or ``"hot"``).

A shard whose experts are stored coded (``expert_codec``, ``inference.modelio.expert_codec``) is read
as it lies: the "disk" store reads an expert's coded bytes and decodes them into the tensors it
returns (or a staging buffer), the "ram" store keeps the coded bytes in RAM and decodes at each
``get``, when the loader moves the expert to its device. ``nbytes`` is an expert's decoded size
(what it takes on the device); ``stored_nbytes`` what the store holds and reads of it (what a
disk, RAM or an emulated link carries). The "hot" store keeps the coded bytes of its hot set too.
On a GPU the loader asks each store for an expert's coded bytes instead (``coded``) where they
decode on a device (``CodedExpert.decode_on``): the copy carries them, and the GPU decodes them.

This module holds what a store is (``ExpertStore``), ``HostMemoryStore`` and ``open_store``;
``disk_store`` the two that read from the shard, ``coded_expert`` an expert's coded bytes and
``page_lock``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from inference.constants import EXPERT_STORES
from inference.runtime.coded_expert import CodedExpert, LayerExpert, missing_expert, page_lock
from inference.runtime.disk_store import DiskStore, HotSetStore
from inference.runtime.experts import ExpertWeights


class ExpertStore(Protocol):
    def keys(self) -> frozenset[LayerExpert]: ...

    def get(self, layer: int, expert: int) -> ExpertWeights: ...

    def nbytes(self, layer: int, expert: int) -> int: ...

    def decodes_on_device(self, layer: int, expert: int) -> bool: ...

    def coded(self, layer: int, expert: int) -> CodedExpert | None: ...


class HostMemoryStore:
    """Every owned expert in RAM: as fused tensors, or as its coded bytes (``CodedExpert``) decoded
    into fresh tensors (pinned with ``pin``) at each ``get``."""

    def __init__(self, experts: dict[LayerExpert, ExpertWeights | CodedExpert], *, pin: bool = False) -> None:
        self._experts = experts
        self.pin = pin

    @classmethod
    def from_shard(
        cls, shard_dir: str | Path, *, pin: bool = False, verify: bool = True, dtype: torch.dtype | None = None
    ) -> HostMemoryStore:
        """Read every expert of a worker shard into fused host tensors.

        The shard is verified first unless ``verify=False`` (the caller just verified it).
        Each expert is read by a ``DiskStore`` straight into its final tensors: no unfused
        copies are held or freed on the way, so the peak is the owned bytes plus overhead.
        With ``pin`` (a GPU will copy from them) each tensor is page-locked where it lies
        (``page_lock``), not allocated by torch's pinned allocator, which rounds every block
        up to a power of two: a Mixtral-8x7B expert's 224 MiB gate_up would take 256 MiB, and
        a worker pinning 22 GB of experts would need 25.
        """
        experts: dict[LayerExpert, ExpertWeights | CodedExpert] = {}
        with DiskStore(shard_dir, verify=verify, dtype=dtype) as disk:
            for pair in sorted(disk.keys()):
                if disk.keeps_coded(*pair):  # the coded bytes stay in RAM; each load decodes them
                    experts[pair] = disk.read_coded(*pair)
                    if pin and experts[pair].decodes_on_device:  # a GPU copies them coded and decodes them there
                        experts[pair] = experts[pair].page_locked()
                    continue
                weights = disk.get(*pair)
                if pin:
                    page_lock(weights.gate_up)
                    page_lock(weights.down)
                experts[pair] = weights
        return cls(experts, pin=pin)

    def keys(self) -> frozenset[LayerExpert]:
        return frozenset(self._experts)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        held = self._held(layer, expert)
        return held.decode(pin=self.pin) if isinstance(held, CodedExpert) else held

    def nbytes(self, layer: int, expert: int) -> int:
        return self._held(layer, expert).nbytes

    def stored_nbytes(self, layer: int, expert: int) -> int:
        """What this store holds of the expert in RAM (its coded bytes where the shard codes it)."""
        held = self._held(layer, expert)
        return held.stored_nbytes if isinstance(held, CodedExpert) else held.nbytes

    def decodes_on_device(self, layer: int, expert: int) -> bool:
        """Whether the expert is held coded in a code a GPU decodes (then ``coded`` gives its bytes)."""
        held = self._held(layer, expert)
        return isinstance(held, CodedExpert) and held.decodes_on_device

    def coded(self, layer: int, expert: int) -> CodedExpert | None:
        """The expert's coded bytes where the shard codes it, else None."""
        held = self._held(layer, expert)
        return held if isinstance(held, CodedExpert) else None

    def _held(self, layer: int, expert: int) -> ExpertWeights | CodedExpert:
        try:
            return self._experts[(layer, expert)]
        except KeyError:
            raise missing_expert(layer, expert) from None


def open_store(
    kind: str,
    shard_dir: str | Path,
    *,
    pin: bool = False,
    verify: bool = True,
    read_bytes_per_s: float | None = None,
    dtype: torch.dtype | None = None,
    hot_experts: int = 0,
) -> HostMemoryStore | DiskStore | HotSetStore:
    """The ``kind`` store (``"ram"``, ``"disk"`` or ``"hot"``) of the worker shard in ``shard_dir``.

    ``read_bytes_per_s`` emulates the disk's read bandwidth (``"disk"`` and ``"hot"``);
    ``dtype`` casts every expert as it is read (None: the checkpoint's own dtype);
    ``hot_experts`` is how many experts a ``"hot"`` store keeps in RAM.
    """
    if kind == "ram":
        return HostMemoryStore.from_shard(shard_dir, pin=pin, verify=verify, dtype=dtype)
    if kind in ("disk", "hot"):
        disk = DiskStore(shard_dir, pin=pin, verify=verify, read_bytes_per_s=read_bytes_per_s, dtype=dtype)
        if kind == "disk":
            return disk
        try:
            return HotSetStore(disk, hot_experts)
        except ValueError:
            disk.close()
            raise
    raise ValueError(f"expert store must be one of {', '.join(EXPERT_STORES)}, got {kind!r}")
