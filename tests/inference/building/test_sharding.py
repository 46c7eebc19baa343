"""Building role shards from a checkpoint, and refusing shards that don't match their manifest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from inference.building.sharding import build_shards
from inference.constants import SIMILARITY_FILE
from inference.modelio.checkpoint import Checkpoint, is_expert_key, parse_expert_key
from inference.modelio.shards import ShardError, ShardSet, load_role_tensors, verify_shard
from inference.policies.placement import placement
from inference.tools.tiny import make_tiny

WORKERS = 4  # 4 layers, top_k 2: two decode groups, so workers really own different experts
MAX_FILE_BYTES = 60_000  # smaller than the embedding table (512 x 64 x 4 bytes)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("model") / "tiny", shards=2)


@pytest.fixture(scope="module")
def built(model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[ShardSet, list[tuple[int, int]]]:
    calls: list[tuple[int, int]] = []
    out = tmp_path_factory.mktemp("shards") / "set"
    shard_set = build_shards(
        model, out, workers=WORKERS, max_file_bytes=MAX_FILE_BYTES, progress=lambda d, t: calls.append((d, t))
    )
    return shard_set, calls


@pytest.fixture
def shards(built: tuple[ShardSet, list[tuple[int, int]]]) -> ShardSet:
    return built[0]


def _names(role_dir: Path) -> list[str]:
    return [name for name, _ in load_role_tensors(role_dir)]


def test_roles_hold_the_right_tensors(model: Path, shards: ShardSet) -> None:
    ckpt = Checkpoint(model)
    main = _names(shards.main)
    assert sorted(main) == sorted(k for k in ckpt if not is_expert_key(k))
    assert "model.layers.3.block_sparse_moe.gate.weight" in main  # routers live in main
    assert sorted(_names(shards.shadow)) == sorted(ckpt.keys())
    plan = placement(4, 8, 2, WORKERS)
    union = set()
    for worker in range(WORKERS):
        experts = {parse_expert_key(name) for name in _names(shards.worker(worker))}
        assert None not in experts
        pairs = {(e.layer, e.expert) for e in experts}
        assert pairs == plan.owned(worker)
        assert len(experts) == 3 * len(pairs)  # w1, w2 and w3 of each
        assert pairs != {(layer, e) for layer in range(4) for e in range(8)}  # a real split
        union |= pairs
    assert union == {(layer, e) for layer in range(4) for e in range(8)}


def test_tensors_byte_equal_to_source(model: Path, shards: ShardSet) -> None:
    ckpt = Checkpoint(model)
    for role_dir in (shards.main, shards.shadow, shards.worker(2)):
        for name, tensor in load_role_tensors(role_dir):
            source = ckpt.tensor(name)
            assert tensor.dtype == source.dtype and torch.equal(tensor, source), (role_dir, name)


def test_parts_respect_max_file_bytes(shards: ShardSet) -> None:
    parts = sorted(shards.shadow.glob("part-*.safetensors"))
    assert len(parts) > 5
    assert parts[0].name == "part-00001.safetensors"
    oversized = 0
    for part in parts:
        with safe_open(str(part), framework="pt") as handle:
            count = len(handle.keys())
        if part.stat().st_size > MAX_FILE_BYTES:
            assert count == 1, part  # only a tensor bigger than the limit may exceed it, alone
            oversized += 1
    assert oversized == 2  # embed_tokens and lm_head


def test_manifests_and_set_index(model: Path, shards: ShardSet) -> None:
    plan = placement(4, 8, 2, WORKERS)
    for role, worker, directory in [("main", None, shards.main), ("shadow", None, shards.shadow)] + [
        ("worker", i, shards.worker(i)) for i in range(WORKERS)
    ]:
        manifest = verify_shard(directory, expect_role=role, expect_worker=worker)
        assert manifest["format"] == "odmoe-shard/1"
        assert (manifest["role"], manifest["worker"]) == (role, worker)
        assert manifest["placement"] == plan.to_dict()
        listed = {entry["path"] for entry in manifest["files"]}
        assert listed == {p.name for p in directory.iterdir()} - {"manifest.json"}
        assert "config.json" in listed
        assert ("tokenizer.json" in listed) == (role != "worker")
        if role == "worker":
            assert [tuple(pair) for pair in manifest["experts"]] == sorted(plan.owned(worker))
    index = json.loads((shards.root / "shards.json").read_text())
    assert index["format"] == "odmoe-shards/1"
    assert index["model"] == {"model_type": "mixtral", "layers": 4, "experts": 8, "top_k": 2, "hidden": 64}
    assert index["placement"] == plan.to_dict()
    assert [r["dir"] for r in index["roles"]] == ["main", "shadow"] + [f"worker-{i}" for i in range(WORKERS)]
    loaded = ShardSet.load(shards.root)
    assert loaded.placement == plan and loaded.model == index["model"]


def test_main_dir_is_a_loadable_tokenizer_dir(shards: ShardSet) -> None:
    import transformers

    assert len(transformers.AutoTokenizer.from_pretrained(shards.main)) > 256


def test_progress_reaches_total(built: tuple[ShardSet, list[tuple[int, int]]]) -> None:
    shard_set, calls = built
    total = calls[0][1]
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert all(t == total for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    stored = sum(
        t.numel() * t.element_size()
        for role_dir in [shard_set.main, shard_set.shadow] + [shard_set.worker(i) for i in range(WORKERS)]
        for _, t in load_role_tensors(role_dir, verify=False)
    )
    assert total == stored


def test_load_selected_keys(shards: ShardSet) -> None:
    got = dict(load_role_tensors(shards.main, ["lm_head.weight", "model.norm.weight"]))
    assert set(got) == {"lm_head.weight", "model.norm.weight"}
    with pytest.raises(ShardError, match="lacks 1 requested tensor"):
        list(load_role_tensors(shards.main, ["model.layers.0.block_sparse_moe.experts.0.w1.weight"]))


# -- refusing damaged or mismatched shards ------------------------------------------------


@pytest.fixture
def copy(shards: ShardSet, tmp_path: Path) -> Path:
    """A private copy of worker 1's shard to damage."""
    return Path(shutil.copytree(shards.worker(1), tmp_path / "worker-1"))


