"""Expert stores: the disk store reads exactly what the RAM store holds, without holding it."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from inference.building.sharding import build_shards
from inference.modelio.checkpoint import expert_key_name, parse_expert_key
from inference.modelio.shards import ShardError, ShardSet, role_experts, verify_shard
from inference.runtime.disk_store import DiskStore
from inference.runtime.experts import ExpertWeights, fuse_expert
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.loader import ExpertLoader
from inference.runtime.spec import DeploymentSettings, SpecError, validate_settings
from inference.runtime.store import HostMemoryStore, open_store
from inference.sim.hardware import get_profile, with_host_to_device
from inference.sim.model_sizes import mixtral_8x7b
from inference.tools.emulation import emulation_for, real_times
from inference.tools.tiny import make_tiny
from tests.reference import PROMPTS, reference_generate

WORKERS = 4


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def shards(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ShardSet:
    root = tmp_path_factory.mktemp(f"store-{request.param}")
    model = make_tiny(root / "model", seed=0, shards=3, dtype=request.param)
    return build_shards(model, root / "shards", workers=WORKERS)


def reference_experts(shard_dir: Path) -> dict[tuple[int, int], ExpertWeights]:
    """The shard's experts read by the safetensors library itself and fused by ``fuse_expert``."""
    tensors = {}
    for part in sorted(shard_dir.glob("part-*.safetensors")):
        tensors.update(load_file(part))
    keys = {(k.layer, k.expert) for k in map(parse_expert_key, tensors) if k is not None}
    return {
        (layer, expert): fuse_expert(*(tensors[expert_key_name(layer, expert, proj)] for proj in ("w1", "w2", "w3")))
        for layer, expert in keys
    }


def same_bits(a: ExpertWeights, b: ExpertWeights) -> bool:
    return all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in ((a.gate_up, b.gate_up), (a.down, b.down))
    )


@pytest.mark.parametrize("worker", range(WORKERS))
def test_both_stores_hold_bit_identical_experts(shards: ShardSet, worker: int) -> None:
    want = reference_experts(shards.worker(worker))
    ram = HostMemoryStore.from_shard(shards.worker(worker))
    with DiskStore(shards.worker(worker)) as disk:
        assert disk.keys() == ram.keys() == set(want) == set(role_experts(verify_shard(shards.worker(worker))))
        for layer, expert in sorted(want):
            assert disk.nbytes(layer, expert) == ram.nbytes(layer, expert) == want[(layer, expert)].nbytes
            assert same_bits(disk.get(layer, expert), want[(layer, expert)]), (layer, expert)
            assert same_bits(ram.get(layer, expert), want[(layer, expert)]), (layer, expert)


def test_each_get_is_a_fresh_copy(shards: ShardSet) -> None:
    # The loader's CPU paths may keep a returned expert as "the device copy": reads must not alias.
    with DiskStore(shards.worker(0)) as disk:
        key = min(disk.keys())
        first = disk.get(*key)
        first.gate_up.zero_()
        assert same_bits(disk.get(*key), reference_experts(shards.worker(0))[key])


@pytest.mark.parametrize("kind", ["ram", "disk"])
def test_a_missing_expert_is_a_clear_key_error(shards: ShardSet, kind: str) -> None:
    store = open_store(kind, shards.worker(1))
    absent = (shards.placement.n_layers, 0)
    with pytest.raises(KeyError, match="expert 0 of layer 4 is not in this worker's store"):
        store.get(*absent)
    with pytest.raises(KeyError, match="expert 0 of layer 4"):
        store.nbytes(*absent)


def test_a_shard_that_fails_verification_is_refused(shards: ShardSet, tmp_path: Path) -> None:
    copy = tmp_path / "worker-0"
    shutil.copytree(shards.worker(0), copy)
    part = sorted(copy.glob("part-*.safetensors"))[0]
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of an expert, same size: only the hash can tell
    part.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="sha256 mismatch"):
        DiskStore(copy)
    with pytest.raises(ShardError, match="is a 'main' shard, expected a 'worker' shard"):
        DiskStore(shards.main)


def test_the_copy_thread_loads_from_the_disk_store(shards: ShardSet) -> None:
    want = reference_experts(shards.worker(2))
    with DiskStore(shards.worker(2)) as disk:
        loader = ExpertLoader(disk, torch.device("cpu"))
        try:
            keys = sorted(disk.keys())[:4]
            for layer, expert in keys:
                loader.prefetch((1, layer, expert))
                resident, predicted, _ = loader.acquire((1, layer, expert), timeout_s=30)
                assert predicted and same_bits(resident.weights, want[(layer, expert)])
                loader.release((1, layer, expert))
        finally:
            loader.close()


