"""The just-in-time expert loader on CPU, against a tiny in-memory ExpertStore."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from inference.runtime.experts import ExpertWeights
from inference.runtime.loader import ExpertLoader, pick_victim

CPU = torch.device("cpu")
H, I = 8, 12  # noqa: E741


class MemoryStore:
    """An ExpertStore holding a few small experts in a dict; ``get`` can be made to misbehave."""

    def __init__(self, n_layers: int = 2, n_experts: int = 6, on_get: Callable[[], None] | None = None):
        g = torch.Generator().manual_seed(0)
        self._experts = {
            (layer, e): ExpertWeights(torch.randn(2 * I, H, generator=g), torch.randn(H, I, generator=g))
            for layer in range(n_layers)
            for e in range(n_experts)
        }
        self.on_get = on_get
        self.gets: list[tuple[int, int]] = []

    def keys(self) -> frozenset[tuple[int, int]]:
        return frozenset(self._experts)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        self.gets.append((layer, expert))
        if self.on_get is not None:
            self.on_get()
        return self._experts[(layer, expert)]

    def nbytes(self, layer: int, expert: int) -> int:
        return self._experts[(layer, expert)].nbytes


EXPERT_BYTES = (2 * I * H + H * I) * 4


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def make_loader(store: MemoryStore) -> Iterator[Callable[..., ExpertLoader]]:
    loaders: list[ExpertLoader] = []

    def make(**kwargs) -> ExpertLoader:
        loader = ExpertLoader(kwargs.pop("store", store), CPU, **kwargs)
        loaders.append(loader)
        return loader

    yield make
    for loader in loaders:
        loader.close()


def _wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def test_store_is_an_expert_store(store: MemoryStore) -> None:
    assert store.nbytes(0, 0) == EXPERT_BYTES
    assert len(store.keys()) == 12


def test_prefetch_then_acquire_is_a_predicted_hit(make_loader, store: MemoryStore) -> None:
    loader = make_loader()
    key = (1, 0, 3)
    loader.prefetch(key)
    _wait_until(lambda: loader.resident_bytes() == EXPERT_BYTES)
    resident, predicted, wait_ms = loader.acquire(key, timeout_s=5)
    assert predicted is True
    assert wait_ms < 100
    assert resident.nbytes == EXPERT_BYTES
    source = store._experts[(0, 3)]
    assert torch.equal(resident.weights.gate_up, source.gate_up)
    assert torch.equal(resident.weights.down, source.down)
    # A fresh buffer, as a device copy would be: the store's tensors are not handed out.
    assert resident.weights.gate_up.data_ptr() != source.gate_up.data_ptr()
    assert (loader.stats.hits, loader.stats.misses, loader.stats.loads) == (1, 0, 1)
    loader.release(key)
    assert loader.resident_bytes() == 0


def test_acquire_without_prefetch_is_a_miss(make_loader, store: MemoryStore) -> None:
    loader = make_loader()
    resident, predicted, _ = loader.acquire((2, 1, 5), timeout_s=5)
    assert predicted is False
    assert torch.equal(resident.weights.down, store._experts[(1, 5)].down)
    assert (loader.stats.hits, loader.stats.misses, loader.stats.loads) == (0, 1, 1)
    assert store.gets == [(1, 5)]
    loader.release((2, 1, 5))


def test_prefetching_many_never_exceeds_max_resident(make_loader, store: MemoryStore) -> None:
    loader = make_loader(max_resident=2)
    keys = [(step, layer, e) for step in (0, 1) for layer in range(2) for e in range(6)]
    for key in keys:
        loader.prefetch(key)
    _wait_until(lambda: loader.stats.loads == 2)
    time.sleep(0.05)
    assert loader.stats.loads == 2  # both slots full: nothing more is copied
    assert loader.resident_bytes() == 2 * EXPERT_BYTES
    for key in keys:
        assert loader.resident_bytes() <= 2 * EXPERT_BYTES
        _, predicted, _ = loader.acquire(key, timeout_s=5)
        assert predicted
        assert loader.resident_bytes() <= 2 * EXPERT_BYTES
        loader.release(key)
    assert store.gets == [(layer, e) for _, layer, e in keys]
    assert loader.stats.loads == len(keys)
    assert loader.stats.hits == len(keys) and loader.stats.misses == 0
    for phase in ("prefill", "decode"):
        assert 0 < loader.stats.peak_bytes[phase] <= 2 * EXPERT_BYTES, loader.stats.peak_bytes
    _wait_until(lambda: loader.resident_bytes() == 0)


def test_max_resident_one(make_loader) -> None:
    loader = make_loader(max_resident=1)
    keys = [(1, 0, e) for e in range(4)]
    for key in keys:
        loader.prefetch(key)
    for key in keys:
        _, predicted, _ = loader.acquire(key, timeout_s=5)
        assert predicted
        assert loader.resident_bytes() == EXPERT_BYTES
        loader.release(key)
    assert loader.stats.peak_bytes["decode"] == EXPERT_BYTES


def test_bad_max_resident() -> None:
    with pytest.raises(ValueError, match="max_resident"):
        ExpertLoader(MemoryStore(), CPU, max_resident=0)


def test_pick_victim_is_the_one_needed_last() -> None:
    resident = [(1, 2, 0), (2, 0, 1), (1, 3, 5), (2, 0, 0)]
    assert pick_victim(resident, set()) == (2, 0, 1)
    assert pick_victim(resident, {(2, 0, 1)}) == (2, 0, 0)
    assert pick_victim(resident, set(resident)) is None
    assert pick_victim([], set()) is None


def test_critical_acquire_evicts_the_prefetch_needed_last(make_loader, store: MemoryStore) -> None:
    loader = make_loader(max_resident=2)
    loader.prefetch((1, 0, 1))
    loader.prefetch((1, 1, 2))
    _wait_until(lambda: loader.stats.loads == 2)
    # Never predicted: jumps the queue and pushes out (1, 1, 2), needed after (1, 0, 1).
    _, predicted, _ = loader.acquire((1, 0, 0), timeout_s=5)
    assert not predicted
    assert loader.stats.wasted_loads == 1
    assert loader.stats.loads == 3
    assert loader.resident_bytes() == 2 * EXPERT_BYTES
    # The one kept is still resident: acquiring it loads nothing.
    _, predicted, _ = loader.acquire((1, 0, 1), timeout_s=5)
    assert predicted and loader.stats.loads == 3
    loader.release((1, 0, 0))
    loader.release((1, 0, 1))
    # The evicted prediction still stands and is loaded again once there is room.
    _, predicted, _ = loader.acquire((1, 1, 2), timeout_s=5)
    assert predicted
    assert loader.stats.loads == 4
    assert store.gets == [(0, 1), (1, 2), (0, 0), (1, 2)]
    loader.release((1, 1, 2))


def test_critical_acquire_waits_while_everything_is_in_use(make_loader) -> None:
    loader = make_loader(max_resident=1)
    loader.acquire((1, 0, 0), timeout_s=5)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(loader.acquire((1, 0, 1), timeout_s=5)[1]))
    waiter.start()
    time.sleep(0.05)
    assert not got and loader.stats.loads == 1  # nothing to evict: it waits for a release
    loader.release((1, 0, 0))
    waiter.join(5)
    assert got == [False]
    loader.release((1, 0, 1))


def test_discard_drops_queued_prefetches(make_loader) -> None:
    loader = make_loader(max_resident=1)
    keys = [(1, 0, e) for e in range(4)]
    for key in keys:
        loader.prefetch(key)
    _wait_until(lambda: loader.stats.loads == 1)
    loader.discard(lambda key: key in {(1, 0, 0), (1, 0, 2)})
    _, predicted, _ = loader.acquire((1, 0, 0), timeout_s=5)
    assert predicted
    loader.release((1, 0, 0))
    _wait_until(lambda: loader.stats.loads == 2)  # (1, 0, 2) is still wanted
    time.sleep(0.05)
    assert loader.stats.loads == 2  # (1, 0, 1) and (1, 0, 3) were dropped
    # Discarding an idle resident prefetch frees it and counts it as wasted.
    assert loader.resident_bytes() == EXPERT_BYTES
    loader.discard(lambda key: False)
    assert loader.resident_bytes() == 0
    assert loader.stats.wasted_loads == 1
    # A dropped key can still be computed: it is loaded as a miss.
    _, predicted, _ = loader.acquire((1, 0, 3), timeout_s=5)
    assert not predicted
    loader.release((1, 0, 3))


def test_release_frees_at_once(make_loader) -> None:
    loader = make_loader(max_resident=3)
    keys = [(1, 0, e) for e in range(3)]
    for key in keys:
        loader.acquire(key, timeout_s=5)
    assert loader.resident_bytes() == 3 * EXPERT_BYTES
    for n, key in enumerate(keys, start=1):
        loader.release(key)
        assert loader.resident_bytes() == (3 - n) * EXPERT_BYTES
    assert loader.resident_bytes() == 0
    loader.release((9, 9, 9))  # releasing something unknown is harmless


def test_emulated_bandwidth_sets_a_floor_on_load_time(make_loader) -> None:
    floor_s = 0.15
    loader = make_loader(copy_bytes_per_s=EXPERT_BYTES / floor_s)
    start = time.perf_counter()
    _, predicted, wait_ms = loader.acquire((1, 0, 0), timeout_s=5)
    elapsed = time.perf_counter() - start
    assert not predicted
    assert elapsed >= floor_s
    assert wait_ms >= floor_s * 1000
    assert loader.stats.load_ms >= floor_s * 1000
    loader.release((1, 0, 0))


def test_store_failure_surfaces_from_acquire(make_loader) -> None:
    def broken() -> None:
        raise OSError("disk on fire")

    loader = make_loader(store=MemoryStore(on_get=broken))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="disk on fire"):
        loader.acquire((1, 0, 0), timeout_s=10)
    assert time.monotonic() - start < 2
    # Later calls fail the same way instead of hanging.
    with pytest.raises(RuntimeError, match="expert loader failed"):
        loader.acquire((1, 0, 1), timeout_s=10)


def test_missing_key_surfaces_from_acquire(make_loader) -> None:
    loader = make_loader()
    with pytest.raises(RuntimeError, match=r"\(7, 7\)"):
        loader.acquire((1, 7, 7), timeout_s=10)


def test_acquire_times_out(make_loader) -> None:
    gate = threading.Event()
    loader = make_loader(store=MemoryStore(on_get=lambda: gate.wait(10)))
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"\(1, 0, 0\)"):
            loader.acquire((1, 0, 0), timeout_s=0.2)
        assert time.monotonic() - start < 2
    finally:
        gate.set()


def test_reset_stats(make_loader) -> None:
    loader = make_loader()
    loader.acquire((1, 0, 0), timeout_s=5)
    loader.release((1, 0, 0))
    loader.reset_stats()
    assert (loader.stats.loads, loader.stats.hits, loader.stats.misses) == (0, 0, 0)
    assert loader.stats.peak_bytes == {"prefill": 0, "decode": 0}


SLOW_S = 0.15


def test_critical_acquire_during_a_prefetch_copy_with_one_slot(make_loader, store: MemoryStore) -> None:
    """The copy in flight cannot be evicted; once it lands it must make way for the waiting load."""
    loader = make_loader(max_resident=1, copy_bytes_per_s=EXPERT_BYTES / SLOW_S)
    loader.prefetch((1, 1, 1))
    _wait_until(lambda: len(store.gets) == 1)  # the copy has started
    _, predicted, _ = loader.acquire((1, 0, 2), timeout_s=4 * SLOW_S)
    assert not predicted
    assert loader.resident_bytes() == EXPERT_BYTES
    assert loader.stats.wasted_loads == 1
    loader.release((1, 0, 2))
    # The pushed-out prediction still stands and comes back.
    _, predicted, _ = loader.acquire((1, 1, 1), timeout_s=4 * SLOW_S)
    assert predicted
    loader.release((1, 1, 1))


# --- known bugs ----------------------------------------------------------------------------


def test_acquire_of_a_key_discarded_while_loading(make_loader, store: MemoryStore) -> None:
    loader = make_loader(copy_bytes_per_s=EXPERT_BYTES / SLOW_S)
    loader.prefetch((1, 0, 1))
    _wait_until(lambda: len(store.gets) == 1)  # the copy has started
    loader.discard(lambda key: False)
    loader.acquire((1, 0, 1), timeout_s=4 * SLOW_S)


def test_prefetch_of_a_key_discarded_while_loading(make_loader, store: MemoryStore) -> None:
    loader = make_loader(copy_bytes_per_s=EXPERT_BYTES / SLOW_S)
    loader.prefetch((0, 0, 1))
    _wait_until(lambda: len(store.gets) == 1)  # the copy has started
    loader.discard(lambda key: False)  # e.g. a new request's Begin
    loader.prefetch((0, 0, 1))  # ... which prefetches the same prefill expert again
    loader.acquire((0, 0, 1), timeout_s=4 * SLOW_S)


def test_a_layers_experts_are_loaded_as_one_batch(make_loader, store: MemoryStore) -> None:
    """Fine-grained experts: every pending expert of one (step, layer) that fits the free slots is
    copied in one pass; another layer's start a pass of their own; the slots still bound it."""
    gate = threading.Event()
    store.on_get = gate.wait  # holds a copy until every prefetch meant to queue behind it is queued
    loader = make_loader(max_resident=4)

    def queued_behind(blocker: tuple[int, int, int], keys: list[tuple[int, int, int]]) -> None:
        gate.clear()
        loader.prefetch(blocker)  # a pass of one, held in the store
        _wait_until(lambda: store.gets[-1:] == [blocker[1:]])
        for key in keys:
            loader.prefetch(key)
        gate.set()

    layer0 = [(1, 0, e) for e in (4, 0, 2)]
    layer1 = [(1, 1, e) for e in (1, 3)]
    queued_behind((1, 0, 5), layer1 + layer0)
    _wait_until(lambda: loader.stats.loads == 4)
    time.sleep(0.05)
    # (1,0,5) alone, then the rest of layer 0 in one pass (3 more fill the 4 slots); layer 1 waits.
    assert (loader.stats.loads, loader.stats.batches) == (4, 2)
    assert store.gets[1:] == [(0, 0), (0, 2), (0, 4)]  # in the order they are needed
    for key in [(1, 0, 5), *layer0]:
        assert loader.acquire(key, timeout_s=5)[1]
        loader.release(key)
    _wait_until(lambda: loader.stats.loads == 6)  # layer 1, in passes as slots freed
    for key in layer1:
        loader.acquire(key, timeout_s=5)
        loader.release(key)
    passes = loader.stats.batches
    queued_behind((2, 0, 1), [(2, 1, e) for e in (0, 5, 2)])
    _wait_until(lambda: loader.stats.loads == 10)
    assert loader.stats.batches == passes + 2  # the blocker, then all three of layer 1 together


def test_batching_can_be_turned_off_for_a_side_by_side_measurement(make_loader, store: MemoryStore) -> None:
    loader = make_loader(max_resident=4, batch_loads=False)
    keys = [(1, 0, e) for e in range(4)]
    for key in keys:
        loader.prefetch(key)
    _wait_until(lambda: loader.stats.loads == 4)
    assert loader.stats.batches == 4
    for key in keys:
        loader.acquire(key, timeout_s=5)
        loader.release(key)
