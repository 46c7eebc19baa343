"""Worker shards with their experts stored coded (``expert_codec="exponent-plane"``): the build
records each tensor's code and sizes, every store returns the same bits as from a plain shard while
holding and reading the coded bytes, and a bad manifest entry or blob is refused with a clear error."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from inference.building.memory import memory_from_checkpoint
from inference.building.sharding import build_shards
from inference.constants import CODED_DTYPE_BYTES
from inference.modelio import exponent_palette
from inference.modelio.checkpoint import is_expert_key, parse_expert_key
from inference.modelio.expert_codec import device_decode_scratch
from inference.modelio.shards import (
    MANIFEST_FILE,
    ShardError,
    ShardSet,
    StoredTensor,
    file_sha256,
    load_role_tensors,
    read_manifest,
    stored_tensors,
)
from inference.runtime.disk_store import DiskStore
from inference.runtime.loader import ExpertLoader
from inference.runtime.staging import StagingRing
from inference.runtime.store import HostMemoryStore, open_store
from inference.settings import DEFAULTS, DeploymentSettings, SpecError, validate_settings
from inference.tools.tiny import make_tiny

WORKERS = 2
CODED = DeploymentSettings(expert_codec="exponent-plane")


@pytest.fixture(scope="module", params=["bfloat16", "float16", "float32"])
def both(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[ShardSet, ShardSet]:
    """The same checkpoint sharded plain and coded."""
    root = tmp_path_factory.mktemp(f"coded-{request.param}")
    model = make_tiny(root / "model", seed=3, shards=2, dtype=request.param)
    plain = build_shards(model, root / "plain", workers=WORKERS)
    coded = build_shards(model, root / "coded", workers=WORKERS, expert_codec="exponent-plane")
    return plain, coded


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_the_build_records_each_coded_tensor_and_the_set_its_codec(both: tuple[ShardSet, ShardSet]) -> None:
    plain, coded = both
    assert ShardSet.load(coded.root).expert_codec == "exponent-plane"
    assert ShardSet.load(plain.root).expert_codec == "none"
    for worker in range(WORKERS):
        manifest = read_manifest(coded.worker(worker))
        stored = stored_tensors(manifest)
        plain_tensors = dict(load_role_tensors(plain.worker(worker)))
        assert set(stored) == {name for name in plain_tensors if is_expert_key(name)}
        for name, entry in stored.items():
            assert entry.raw_bytes == plain_tensors[name].nbytes
            assert entry.stored_bytes < entry.raw_bytes
        assert "stored" not in read_manifest(plain.worker(worker))
    assert "stored" not in read_manifest(coded.main) and "stored" not in read_manifest(coded.shadow)


def test_a_coded_worker_shard_loads_the_same_bits(both: tuple[ShardSet, ShardSet]) -> None:
    plain, coded = both
    for worker in range(WORKERS):
        want = dict(load_role_tensors(plain.worker(worker)))
        got = dict(load_role_tensors(coded.worker(worker)))
        assert want.keys() == got.keys()
        assert all(_same_bits(want[name], got[name]) for name in want)


@pytest.mark.parametrize("kind", ["ram", "disk", "hot"])
def test_every_store_gives_the_same_experts_from_coded_bytes(both: tuple[ShardSet, ShardSet], kind: str) -> None:
    plain, coded = both
    want = open_store("ram", plain.worker(0))
    store = open_store(kind, coded.worker(0), hot_experts=2)
    try:
        assert store.keys() == want.keys()
        for pair in sorted(store.keys()):
            got, expected = store.get(*pair), want.get(*pair)
            assert _same_bits(got.gate_up, expected.gate_up) and _same_bits(got.down, expected.down)
            assert store.nbytes(*pair) == want.nbytes(*pair)  # decoded: what the device holds
    finally:
        if kind != "ram":
            store.close()


@pytest.mark.parametrize("kind", ["ram", "disk", "hot"])
def test_every_store_hands_a_gpu_the_coded_bytes_and_they_decode_there_to_the_same_bits(
    both: tuple[ShardSet, ShardSet], kind: str
) -> None:
    """What a GPU worker's loader does with a coded expert (``CodedExpert.decode_on``), on this CPU: the
    store's coded bytes, copied and decoded by the same torch operations a GPU runs. A plain shard's
    stores have no coded bytes to give."""
    plain, coded = both
    want = open_store("ram", plain.worker(0))
    store = open_store(kind, coded.worker(0), hot_experts=2)
    uncoded = open_store(kind, plain.worker(0), hot_experts=2)
    try:
        for pair in sorted(store.keys()):
            assert store.decodes_on_device(*pair) and not uncoded.decodes_on_device(*pair)
            held = store.coded(*pair)
            assert held is not None and held.decodes_on_device and uncoded.coded(*pair) is None
            got, expected = held.decode_on(torch.device("cpu")), want.get(*pair)
            assert _same_bits(got.gate_up, expected.gate_up) and _same_bits(got.down, expected.down)
            assert held.nbytes == store.nbytes(*pair) and held.stored_nbytes == store.stored_nbytes(*pair)
        if kind == "hot":  # the coded bytes a GPU was given stay in the hot set, as those ``get`` decodes do
            assert store.reads == len(store.keys()) and store.held() == sorted(store.keys())[-2:]
    finally:
        for opened in (store, uncoded):
            if kind != "ram":
                opened.close()


def test_a_gpu_refuses_a_coded_expert_whose_planes_lie_before_it_copies_them(both: tuple[ShardSet, ShardSet]) -> None:
    # The host checks each blob's layout (escape codes against the header's count) before a device
    # decode, which could otherwise read past the escape list: a ShardError, nothing copied.
    _, coded = both
    held = open_store("ram", coded.worker(0)).coded(*min(open_store("ram", coded.worker(0)).keys()))
    assert held is not None
    blob = held.blobs[0].copy()
    _, k, _, _, _ = exponent_palette.HEADER.unpack(blob[: exponent_palette.HEADER.size].tobytes())
    words = held.codes[0].raw_bytes // 2
    planes = blob[exponent_palette.HEADER.size :][: k * ((words + 7) // 8)].reshape(k, -1)
    escaped = np.unpackbits(np.bitwise_and.reduce(planes, axis=0), bitorder="little")
    weight = int(np.flatnonzero(escaped == 0)[0])
    planes[:, weight // 8] |= np.uint8(1 << (weight % 8))  # one more escape code than escaped values listed
    lying = dataclasses.replace(held, blobs=(blob, *held.blobs[1:]))
    with pytest.raises(ShardError, match=r"does not decode.*escape codes"):
        lying.decode_on(torch.device("cpu"))


def test_the_ram_and_disk_stores_count_the_coded_bytes(both: tuple[ShardSet, ShardSet]) -> None:
    _, coded = both
    stored = stored_tensors(read_manifest(coded.worker(0)))
    ram = HostMemoryStore.from_shard(coded.worker(0))
    with DiskStore(coded.worker(0)) as disk:
        for pair in sorted(ram.keys()):
            assert ram.stored_nbytes(*pair) == disk.stored_nbytes(*pair) < ram.nbytes(*pair)
        total = sum(ram.stored_nbytes(*pair) for pair in sorted(ram.keys()))
    assert total == sum(entry.stored_bytes for entry in stored.values())


def test_a_cast_store_decodes_then_casts(both: tuple[ShardSet, ShardSet]) -> None:
    plain, coded = both
    want = open_store("ram", plain.worker(1), dtype=torch.float32)
    got = open_store("ram", coded.worker(1), dtype=torch.float32)
    for pair in sorted(want.keys()):
        assert _same_bits(got.get(*pair).gate_up, want.get(*pair).gate_up)
        assert _same_bits(got.get(*pair).down, want.get(*pair).down)


def test_a_staging_buffer_is_filled_with_decoded_bytes(both: tuple[ShardSet, ShardSet]) -> None:
    plain, coded = both
    want = open_store("ram", plain.worker(0))
    with DiskStore(coded.worker(0)) as disk:
        pair = min(disk.keys())
        ring = StagingRing(1, disk.nbytes(*pair), pin=False)
        staged = ring.stage(ring.take(), disk, *pair)
        assert _same_bits(staged.gate_up, want.get(*pair).gate_up) and _same_bits(staged.down, want.get(*pair).down)


def test_an_emulated_link_carries_the_coded_bytes(both: tuple[ShardSet, ShardSet]) -> None:
    _, coded = both
    store = HostMemoryStore.from_shard(coded.worker(0))
    pair = min(store.keys())
    loader = ExpertLoader(store, torch.device("cpu"), copy_bytes_per_s=1e12)
    try:
        assert loader._link_bytes(*pair, store.get(*pair)) == store.stored_nbytes(*pair) < store.nbytes(*pair)
    finally:
        loader.close()


def _copy_with(coded: ShardSet, tmp_path: Path, edit) -> Path:
    """Worker 0's coded shard copied, its manifest edited by ``edit(manifest, directory)``."""
    directory = tmp_path / "worker-0"
    shutil.copytree(coded.worker(0), directory)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    edit(manifest, directory)
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))
    return directory


