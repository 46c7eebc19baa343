"""Just-in-time expert loading: copy an expert to the compute device, use it, free it.

``ExpertLoader`` owns one background thread that copies experts from a store to the
compute device in the order they will be needed, never holding more than
``max_resident`` experts on the device (the one being computed plus the next one). When it
starts a load it takes a *batch*: every pending expert of the same (step, layer) that fits in
the free slots, copied in one pass (on CUDA each copy is queued on the side stream as soon as
its expert is read, each behind an event of its own), and each expert is usable once its own
copy is done (checked between reads, and after the pass's last read). A batch forms when a
layer's experts are pending while slots are free (a layer's predictions arriving together);
with every slot busy, loads start one at a time as slots free. A request for an expert that
was never predicted jumps the queue and, if the device is full, pushes out the prefetch
needed furthest in the future: a wrong prediction costs a load on the critical path, never a
wrong result.

With a ``DeviceCache`` (the strategies that cache) a released expert stays on the device
in the cache, a cached expert is served without a load and never prefetched again, and
``preload`` fills the cache up front (``full-cache``).

On CUDA the copies come from pinned host memory on a side stream: the store's own tensors
when they are pinned (the "ram" store, page-locked where it lies; a "hot" store's, from torch's
pinned allocator), else rotating pinned staging buffers (``staging_slots``,
``inference.runtime.staging``; the "disk" store) that each expert is read into first. A pass never
copies more than ``max_resident`` experts and ends with its last copy, so the ring has
``min(staging_slots, max_resident)`` buffers: within a pass of several experts the read of the
next overlaps the copy of this one; from one pass to the next it does not. A buffer is reused
only once the copy out of it is done. The compute stream waits for a copy's event before
using it, and every expert the compute stream has read is handed back to the allocator with
``record_stream`` when it is freed or pushed out of the cache, so a later copy on the side
stream can never overwrite memory a kernel still reads. On CPU a copy is a fresh buffer (what
a GPU would hold). An expert its shard stores coded (``inference.modelio.expert_codec``) is decoded by
the store on this host as the copy starts; an emulated link (``copy_bytes_per_s``) carries its coded
bytes, after the decode's real time. On CUDA an expert coded with the palette (the code a build writes)
is copied coded on the side stream (asynchronously from the "ram" store's page-locked blobs; a "disk" or
"hot" store's are read into pageable memory, whose copy returns once the driver has staged it), and
decoded by torch's kernels (``CodedExpert.decode_copied``) on a decode stream that waits for that copy, so
the next expert's copy overlaps this one's decode; the decode stream's event is the expert's. One of the
earlier zstandard code is decoded on the host and copied whole. Resident bytes are counted from the
experts' own tensors on both, never from ``torch.cuda.memory_allocated`` (which counts activations and
every other allocation of the process too).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from inference.policies.hybrid import CopyState, HostRates, expert_flops
from inference.policies.loads import Key, pick_victim, take_batch
from inference.runtime.cache import DeviceCache
from inference.runtime.coded_expert import CodedExpert
from inference.runtime.experts import ExpertWeights, expert_forward
from inference.runtime.staging import StagingRing
from inference.runtime.store import ExpertStore


@dataclass
class Resident:
    weights: ExpertWeights
    nbytes: int
    ready: torch.cuda.Event | None = None


@dataclass
class LoaderStats:
    loads: int = 0
    hits: int = 0
    misses: int = 0
    wasted_loads: int = 0
    batches: int = 0  # copy passes: loads / batches experts per pass
    load_ms: float = 0.0
    peak_bytes: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})


class ExpertLoader:
    def __init__(
        self,
        store: ExpertStore,
        device: torch.device,
        *,
        max_resident: int = 2,
        copy_bytes_per_s: float | None = None,
        cache: DeviceCache[Resident] | None = None,
        batch_loads: bool = True,
        staging_slots: int = 0,
    ) -> None:
        """``staging_slots``: stage each copy through that many rotating host buffers
        (``inference.runtime.staging``; pinned on CUDA), for a store whose tensors are not page-locked;
        0 copies from the store's own tensors."""
        if max_resident < 1:
            raise ValueError("max_resident must be >= 1")
        if staging_slots < 0:
            raise ValueError("staging_slots must be >= 0")
        self.store = store
        self.device = device
        self.max_resident = max_resident
        # Emulated host->device bandwidth (bytes/s) for benchmarks on machines without PCIe.
        self.copy_bytes_per_s = copy_bytes_per_s
        self.cache = cache
        self.batch_loads = batch_loads  # False: one expert per pass (benchmarks compare the two)
        self.stats = LoaderStats()
        self._cond = threading.Condition()
        self._queue: list[Key] = []  # prefetches, in the order they will be needed
        self._urgent: list[Key] = []  # keys a computation is already waiting for
        self._loading: list[Key] = []  # the batch being copied
        self._pass_started = 0.0  # when the copy of the batch's first expert still loading began
        self._drop_when_loaded: set[Key] = set()  # of the batch, those no longer wanted
        self._ready: dict[Key, Resident] = {}
        self._in_use: set[Key] = set()
        self._prefetched: set[Key] = set()
        self._error: BaseException | None = None
        self._closed = False
        self._cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None
        self._decode_stream = torch.cuda.Stream(device) if self._cuda else None  # coded experts' decodes
        self.staging: StagingRing | None = None
        if staging_slots:
            owned = store.keys()  # a store is not a dict: it has keys() only
            largest = max(store.nbytes(*pair) for pair in owned)
            # A pass copies at most max_resident experts: a buffer more could never be used.
            self.staging = StagingRing(min(staging_slots, max_resident), largest, pin=self._cuda)
        self._thread = threading.Thread(target=self._run, name="expert-loader", daemon=True)
        self._thread.start()

    # --- what the worker loop calls ---------------------------------------------------

    def prefetch(self, key: Key) -> None:
        """Load ``key`` ahead of need, in (step, layer) order, when a device slot frees."""
        with self._cond:
            self._drop_when_loaded.discard(key)  # wanted again while its copy was being dropped
            if key in self._ready or key in self._loading or key in self._queue or key in self._urgent:
                return
            if self.cache is not None and key[1:] in self.cache:
                return
            self._prefetched.add(key)
            self._queue.append(key)
            self._queue.sort()
            self._cond.notify_all()

    def acquire(self, key: Key, timeout_s: float = 60.0) -> tuple[Resident, bool, float]:
        """Block until ``key`` is on the device; returns (expert, was_predicted, wait_ms)."""
        start = time.perf_counter()
        with self._cond:
            cached = self.cache.get(key[1:]) if self.cache is not None and key not in self._ready else None
            if cached is not None:
                self._in_use.add(key)
                self.stats.hits += 1
                self._note_peak(key)
                return cached, True, (time.perf_counter() - start) * 1000
            predicted = key in self._prefetched
            self._drop_when_loaded.discard(key)  # wanted after all: keep the copy in flight
            if key not in self._ready and key not in self._loading and key not in self._urgent:
                if key in self._queue:
                    self._queue.remove(key)
                self._urgent.append(key)
                self._make_room_for_critical()
                self._cond.notify_all()
            deadline = time.monotonic() + timeout_s
            while key not in self._ready:
                self._raise_if_failed()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"expert {key} was not loaded within {timeout_s:.0f} s")
                self._cond.wait(remaining)
            self._in_use.add(key)
            resident = self._ready[key]
            if predicted:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
            self._note_peak(key)
        if resident.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(resident.ready)
        return resident, predicted, (time.perf_counter() - start) * 1000

    def copy_states(self, keys: list[Key]) -> dict[Key, CopyState]:
        """Where each of ``keys`` stands: on the device (or in its cache), being copied, queued, or
        nowhere; with the copy pass under way (what ``inference.policies.hybrid`` decides from)."""
        with self._cond:
            elapsed = time.perf_counter() - self._pass_started if self._loading else 0.0
            size = len(self._loading) if self._loading else 0
            pending = self._urgent + self._queue  # the order copies will start in
            states = {}
            for key in keys:
                if key in self._ready or (self.cache is not None and key[1:] in self.cache):
                    states[key] = CopyState("ready")
                elif key in self._loading:
                    states[key] = CopyState("loading", self._loading.index(key), size, elapsed)
                elif key in pending:
                    states[key] = CopyState("queued", pending.index(key), size, elapsed)
                else:
                    states[key] = CopyState("absent", 0, size, elapsed)
            return states

    def release(self, key: Key) -> None:
        """Done with ``key``: free it from the device at once, or keep it in the cache if any."""
        with self._cond:
            self._in_use.discard(key)
            self._prefetched.discard(key)
            resident = self._ready.pop(key, None)
            if resident is not None:
                freed = [resident] if self.cache is None else self.cache.admit(key[1:], resident, resident.nbytes)
                for expert in freed:
                    self._retire(expert)
            self._cond.notify_all()

    def _retire(self, resident: Resident) -> None:
        """Drop an expert the compute stream has read: its memory is reused only once that stream is past it."""
        if self._cuda:
            compute_stream = torch.cuda.current_stream(self.device)
            for tensor in (resident.weights.gate_up, resident.weights.down):
                tensor.record_stream(compute_stream)

    def discard(self, keep: Callable[[Key], bool]) -> None:
        """Drop every queued or idle resident prefetch for which ``keep`` is false."""
        with self._cond:
            self._queue = [k for k in self._queue if keep(k)]
            for key in [k for k in self._ready if not keep(k) and k not in self._in_use]:
                del self._ready[key]
                self.stats.wasted_loads += 1
            self._drop_when_loaded |= {k for k in self._loading if not keep(k)}
            self._prefetched = {k for k in self._prefetched if keep(k)}
            self._cond.notify_all()

    def preload(self, pairs: list[tuple[int, int]]) -> None:
        """Copy every (layer, expert) of ``pairs`` into the cache now (``full-cache``)."""
        if self.cache is None:
            raise RuntimeError("preload needs a device cache")
        for layer, expert in pairs:
            ((_, resident),) = self._copies([(0, layer, expert)])
            with self._cond:
                freed = self.cache.admit((layer, expert), resident, resident.nbytes)
            if freed:
                raise RuntimeError(f"preload of {len(pairs)} experts overflows the device cache")

    def reset_stats(self) -> None:
        with self._cond:
            self.stats = LoaderStats()

    def resident_bytes(self) -> int:
        with self._cond:
            return self._resident_bytes_locked()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    # --- the copy thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._closed and not self._can_start_load():
                        if self._urgent:
                            # A computation waits: push out an idle prefetch if one holds its slot.
                            self._make_room_for_critical()
                            if self._can_start_load():
                                break
                        self._cond.wait()
                    if self._closed:
                        return
                    batch = self._take_batch()
                    self._loading = list(batch)
                    self._pass_started = time.perf_counter()
                    self._drop_when_loaded = set()
                for key, resident in self._copies(batch):
                    with self._cond:  # each expert is usable as soon as its own copy is done
                        self._loading.remove(key)
                        self._pass_started = time.perf_counter()  # the rest of the pass starts now
                        self.stats.loads += 1
                        if key in self._drop_when_loaded:
                            self._drop_when_loaded.discard(key)
                            self.stats.wasted_loads += 1
                        else:
                            self._ready[key] = resident
                            self._note_peak(key)
                        self._cond.notify_all()
                resident = None  # the loop's last expert: not kept alive (on the device) past its release
                with self._cond:
                    self.stats.batches += 1
        except BaseException as exc:  # surfaced to the worker loop by acquire()
            with self._cond:
                self._error = exc
                self._loading = []
                self._cond.notify_all()

    def _copies(self, keys: list[Key]) -> Iterator[tuple[Key, Resident]]:
        """Copy the experts of ``keys`` to the device in one pass, yielding each once it is there.

        On CUDA each copy is queued on the side stream as soon as its expert is read, followed by
        an event of its own, so the copy engine runs them back to back while the next ones are
        read; each is yielded once its event has completed.
        """
        last = time.perf_counter()  # a disk store's read is part of the load
        if self._cuda:
            assert self._copy_stream is not None
            queued: deque[tuple[Key, ExpertWeights | CodedExpert, ExpertWeights, torch.cuda.Event]] = deque()
            for key in keys:
                _, layer, expert = key
                coded = self._device_coded(layer, expert)
                if coded is not None:
                    weights, event = self._copy_and_decode(coded)
                    queued.append((key, coded, weights, event))  # its blobs live until their copies are done
                    while queued and queued[0][3].query():
                        done, host_done, on_device, copied = queued.popleft()
                        last = self._account(last)
                        yield done, Resident(on_device, host_done.nbytes, copied)
                    continue
                with self._staging_lock():
                    slot, host = self._host_source(layer, expert)
                    event = torch.cuda.Event()
                    try:
                        with torch.cuda.stream(self._copy_stream):
                            weights = ExpertWeights(
                                host.gate_up.to(self.device, non_blocking=True),
                                host.down.to(self.device, non_blocking=True),
                            )
                    finally:  # recorded even if the second copy failed: the first may still read the buffer
                        event.record(self._copy_stream)
                        if self.staging is not None and slot is not None:
                            self.staging.copied(slot, event)  # the buffer is free again once this completes
                queued.append((key, host, weights, event))  # a store's host tensors live until their copy is done
                while queued and queued[0][3].query():  # usable now, while later ones are still read
                    done, host_done, on_device, copied = queued.popleft()
                    last = self._account(last)
                    yield done, Resident(on_device, host_done.nbytes, copied)
            while queued:
                done, host_done, on_device, copied = queued.popleft()
                copied.synchronize()
                last = self._account(last)
                yield done, Resident(on_device, host_done.nbytes, copied)
            return
        for key in keys:
            _, layer, expert = key
            with self._staging_lock():
                slot, host = self._host_source(layer, expert)
                copying = time.perf_counter()
                if self.copy_bytes_per_s and self.staging is None:
                    # Emulated hardware: the copy engine's time is the token bucket's below, and the CPU
                    # a memcpy would burn here (a GPU's DMA engine does not) stays with the computation.
                    weights = ExpertWeights(host.gate_up, host.down)
                else:
                    # A fresh buffer, as the device copy would be: the store's (or the staging buffer's)
                    # tensors stay untouched.
                    weights = ExpertWeights(host.gate_up.clone(), host.down.clone())
                if self.staging is not None and slot is not None:
                    self.staging.copied(slot, None)  # a CPU copy is done when it returns
            if self.copy_bytes_per_s:
                # The link carries what the store holds: an expert's coded bytes where its shard codes it,
                # decoded above (the store's get) on this CPU, in real time.
                floor = self._link_bytes(layer, expert, host) / self.copy_bytes_per_s
                elapsed = time.perf_counter() - copying  # the copy follows the read, as a DMA from it does
                if floor > elapsed:
                    time.sleep(floor - elapsed)
            last = self._account(last)
            yield key, Resident(weights, host.nbytes, None)

    def _copy_and_decode(self, coded: CodedExpert) -> tuple[ExpertWeights, torch.cuda.Event]:
        """Queue a coded expert's copy on the side stream and its decode on the decode stream behind it (so the
        next expert's copy overlaps this one's decode); the expert on the device, and the event after which
        it is there (its host blobs are copied by then)."""
        assert self._copy_stream is not None and self._decode_stream is not None
        copied, decoded = torch.cuda.Event(), torch.cuda.Event()
        try:
            with torch.cuda.stream(self._copy_stream):
                blobs = coded.copy_to(self.device)
        finally:  # recorded even if a copy failed: an earlier one may still read the blobs
            copied.record(self._copy_stream)
        self._decode_stream.wait_event(copied)
        try:
            with torch.cuda.stream(self._decode_stream):
                for blob in blobs:  # allocated on the copy stream, read on this one: not reused before
                    blob.record_stream(self._decode_stream)
                weights = coded.decode_copied(blobs)
        finally:
            decoded.record(self._decode_stream)
        return weights, decoded

    def _device_coded(self, layer: int, expert: int) -> CodedExpert | None:
        """On a GPU, the expert's coded bytes where its store keeps them coded in a code a device decodes;
        else None (the expert is read, and decoded on the host where coded, as on a CPU)."""
        if not self._cuda or not getattr(self.store, "decodes_on_device", lambda *_: False)(layer, expert):
            return None  # decided before anything is read: an expert of another code is read once, below
        return self.store.coded(layer, expert)  # type: ignore[attr-defined]

    def _link_bytes(self, layer: int, expert: int, host: ExpertWeights) -> int:
        stored = getattr(self.store, "stored_nbytes", None)
        return stored(layer, expert) if stored is not None else host.nbytes

    def _staging_lock(self) -> threading.Lock | nullcontext[None]:
        return self.staging.lock if self.staging is not None else nullcontext()

    def _host_source(self, layer: int, expert: int) -> tuple[int | None, ExpertWeights]:
        """Where the copy of this expert comes from: a staging buffer it is read into now (and
        which one), or the store's own tensors. Call under ``_staging_lock``."""
        if self.staging is None:
            return None, self.store.get(layer, expert)
        slot = self.staging.take()
        return slot, self.staging.stage(slot, self.store, layer, expert)

    def _account(self, since: float) -> float:
        now = time.perf_counter()
        self.stats.load_ms += (now - since) * 1000
        return now

    # --- decisions under the lock -------------------------------------------------------

    def _slots_used(self) -> int:
        return len(self._ready) + len(self._loading)

    def _can_start_load(self) -> bool:
        pending = bool(self._urgent or self._queue)
        return pending and not self._loading and self._slots_used() < self.max_resident

    def _take_batch(self) -> list[Key]:
        """The next load: the most urgent key, and with it every pending key of its (step, layer)
        that fits in the free slots (urgent ones first, then prefetches in order)."""
        room = self.max_resident - self._slots_used() - 1
        batch, self._urgent, self._queue = take_batch(self._urgent, self._queue, room, self.batch_loads)
        return batch

    def _make_room_for_critical(self) -> None:
        while self._slots_used() >= self.max_resident:
            victim = pick_victim(list(self._ready), self._in_use)
            if victim is None:
                return  # everything resident is being computed; the load waits for a release
            del self._ready[victim]
            self.stats.wasted_loads += 1
            # Its prediction still stands: load it again once there is room.
            self._queue.append(victim)
            self._queue.sort()

    def _resident_bytes_locked(self) -> int:
        cached = self.cache.nbytes() if self.cache is not None else 0
        return cached + sum(r.nbytes for r in self._ready.values())

    def _note_peak(self, key: Key) -> None:
        phase = "prefill" if key[0] == 0 else "decode"
        current = self._resident_bytes_locked()
        self.stats.peak_bytes[phase] = max(self.stats.peak_bytes[phase], current)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"expert loader failed: {self._error}") from self._error