def _edit_manifest(directory: Path, **changes: object) -> None:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


def test_flipped_byte(copy: Path) -> None:
    part = copy / "part-00003.safetensors"
    data = bytearray(part.read_bytes())
    data[-7] ^= 0x01
    part.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"part-00003\.safetensors sha256 mismatch: expected [0-9a-f]{64}, got"):
        verify_shard(copy)
    with pytest.raises(ShardError, match="corrupted"):
        load_role_tensors(copy)  # refuses at once, before the first tensor is read


def test_truncated_file(copy: Path) -> None:
    part = copy / "part-00002.safetensors"
    part.write_bytes(part.read_bytes()[:-10])
    with pytest.raises(ShardError, match=r"part-00002\.safetensors size mismatch"):
        verify_shard(copy)


def test_deleted_file(copy: Path) -> None:
    (copy / "part-00001.safetensors").unlink()
    with pytest.raises(ShardError, match=r"part-00001\.safetensors listed in manifest\.json is missing"):
        verify_shard(copy)


def test_unlisted_weights_file(copy: Path) -> None:
    shutil.copyfile(copy / "part-00001.safetensors", copy / "part-00099.safetensors")
    with pytest.raises(ShardError, match=r"part-00099\.safetensors is not listed"):
        verify_shard(copy)


def test_missing_manifest(copy: Path) -> None:
    (copy / "manifest.json").unlink()
    with pytest.raises(ShardError, match=r"manifest.*worker-1/manifest\.json is missing"):
        verify_shard(copy)


def test_unparsable_manifest(copy: Path) -> None:
    (copy / "manifest.json").write_text('{"format": ')
    with pytest.raises(ShardError, match="not valid JSON"):
        verify_shard(copy)


def test_wrong_format_version(copy: Path) -> None:
    _edit_manifest(copy, format="odmoe-shard/0")
    with pytest.raises(ShardError, match="format is 'odmoe-shard/0'"):
        verify_shard(copy)