def _first_stored(manifest: dict) -> dict:
    return manifest["stored"][sorted(manifest["stored"])[0]]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"codec": "gzip"}, "has code 'gzip'"),
        ({"dtype": "I8"}, "has dtype 'I8'"),
        ({"raw_bytes": 12}, "raw bytes do not fit"),
        ({"shape": [True]}, "malformed shape"),
        ({"stored_bytes": 7}, "the manifest lists 7 coded bytes"),
    ],
)
def test_a_bad_stored_entry_is_refused_by_name(
    both: tuple[ShardSet, ShardSet], tmp_path: Path, change: dict, message: str
) -> None:
    _, coded = both
    directory = _copy_with(coded, tmp_path, lambda manifest, _: _first_stored(manifest).update(change))
    with pytest.raises(ShardError, match=message):
        DiskStore(directory, verify=False)


def test_a_corrupted_blob_is_a_clear_error_not_a_crash(both: tuple[ShardSet, ShardSet], tmp_path: Path) -> None:
    _, coded = both

    def corrupt(manifest: dict, directory: Path) -> None:
        # The blob's coded plane begins where its tensor's data does: overwrite its header's magic, and
        # list the part's new hash, as a hostile shard built so would.
        with DiskStore(directory, verify=False) as disk:
            pair = min(disk.keys())
            span = disk._entry(*pair).gate_up[0]
            part = next(p for p in directory.glob("part-*.safetensors"))
            data = bytearray(part.read_bytes())
            data[span.offset : span.offset + 4] = b"\0\0\0\0"
            part.write_bytes(bytes(data))
        for entry in manifest["files"]:
            entry["sha256"] = file_sha256(directory / entry["path"])

    directory = _copy_with(coded, tmp_path, corrupt)
    with (
        DiskStore(directory) as disk,
        pytest.raises(
            ShardError, match=r"does not decode.*exponent plane is malformed.*starts b'\\x00\\x00\\x00\\x00'"
        ),
    ):
        disk.get(*min(disk.keys()))
    with pytest.raises(ShardError, match="does not decode"):
        dict(load_role_tensors(directory))


