"""A worker's experts read from its shard on disk as the loader asks for them (``DiskStore``), and
the last of them kept in RAM (``HotSetStore``, the eviction rule ``inference.policies.hotset``).

``DiskStore`` keeps only an index of where each expert lies in the shard's files and reads an
expert when the loader asks for it, so a worker's host memory stays at its overhead plus the
experts in flight, whatever it owns; a coded expert's bytes are read as they lie and decoded into
the tensors it returns (or a staging buffer). ``HotSetStore`` keeps the coded bytes of its hot set.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from inference.modelio.checkpoint import EXPERT_PROJS, parse_expert_key
from inference.modelio.expert_codec import (
    device_decodes,
)
from inference.modelio.shards import (
    MANIFEST_FILE,
    ShardError,
    StoredTensor,
    role_experts,
    stored_tensors,
    verify_shard,
)
from inference.modelio.tensorfile import DTYPES, TensorEntry, TensorFileError, read_header
from inference.policies.hotset import hot_set_victims
from inference.runtime.coded_expert import CodedExpert, LayerExpert, Span, byte_array, missing_expert
from inference.runtime.experts import ExpertWeights


@dataclass(frozen=True)
class _ExpertIndex:
    dtype: torch.dtype
    gate_up_shape: tuple[int, int]  # [2I, H]
    down_shape: tuple[int, int]  # [H, I]
    gate_up: tuple[Span, Span]  # w1 then w3: the rows of gate_up in order
    down: Span  # w2

    @property
    def spans(self) -> tuple[Span, Span, Span]:
        return (*self.gate_up, self.down)

    # Alike coded_expert.py's nbytes and stored_nbytes by domain: each expert form sizes itself.
    @property
    def nbytes(self) -> int:
        """Decoded bytes: what the expert takes in memory."""
        return sum(span.raw_nbytes for span in self.spans)

    @property
    def stored_nbytes(self) -> int:
        """Bytes in the shard's files: what a read moves."""
        return sum(span.nbytes for span in self.spans)

    @property
    def coded(self) -> bool:
        return self.down.coded is not None