def test_role_and_worker_mismatch(copy: Path) -> None:
    with pytest.raises(ShardError, match="is a 'worker' shard, expected a 'main' shard"):
        verify_shard(copy, expect_role="main")
    with pytest.raises(ShardError, match="belongs to worker 1, expected worker 2"):
        verify_shard(copy, expect_worker=2)


def test_edited_manifest(copy: Path) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"][0]["sha256"] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=f"{manifest['files'][0]['path']} sha256 mismatch: expected 0000"):
        verify_shard(copy)


def test_manifest_experts_must_match_placement(copy: Path) -> None:
    _edit_manifest(copy, experts=[[0, 0]])
    with pytest.raises(ShardError, match="experts do not match the placement"):
        verify_shard(copy)


def test_manifest_path_escape(copy: Path) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"][0]["path"] = "../main/config.json"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="bad file entry"):
        verify_shard(copy)


# -- refusing bad input to build_shards ---------------------------------------------------


def test_refuses_bad_worker_count(model: Path, tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="at least one worker"):
        build_shards(model, tmp_path / "out", workers=0)


def test_refuses_a_model_that_is_not_a_supported_moe_family(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ShardError, match=r"cannot shard.*supported MoE families"):
        build_shards(tmp_path, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_never_deletes_user_files(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ShardError, match=r"not empty and is not a shard set.*notes\.txt.*Nothing was deleted"):
        build_shards(model, out, workers=1)
    assert (out / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ShardError, match="not a directory"):
        build_shards(model, tmp_path / "file", workers=1)


def test_user_file_inside_a_role_dir_is_kept(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build_shards(model, out, workers=1)
    (out / "main" / "my-notes.txt").write_text("mine")
    with pytest.raises(ShardError, match="contains main"):
        build_shards(model, out, workers=1)
    assert (out / "main" / "my-notes.txt").exists()


def test_rebuild_replaces_previous_set(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build_shards(model, out, workers=3)
    (out / "shards.json").unlink()  # also covers resuming after an interrupted build
    shard_set = build_shards(model, out, workers=1)
    assert sorted(p.name for p in out.iterdir()) == ["main", "shadow", "shards.json", "worker-0"]
    verify_shard(shard_set.worker(0), expect_worker=0)
    assert len(_names(shard_set.worker(0))) == 4 * 8 * 3  # a lone worker owns every expert


def _disk_with_free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """The disk under every build reports ``free`` bytes free (a full disk cannot be made here)."""
    real = shutil.disk_usage

    def usage(path: object) -> object:
        return real(path)._replace(free=free)

    monkeypatch.setattr("inference.building.sharding.shutil.disk_usage", usage)


def test_a_build_the_disk_cannot_hold_is_refused_before_anything_is_deleted(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    old = build_shards(model, out, workers=1)
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    _disk_with_free(monkeypatch, 0)
    # Four workers' shards hold the same experts as one worker's, and a second shadow converted to
    # bf16 more: more than the set it replaces.
    with pytest.raises(ShardError, match=r"not enough disk space.*counting the .* GB the build replaces.*Nothing"):
        build_shards(model, out, workers=4, shadow_dtypes=("bf16",))
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before
    verify_shard(old.worker(0), expect_worker=0)
    with pytest.raises(ShardError, match="not enough disk space"):
        build_shards(model, tmp_path / "new", workers=1)
    assert not (tmp_path / "new").exists()


def test_a_rebuild_counts_the_set_it_replaces_as_free(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    build_shards(model, out, workers=2)
    _disk_with_free(monkeypatch, 0)
    shard_set = build_shards(model, out, workers=2)  # the same shards again: the old set's room is enough
    verify_shard(shard_set.worker(1), expect_worker=1)


def test_a_set_with_main_s_tables_is_rebuilt_in_place(model: Path, tmp_path: Path) -> None:
    source = tmp_path / "model"
    shutil.copytree(model, source)
    (source / SIMILARITY_FILE).write_bytes(b"tables")  # copied to main as it is: what the build writes
    out = tmp_path / "out"
    build_shards(source, out, workers=1)
    assert (out / "main" / SIMILARITY_FILE).read_bytes() == b"tables"
    shard_set = build_shards(source, out, workers=2)
    verify_shard(shard_set.main, expect_role="main")
