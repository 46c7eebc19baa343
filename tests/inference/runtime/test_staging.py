"""Rotating staging buffers: experts read through them arrive bit for bit, and a buffer is reused
only once the copy out of it is done."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from inference.building.sharding import build_shards
from inference.modelio.shards import ShardSet
from inference.runtime.disk_store import DiskStore, HotSetStore
from inference.runtime.experts import ExpertWeights
from inference.runtime.loader import ExpertLoader
from inference.runtime.spec import DeploymentSettings, SpecError, validate_settings
from inference.runtime.staging import StagingRing, expert_views
from inference.runtime.store import HostMemoryStore
from inference.tools.tiny import make_tiny
from tests.inference.runtime.test_store import reference_experts, same_bits

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["float32", "bfloat16", "float16"])
def shards(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ShardSet:
    root = tmp_path_factory.mktemp(f"staging-{request.param}")
    model = make_tiny(root / "model", seed=1, shards=3, dtype=request.param)
    return build_shards(model, root / "shards", workers=2)


class CopyDone:
    """What a CUDA event says of a copy on the copy stream, for a machine with no GPU: done once
    ``finish`` is called (by another thread, as a DMA engine finishes on its own)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def finish(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


def test_expert_views_lay_gate_up_then_down_in_one_buffer() -> None:
    buffer = torch.zeros(64, dtype=torch.uint8)
    out = expert_views(buffer, (torch.Size([4, 3]), torch.Size([3, 2]), torch.bfloat16))
    assert (out.gate_up.shape, out.down.shape, out.gate_up.dtype) == ((4, 3), (3, 2), torch.bfloat16)
    out.down.fill_(1.0)
    assert out.down.data_ptr() == buffer.data_ptr() + 4 * 3 * 2
    assert buffer[:24].eq(0).all() and not buffer[24:36].eq(0).all() and buffer[36:].eq(0).all()
    with pytest.raises(ValueError, match="does not fit a 64-byte buffer"):
        expert_views(buffer, (torch.Size([8, 4]), torch.Size([4, 4]), torch.float32))


def test_buffers_are_handed_out_in_turn_and_reused_only_once_their_copy_is_done() -> None:
    ring = StagingRing(2, 16, pin=False)
    assert (ring.slots, ring.nbytes) == (2, 32)
    first = ring.take()
    copy_out_of_first = CopyDone()
    ring.copied(first, copy_out_of_first)
    second = ring.take()
    ring.copied(second, None)  # done at once, as a copy on CPU
    assert (first, second) == (0, 1)
    finisher = threading.Timer(0.2, copy_out_of_first.finish)
    started = time.perf_counter()
    finisher.start()
    assert ring.take() == first  # its turn again: it waits for the copy out of it
    assert copy_out_of_first.query() and time.perf_counter() - started >= 0.15
    assert ring.stalls == 1 and ring.stall_ms >= 150
    ring.copied(first, None)
    assert ring.take() == second and ring.stalls == 1  # nothing in flight: no wait


def test_a_ring_needs_a_slot_and_bytes() -> None:
    with pytest.raises(ValueError, match="at least 1 slot"):
        StagingRing(0, 16, pin=False)
    with pytest.raises(ValueError, match="at least 1 byte"):
        StagingRing(1, 0, pin=False)
    with pytest.raises(SpecError, match="staging_buffers"):
        validate_settings(DeploymentSettings(staging_buffers=0))


def test_the_disk_store_reads_straight_into_a_buffer(shards: ShardSet) -> None:
    want = reference_experts(shards.worker(0))
    with DiskStore(shards.worker(0)) as disk:
        largest = max(disk.nbytes(*pair) for pair in sorted(disk.keys()))
        ring = StagingRing(1, largest, pin=False)
        for pair in sorted(disk.keys()):
            with ring.lock:
                slot = ring.take()
                staged = ring.stage(slot, disk, *pair)
                ring.copied(slot, None)
            assert same_bits(staged, want[pair])
            assert staged.gate_up.data_ptr() == ring._buffers[slot].data_ptr()  # no copy in between


def test_a_cast_on_reading_lands_in_the_buffer_in_the_compute_dtype(shards: ShardSet) -> None:
    want = reference_experts(shards.worker(1))
    with DiskStore(shards.worker(1), dtype=torch.float32) as disk:
        pair = min(disk.keys())
        out = expert_views(torch.empty(disk.nbytes(*pair), dtype=torch.uint8), disk.expert_layout(*pair))
        disk.read_into(*pair, out)
        expected = ExpertWeights(want[pair].gate_up.float(), want[pair].down.float())
        assert same_bits(out, expected)
        wrong = ExpertWeights(out.down, out.gate_up)
        with pytest.raises(ValueError, match="not laid out as"):
            disk.read_into(*pair, wrong)


@pytest.mark.parametrize("kind", ["disk", "hot", "ram"])
def test_a_loader_staging_its_copies_hands_out_every_expert_bit_for_bit(shards: ShardSet, kind: str) -> None:
    """Each expert read into a buffer in turn and its "device" copy taken from there: earlier
    copies stay right while later reads overwrite the buffers."""
    want = reference_experts(shards.worker(0))
    disk = DiskStore(shards.worker(0))
    store = {
        "disk": disk,
        "hot": HotSetStore(disk, 2),
        "ram": HostMemoryStore.from_shard(shards.worker(0)),
    }[kind]
    loader = ExpertLoader(store, CPU, max_resident=4, staging_slots=2)
    try:
        assert loader.staging is not None and loader.staging.slot_bytes == max(
            disk.nbytes(*p) for p in sorted(disk.keys())
        )
        keys = [(1, layer, expert) for layer, expert in sorted(store.keys())]
        for start in range(0, len(keys), 4):
            group = keys[start : start + 4]
            for key in group:
                loader.prefetch(key)
            held = [loader.acquire(key, timeout_s=30)[0] for key in group]  # 4 copies through 2 buffers
            for key, resident in zip(group, held, strict=True):
                assert same_bits(resident.weights, want[key[1:]]), key
                loader.release(key)
        assert loader.stats.loads == len(keys)
    finally:
        loader.close()
        disk.close()


def test_a_staging_loader_under_emulated_copies_still_hands_out_its_own_copies(shards: ShardSet) -> None:
    want = reference_experts(shards.worker(1))
    with DiskStore(shards.worker(1)) as disk:
        pair = min(disk.keys())
        loader = ExpertLoader(disk, CPU, max_resident=2, staging_slots=1, copy_bytes_per_s=disk.nbytes(*pair) / 0.05)
        try:
            first, second = sorted(disk.keys())[:2]
            loader.prefetch((1, *first))
            loader.prefetch((1, *second))
            started = time.perf_counter()
            a = loader.acquire((1, *first), timeout_s=30)[0]
            b = loader.acquire((1, *second), timeout_s=30)[0]
            assert time.perf_counter() - started >= 0.09  # two emulated copies of 50 ms
            assert same_bits(a.weights, want[first]) and same_bits(b.weights, want[second])
        finally:
            loader.close()


def test_the_ring_has_no_more_buffers_than_a_copy_pass_holds(shards: ShardSet) -> None:
    with DiskStore(shards.worker(0)) as disk:
        loader = ExpertLoader(disk, CPU, max_resident=2, staging_slots=3)
        try:
            assert loader.staging is not None and loader.staging.slots == 2
        finally:
            loader.close()


def test_a_negative_slot_count_is_refused(shards: ShardSet) -> None:
    with DiskStore(shards.worker(0)) as disk, pytest.raises(ValueError, match="staging_slots must be >= 0"):
        ExpertLoader(disk, CPU, staging_slots=-1)