class DiskStore:
    """A worker's experts read from its shard files on demand (SSD streaming).

    Construction reads only the safetensors headers (``inference.modelio.tensorfile.read_header``):
    which part holds each expert's ``w1``/``w2``/``w3``, at which byte range, in which dtype
    and shape. ``get`` reads the three ranges with ``os.preadv`` straight into the fused
    layout (``w1`` and ``w3`` are consecutive row blocks of ``gate_up``): one copy from the
    page cache, no ``torch.cat``. Reads go through file descriptors, not ``safe_open``'s
    memory map: a mapped file's touched pages count in the process's resident memory, so a
    long-running worker would grow to its whole shard (measured: +230 MiB of RssFile after
    reading a 336 MiB shard once, and 15 ms per bf16 expert of 5.5 MB against 0.9 ms here).
    ``pread`` moves no file position, so one descriptor per part serves every thread (the
    loader's copy thread, ``preload``).

    ``read_into`` reads an expert straight into memory the caller gives: a GPU worker's
    loader reads each expert into one of its rotating pinned staging buffers
    (``inference.runtime.staging``) and copies it to the device from there, so its pinned memory is
    those few buffers, exactly. With ``pin=True`` each ``get`` instead returns freshly
    allocated pinned tensors from PyTorch's caching host allocator (recycled once freed and
    their copies done, but each rounded up to a power of two and kept cached); the loader's
    CPU paths may keep ``get``'s tensors as the "device" copy, which a reused buffer would corrupt.

    ``read_bytes_per_s`` emulates a slower disk: reads share one token bucket (a clock of
    when the disk is next free), so reading n bytes takes at least n / rate even when
    threads read at once. ``dtype`` casts each expert after reading it (a role computing in
    another dtype than the checkpoint's); ``nbytes`` is then the cast expert's size.
    """

    def __init__(
        self,
        shard_dir: str | Path,
        *,
        pin: bool = False,
        verify: bool = True,
        read_bytes_per_s: float | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self._fds: list[int] = []  # first, so that close() works whatever fails below
        if read_bytes_per_s is not None and read_bytes_per_s <= 0:
            raise ValueError(f"read_bytes_per_s must be > 0 (or None), got {read_bytes_per_s}")
        self.shard_dir = Path(shard_dir)
        self.pin = pin
        self.read_bytes_per_s = read_bytes_per_s
        self.dtype = dtype
        manifest = verify_shard(self.shard_dir, expect_role="worker") if verify else _manifest(self.shard_dir)
        parts = sorted(e["path"] for e in manifest["files"] if e["path"].endswith(".safetensors"))
        self._bucket_lock = threading.Lock()
        self._disk_free_at = 0.0
        try:
            tensors: dict[str, tuple[int, TensorEntry]] = {}
            for part in parts:
                file = self.shard_dir / part
                fd = os.open(file, os.O_RDONLY)  # not inherited by children (PEP 446)
                self._fds.append(fd)
                try:
                    header = read_header(file)
                except (TensorFileError, OSError) as exc:
                    raise ShardError(f"shard {self.shard_dir}: cannot index {part}: {exc}") from exc
                for name, entry in header.items():
                    tensors[name] = (fd, entry)
            self._index = self._build_index(tensors, stored_tensors(manifest, f"shard {self.shard_dir}"))
            listed = set(role_experts(manifest))
            if listed and listed != set(self._index):
                raise ShardError(f"shard {self.shard_dir}: its files' experts do not match the manifest's expert list")
        except BaseException:
            self.close()
            raise

    def _build_index(
        self, tensors: dict[str, tuple[int, TensorEntry]], stored: dict[str, StoredTensor]
    ) -> dict[LayerExpert, _ExpertIndex]:
        projs: dict[LayerExpert, dict[str, _Located]] = {}
        for name, (fd, entry) in tensors.items():
            key = parse_expert_key(name)
            if key is not None:
                located = _Located(fd, *_decoded_entry(self.shard_dir, entry, stored.get(name)))
                projs.setdefault((key.layer, key.expert), {})[key.proj] = located
        index: dict[LayerExpert, _ExpertIndex] = {}
        for (layer, expert), found in projs.items():
            where = f"shard {self.shard_dir}: expert {expert} of layer {layer}"
            missing = sorted(set(EXPERT_PROJS) - found.keys())
            if missing:
                raise ShardError(f"{where} lacks {', '.join(missing)}")
            (fd1, w1, c1), (fd2, w2, c2), (fd3, w3, c3) = found["w1"], found["w2"], found["w3"]
            if len({c is None for c in (c1, c2, c3)}) > 1:
                raise ShardError(f"{where} mixes coded and plain tensors")
            if not w1.dtype == w2.dtype == w3.dtype:
                raise ShardError(f"{where} has mixed dtypes {w1.dtype}/{w2.dtype}/{w3.dtype}")
            if len(w1.shape) != 2 or w1.shape != w3.shape or w2.shape != w1.shape[::-1]:
                raise ShardError(f"{where} has mismatched shapes w1 {w1.shape}, w2 {w2.shape}, w3 {w3.shape}")
            inter, hidden = w1.shape
            index[(layer, expert)] = _ExpertIndex(
                dtype=w1.dtype,
                gate_up_shape=(2 * inter, hidden),
                down_shape=(hidden, inter),
                gate_up=(Span(fd1, w1.start, w1.nbytes, c1), Span(fd3, w3.start, w3.nbytes, c3)),
                down=Span(fd2, w2.start, w2.nbytes, c2),
            )
        return index

    def stored_nbytes(self, layer: int, expert: int) -> int:
        """Bytes of the expert in the shard's files: what a read moves (its coded bytes where coded)."""
        return self._entry(layer, expert).stored_nbytes

    def keeps_coded(self, layer: int, expert: int) -> bool:
        """Whether the expert is stored coded and read in its own dtype (no cast): a RAM store then
        holds its coded bytes (``read_coded``)."""
        entry = self._entry(layer, expert)
        return entry.coded and (self.dtype is None or self.dtype == entry.dtype)

    def decodes_on_device(self, layer: int, expert: int) -> bool:
        """Whether the expert is kept coded (``keeps_coded``) in a code a GPU decodes: nothing is read to say."""
        entry = self._entry(layer, expert)
        return self.keeps_coded(layer, expert) and all(
            span.coded is not None and device_decodes(span.coded.codec) for span in entry.spans
        )

    def coded(self, layer: int, expert: int) -> CodedExpert | None:
        """The expert's coded bytes, read, where the shard codes it, else None."""
        return self.read_coded(layer, expert) if self.keeps_coded(layer, expert) else None

    def read_coded(self, layer: int, expert: int) -> CodedExpert:
        """The expert's coded bytes as the shard stores them (``keeps_coded`` must be true)."""
        entry = self._entry(layer, expert)
        if not entry.coded:
            raise ValueError(f"expert {expert} of layer {layer} is not stored coded")
        start = time.perf_counter()
        coded = self._read_blobs(entry)
        if self.read_bytes_per_s:
            self._throttle(entry.stored_nbytes, start)
        return coded

    def _read_blobs(self, entry: _ExpertIndex) -> CodedExpert:
        blobs = tuple(np.empty(span.nbytes, dtype=np.uint8) for span in entry.spans)
        for span, blob in zip(entry.spans, blobs, strict=True):
            _pread_into(span, memoryview(blob))
        codes = tuple(span.coded for span in entry.spans)
        return CodedExpert(entry.gate_up_shape, entry.down_shape, entry.dtype, blobs, codes)  # type: ignore[arg-type]

    def keys(self) -> frozenset[LayerExpert]:
        return frozenset(self._index)

    def nbytes(self, layer: int, expert: int) -> int:
        entry = self._entry(layer, expert)
        if self.dtype is None:
            return entry.nbytes
        return entry.nbytes // entry.dtype.itemsize * self.dtype.itemsize

    def get(self, layer: int, expert: int) -> ExpertWeights:
        entry = self._entry(layer, expert)
        if self.dtype is not None and self.dtype != entry.dtype:
            read = self._read(entry)
            cast = (torch.empty(t.shape, dtype=self.dtype, pin_memory=self.pin).copy_(t) for t in read)
            return ExpertWeights(*cast)
        gate_up, down = self._read(entry)
        return ExpertWeights(gate_up, down)

    def expert_layout(self, layer: int, expert: int) -> tuple[torch.Size, torch.Size, torch.dtype]:
        """The (gate_up shape, down shape, dtype) ``get`` returns for this expert."""
        entry = self._entry(layer, expert)
        return torch.Size(entry.gate_up_shape), torch.Size(entry.down_shape), self.dtype or entry.dtype

    def read_into(self, layer: int, expert: int, out: ExpertWeights) -> None:
        """Read this expert straight into ``out`` (contiguous, laid out as ``expert_layout`` says):
        a staging buffer (``inference.runtime.staging``), filled with no copy in between unless a cast is due."""
        entry = self._entry(layer, expert)
        layout = (tuple(out.gate_up.shape), tuple(out.down.shape), out.gate_up.dtype, out.down.dtype)
        want = self.expert_layout(layer, expert)
        if layout != (tuple(want[0]), tuple(want[1]), want[2], want[2]):
            raise ValueError(f"expert {expert} of layer {layer} is {want}, not laid out as {layout}")
        if not (out.gate_up.is_contiguous() and out.down.is_contiguous()):
            raise ValueError("read_into needs contiguous tensors")
        if want[2] != entry.dtype:
            gate_up, down = self._read(entry)
            out.gate_up.copy_(gate_up)
            out.down.copy_(down)
            return
        self._read(entry, out.gate_up, out.down)

    def _read(
        self, entry: _ExpertIndex, gate_up: torch.Tensor | None = None, down: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's fused (gate_up, down) in the file's dtype, into the given tensors or fresh ones
        (pinned unless a cast follows)."""
        pin = self.pin and (self.dtype is None or self.dtype == entry.dtype)
        start = time.perf_counter()
        if gate_up is None or down is None:
            gate_up = torch.empty(entry.gate_up_shape, dtype=entry.dtype, pin_memory=pin)
            down = torch.empty(entry.down_shape, dtype=entry.dtype, pin_memory=pin)
        if entry.coded:
            self._read_blobs(entry).decode_into(gate_up, down)
        else:
            rows = _writable_bytes(gate_up)
            first = entry.gate_up[0].nbytes
            _pread_into(entry.gate_up[0], rows[:first])
            _pread_into(entry.gate_up[1], rows[first:])
            _pread_into(entry.down, _writable_bytes(down))
        if self.read_bytes_per_s:
            self._throttle(entry.stored_nbytes, start)
        return gate_up, down

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def _entry(self, layer: int, expert: int) -> _ExpertIndex:
        try:
            return self._index[(layer, expert)]
        except KeyError:
            raise missing_expert(layer, expert) from None

    def _throttle(self, nbytes: int, start: float) -> None:
        assert self.read_bytes_per_s is not None
        with self._bucket_lock:
            begin = max(start, self._disk_free_at)
            self._disk_free_at = done = begin + nbytes / self.read_bytes_per_s
        wait = done - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


class HotSetStore:
    """A ``DiskStore`` with the last ``capacity`` experts it read kept in RAM (``ExpertStore``); an expert
    its shard stores coded is kept coded and decoded at each ``get``, as the "ram" store does."""

    def __init__(self, disk: DiskStore, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a hot set holds at least 1 expert, got {capacity}")
        self.disk = disk
        self.capacity = capacity
        self._held: OrderedDict[LayerExpert, ExpertWeights | CodedExpert] = OrderedDict()
        self._pins: Counter[LayerExpert] = Counter()
        self._lock = threading.Lock()
        self.reads = 0  # experts read from disk
        self.hits = 0  # experts served from the hot set

    def keys(self) -> frozenset[LayerExpert]:
        return self.disk.keys()

    def nbytes(self, layer: int, expert: int) -> int:
        return self.disk.nbytes(layer, expert)

    def stored_nbytes(self, layer: int, expert: int) -> int:
        """What the hot set holds of the expert in RAM: its coded bytes where it is kept coded."""
        return (
            self.disk.stored_nbytes(layer, expert)
            if self.disk.keeps_coded(layer, expert)
            else self.nbytes(layer, expert)
        )

    def get(self, layer: int, expert: int) -> ExpertWeights:
        held = self._fetch(layer, expert)
        return held.decode(pin=self.disk.pin) if isinstance(held, CodedExpert) else held

    def decodes_on_device(self, layer: int, expert: int) -> bool:
        return self.disk.decodes_on_device(layer, expert)

    def coded(self, layer: int, expert: int) -> CodedExpert | None:
        """The expert's coded bytes where the shard codes it (kept in the hot set as ``get`` keeps it), else None."""
        if not self.disk.keeps_coded(layer, expert):
            return None
        held = self._fetch(layer, expert)
        assert isinstance(held, CodedExpert)
        return held

    def _fetch(self, layer: int, expert: int) -> ExpertWeights | CodedExpert:
        """The expert as the hot set holds it, read into it first if it is not there."""
        key = (layer, expert)
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                self._held.move_to_end(key)
                self.hits += 1
        if held is None:  # outside the lock: a read takes a while
            held = (
                self.disk.read_coded(layer, expert)
                if self.disk.keeps_coded(layer, expert)
                else self.disk.get(layer, expert)
            )
            with self._lock:
                self.reads += 1
                self._held[key] = held
                self._held.move_to_end(key)
                for victim in hot_set_victims(list(self._held), set(self._pins), self.capacity):
                    del self._held[victim]
        return held

    def pin(self, layer: int, expert: int) -> None:
        """A prediction named this expert: keep it until it is used."""
        with self._lock:
            self._pins[(layer, expert)] += 1

    def unpin(self, layer: int, expert: int) -> None:
        with self._lock:
            key = (layer, expert)
            if self._pins[key] <= 1:
                self._pins.pop(key, None)
            else:
                self._pins[key] -= 1

    def clear_pins(self) -> None:
        with self._lock:
            self._pins.clear()

    def held(self) -> list[LayerExpert]:
        """The experts in RAM, least recently used first."""
        with self._lock:
            return list(self._held)

    def resident_bytes(self) -> int:
        """Bytes the hot set holds in RAM (coded experts at their coded size)."""
        with self._lock:
            return sum(w.stored_nbytes if isinstance(w, CodedExpert) else w.nbytes for w in self._held.values())

    def close(self) -> None:
        self.disk.close()


def _manifest(shard_dir: Path) -> dict:
    try:
        manifest = json.loads((shard_dir / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ShardError(f"shard {shard_dir}: cannot read {MANIFEST_FILE} ({exc})") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise ShardError(f"shard {shard_dir}: {MANIFEST_FILE} has no 'files' list")
    return manifest


class _Located(NamedTuple):
    """One expert tensor of the shard: its part file, its (decoded) entry, and its code if coded."""

    fd: int
    entry: TensorEntry
    coded: StoredTensor | None


def _decoded_entry(
    shard_dir: Path, entry: TensorEntry, coded: StoredTensor | None
) -> tuple[TensorEntry, StoredTensor | None]:
    """``entry`` as the tensor it decodes to (dtype and shape from the manifest; the byte range stays
    the stored one), checked against the manifest: ``ShardError`` if the file holds something else."""
    if coded is None:
        return entry, None
    if entry.dtype != torch.uint8 or len(entry.shape) != 1 or entry.nbytes != coded.stored_bytes:
        raise ShardError(
            f"shard {shard_dir}: stored tensor {entry.name!r} is {entry.nbytes} bytes of {entry.dtype}, "
            f"the manifest lists {coded.stored_bytes} coded bytes"
        )
    return TensorEntry(entry.name, DTYPES[coded.dtype], coded.shape, entry.start, entry.nbytes), coded


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """``byte_array`` as a memoryview, what ``os.preadv`` fills."""
    return memoryview(byte_array(tensor)).cast("B")


def _pread_into(span: Span, buffer: memoryview) -> None:
    done = 0
    while done < span.nbytes:  # a read may return less than asked (Linux caps one at ~2 GiB)
        got = os.preadv(span.fd, [buffer[done:]], span.offset + done)
        if got <= 0:
            raise ShardError(f"a shard file ended {span.nbytes - done} bytes early while reading an expert")
        done += got