# --- measuring a worker's own rates (when no emulation gives them; ``inference.policies.hybrid`` decides from them) ---


def measure_host_rates(
    store: ExpertStore, device: torch.device, act_fn: Callable[[torch.Tensor], torch.Tensor], *, rounds: int = 5
) -> HostRates:
    """This host's rates, timed on the store's own experts: one row through each of several
    experts (their weights streamed from host memory, not a cache), many rows through one (the
    arithmetic), and one expert's copy to ``device``. A few hundred milliseconds at start."""
    keys = sorted(store.keys())[:16]
    first = store.get(*keys[0])
    hidden, intermediate = first.down.shape
    nbytes = store.nbytes(*keys[0])
    one, many = torch.zeros(1, hidden, dtype=first.down.dtype), torch.zeros(64, hidden, dtype=first.down.dtype)
    weight, weights = torch.ones(1, dtype=first.down.dtype), torch.ones(64, dtype=first.down.dtype)
    reads, sums, copies = [], [], []
    for _ in range(rounds):
        for key in keys:
            started = time.perf_counter()
            expert_forward(one, weight, store.get(*key), act_fn)
            reads.append(time.perf_counter() - started)
        started = time.perf_counter()
        expert_forward(many, weights, first, act_fn)
        sums.append(time.perf_counter() - started)
        started = time.perf_counter()
        if device.type == "cuda":
            on_device = (first.gate_up.to(device, non_blocking=True), first.down.to(device, non_blocking=True))
            torch.cuda.synchronize(device)
            del on_device
        else:
            _ = (first.gate_up.clone(), first.down.clone())
        copies.append(time.perf_counter() - started)
    floor = 1e-9  # a timer tick: a tiny expert may compute faster than the clock resolves
    return HostRates(
        memory_bytes_per_s=nbytes / max(floor, statistics.median(reads)),
        flops=expert_flops(hidden, intermediate, 64) / max(floor, statistics.median(sums)),
        copy_bytes_per_s=nbytes / max(floor, statistics.median(copies)),
    )