def test_emulated_disk_bandwidth_is_one_shared_token_bucket(shards: ShardSet) -> None:
    with DiskStore(shards.worker(0)) as probe:
        key = min(probe.keys())
        nbytes = probe.nbytes(*key)
    floor_s = 0.1
    with DiskStore(shards.worker(0), read_bytes_per_s=nbytes / floor_s) as disk:
        start = time.perf_counter()
        disk.get(*key)
        assert time.perf_counter() - start >= floor_s
        # Two readers at once share the disk: both reads end no sooner than 2 floors after the start.
        start = time.perf_counter()
        threads = [threading.Thread(target=disk.get, args=key) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert time.perf_counter() - start >= 2 * floor_s


def test_bad_store_settings_are_refused(shards: ShardSet) -> None:
    with pytest.raises(SpecError, match="expert_store must be one of ram, disk, hot, got 'tape'"):
        validate_settings(DeploymentSettings(expert_store="tape"))
    with pytest.raises(SpecError, match="disk_bytes_per_s must be > 0"):
        validate_settings(DeploymentSettings(expert_store="disk", disk_bytes_per_s=0.0))
    with pytest.raises(ValueError, match="expert store must be one of ram, disk"):
        open_store("tape", shards.worker(0))


def test_emulation_scales_disk_reads_like_copies() -> None:
    profile = get_profile("3090-pcie4-1gbe")
    assert profile.disk_read == 3.5e9
    assert with_host_to_device(profile, 8e9).disk_read == profile.disk_read
    here_s, expert_bytes = 0.002, 10_000_000
    emulation = emulation_for(profile.name, here_s, expert_bytes, 2048)
    compute, _, _ = real_times(profile)
    real_read = mixtral_8x7b().expert_bytes(16) / profile.disk_read  # ~0.1 s per Mixtral expert
    assert expert_bytes / emulation.disk_bytes_per_s / here_s == pytest.approx(real_read / compute)
    assert emulation.settings(DeploymentSettings()).disk_bytes_per_s == emulation.disk_bytes_per_s


@pytest.mark.slow
def test_a_cluster_on_disk_stores_gives_the_reference_tokens(tiny_model: Path) -> None:
    options = ClusterOptions(workers=3, settings=DeploymentSettings(expert_store="disk"), in_process=True)
    with LocalCluster(tiny_model, options) as cluster:
        results = [cluster.generate(prompt, 24) for prompt in PROMPTS[:2]]
    for prompt, result in zip(PROMPTS[:2], results, strict=True):
        assert result.token_ids == reference_generate(tiny_model, prompt, 24)


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc")


@pytest.mark.slow
def test_a_disk_worker_does_not_hold_its_experts_in_ram(tmp_path: Path) -> None:
    # 2 workers of top-2 form one group, so each owns all 64 experts: 64 x 5.5 MB = 352 MB.
    model = make_tiny(tmp_path / "model", seed=0, layers=8, hidden=512, intermediate=1792, dtype="bfloat16")
    peaks, tokens = {}, {}
    for kind in ("ram", "disk"):
        # Fresh processes: a worker's peak RSS is the point, not a zygote's imported pages.
        options = ClusterOptions(workers=2, shadow=False, settings=DeploymentSettings(expert_store=kind), spawn="exec")
        with LocalCluster(model, options, work_dir=tmp_path / "work") as cluster:
            tokens[kind] = cluster.generate(PROMPTS[0], 4).token_ids
            peaks[kind] = _peak_rss_bytes(cluster.processes["worker-0"].pid)
    with DiskStore(tmp_path / "work" / "shards" / "worker-0") as disk:
        owned = sum(disk.nbytes(layer, expert) for layer, expert in sorted(disk.keys()))
    assert owned > 300e6
    assert tokens["ram"] == tokens["disk"]
    ram_mb, disk_mb = peaks["ram"] / 1e6, peaks["disk"] / 1e6
    print(f"worker peak RSS: ram {ram_mb:.0f} MB, disk {disk_mb:.0f} MB, owned experts {owned / 1e6:.0f} MB")
    # Measured here (3 runs): ram 717-722 MB, disk 391-403 MB for 352 MB owned, a difference of
    # ~0.92 x owned: the disk worker still holds the experts in flight and its allocator keeps some
    # of their freed buffers. 0.8 x owned leaves ~40 MB for run-to-run allocator and import noise.
    assert peaks["ram"] - peaks["disk"] >= 0.8 * owned