def test_an_unknown_codec_is_refused_by_the_build_and_the_settings(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="unknown expert codec 'gzip'"):
        build_shards(tmp_path / "no-model", tmp_path / "out", workers=1, expert_codec="gzip")
    with pytest.raises(SpecError, match="expert_codec must be one of none, exponent-plane"):
        validate_settings(dataclasses.replace(DEFAULTS, expert_codec="gzip"))


def _expert_bytes(stored: list[dict[str, StoredTensor]]) -> dict[tuple[int, int], int]:
    """Each expert's coded bytes, summed over its tensors, from the workers' manifests (an expert two
    workers hold is the same bytes in both)."""
    experts: dict[tuple[int, int], int] = {}
    for mine in stored:
        sizes: dict[tuple[int, int], int] = {}
        for name, entry in mine.items():
            key = parse_expert_key(name)
            assert key is not None
            sizes[(key.layer, key.expert)] = sizes.get((key.layer, key.expert), 0) + entry.stored_bytes
        for pair, size in sizes.items():
            assert experts.setdefault(pair, size) == size
    return experts


def test_the_memory_plan_counts_the_workers_coded_bytes(both: tuple[ShardSet, ShardSet]) -> None:
    plain, coded = both
    model = coded.root.parent / "model"
    raw = memory_from_checkpoint(model, workers=WORKERS, shards=plain.root)
    plan = memory_from_checkpoint(model, workers=WORKERS, shards=coded.root)
    assert raw == memory_from_checkpoint(model, workers=WORKERS)  # a plain set changes nothing
    with pytest.raises(ValueError, match="stores its experts with 'none'"):  # a codec the set does not hold
        memory_from_checkpoint(model, workers=WORKERS, shards=plain.root, settings=CODED)
    stored = [stored_tensors(read_manifest(coded.worker(worker))) for worker in range(WORKERS)]
    # Decoded on the device: the experts take what they took there, plus the coded bytes of the worker's
    # depth (2) of experts copied ahead of their decodes, and the largest tensor's decode scratch.
    decode = 2 * max(_expert_bytes(stored).values()) + max(
        device_decode_scratch(entry.raw_bytes // CODED_DTYPE_BYTES[entry.dtype])
        for mine in stored
        for entry in mine.values()
    )
    for worker in range(WORKERS):
        assert plan.workers[worker].disk_bytes == sum(entry.stored_bytes for entry in stored[worker].values())
        assert plan.workers[worker].disk_bytes < raw.workers[worker].disk_bytes
        assert plan.workers[worker].gpu_bytes == raw.workers[worker].gpu_bytes + decode
    assert plan.main == raw.main and plan.shadow == raw.shadow


def test_before_the_set_is_built_the_memory_plan_counts_the_most_the_code_can_store(
    both: tuple[ShardSet, ShardSet],
) -> None:
    """A coded deployment's first start is checked before its set exists: each expert the build codes is
    counted at ``stored_bound`` (never less than what the build then writes), and a worker's RAM holds its
    decoded experts in flight besides, which the raw count left out."""
    from inference.building.tensor_sizes import TensorSize, checkpoint_tensors, with_coded_bound
    from inference.modelio.checkpoint import Checkpoint
    from inference.modelio.expert_codec import stored_bound

    coded = both[1]
    model = coded.root.parent / "model"
    ckpt = Checkpoint(model)
    raw = memory_from_checkpoint(model, workers=WORKERS)
    built = memory_from_checkpoint(model, workers=WORKERS, shards=coded.root)
    bound = memory_from_checkpoint(model, workers=WORKERS, settings=CODED)
    assert memory_from_checkpoint(model, workers=WORKERS, settings=DeploymentSettings(expert_codec="none")) == raw
    # With the set built, its bytes; the codec then changes nothing.
    assert memory_from_checkpoint(model, workers=WORKERS, shards=coded.root, settings=CODED) == built
    bounded = {t.name: t for t in with_coded_bound(ckpt, checkpoint_tensors(ckpt), "exponent-plane")}
    for worker in range(WORKERS):
        stored = stored_tensors(read_manifest(coded.worker(worker)))
        assert stored and all(bounded[name].stored == stored_bound(e.raw_bytes, e.dtype) for name, e in stored.items())
        assert all(e.stored_bytes <= bounded[name].stored for name, e in stored.items())
        assert bound.workers[worker].disk_bytes == sum(bounded[name].stored for name in stored)
        assert built.workers[worker].disk_bytes <= bound.workers[worker].disk_bytes
        assert built.workers[worker].host_bytes <= bound.workers[worker].host_bytes
        # Above the raw count: the planes' bound, and the decoded experts in flight (the worker's depth, 2).
        in_flight = bound.workers[worker].host_bytes - bound.workers[worker].disk_bytes
        assert in_flight == raw.workers[worker].host_bytes - raw.workers[worker].disk_bytes + 2 * raw.expert_bytes
        # On the GPU, two experts' coded bytes at their bound and the largest tensor's decode, beside the experts.
        experts: dict[tuple[int, int], int] = {}
        for t in bounded.values():
            key = parse_expert_key(t.name)
            if t.stored is not None and key is not None:
                experts[(key.layer, key.expert)] = experts.get((key.layer, key.expert), 0) + t.stored
        decode = 2 * max(experts.values()) + max(
            device_decode_scratch(t.numel) for t in bounded.values() if t.stored is not None
        )
        assert bound.workers[worker].gpu_bytes == raw.workers[worker].gpu_bytes + decode
        assert built.workers[worker].gpu_bytes <= bound.workers[worker].gpu_bytes
    assert bound.main == raw.main and bound.shadow == raw.shadow
    # What is not an expert is counted as it is (the build codes experts only).
    odd = [TensorSize("model.norm.weight", (4,), 16)]
    assert with_coded_bound(ckpt, odd, "exponent-plane") == odd
    with pytest.raises(ValueError, match="expert_codec must be one of none, exponent-plane"):
        with_coded_bound(ckpt, odd, "zstd")


def test_the_shard_command_takes_the_codec(both: tuple[ShardSet, ShardSet], tmp_path: Path) -> None:
    from inference.__main__ import main

    model = both[1].root.parent / "model"
    assert main(["shard", str(model), str(tmp_path / "out"), "--workers", "1", "--expert-codec", "exponent-plane"]) == 0
    assert ShardSet.load(tmp_path / "out").expert_codec == "exponent-plane"
    assert stored_tensors(read_manifest(tmp_path / "out" / "worker-0"))


def test_the_predictions_decode_measure_codes_one_expert_of_the_run(both: tuple[ShardSet, ShardSet]) -> None:
    from benchmarks.sim_prediction import measure_decode

    measured = measure_decode(both[1].root.parent / "model", repeats=2)
    assert 0 < measured["stored_bytes"] < measured["expert_bytes"]
    assert measured["ratio"] == measured["stored_bytes"] / measured["expert_bytes"]
    assert measured["decode_s"] > 0


def test_the_hot_store_keeps_its_hot_set_coded(both: tuple[ShardSet, ShardSet]) -> None:
    plain, coded = both
    want = open_store("ram", plain.worker(0))
    hot = open_store("hot", coded.worker(0), hot_experts=2)
    try:
        pairs = sorted(hot.keys())[:3]
        for pair in [*pairs, pairs[-1]]:  # the last one twice: a hit, decoded again from the coded bytes
            got = hot.get(*pair)
            assert _same_bits(got.gate_up, want.get(*pair).gate_up) and _same_bits(got.down, want.get(*pair).down)
        assert (hot.reads, hot.hits) == (3, 1)
        assert hot.resident_bytes() == sum(hot.stored_nbytes(*pair) for pair in hot.held())
        assert hot.resident_bytes() < sum(hot.nbytes(*pair) for pair in hot.held())
    finally:
        hot.close()
