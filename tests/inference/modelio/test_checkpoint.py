"""Reading Mixtral checkpoints lazily, and the errors a broken checkpoint produces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from inference.modelio.checkpoint import (
    INDEX_FILE,
    Checkpoint,
    CheckpointError,
    ExpertKey,
    expert_key_name,
    parse_expert_key,
)
from inference.tools.tiny import make_tiny

LAYERS, EXPERTS = 2, 4
# embed, norm, lm_head + per layer: 2 norms, 4 attention, router, 3 per expert
N_TENSORS = 3 + LAYERS * (7 + 3 * EXPERTS)


def _tiny(path: Path, shards: int = 1) -> Path:
    return make_tiny(
        path, layers=LAYERS, experts=EXPERTS, hidden=32, intermediate=48, heads=2, kv_heads=1, shards=shards
    )


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory.mktemp("sharded"), shards=3)


def test_single_file_checkpoint(single: Path) -> None:
    ckpt = Checkpoint(single)
    keys = ckpt.keys()
    assert len(keys) == N_TENSORS
    assert ckpt.files() == [single / "model.safetensors"]
    assert ckpt.file_of("lm_head.weight") == single / "model.safetensors"
    assert (ckpt.n_layers, ckpt.n_experts, ckpt.top_k, ckpt.hidden_size) == (LAYERS, EXPERTS, 2, 32)
    embed = ckpt.tensor("model.embed_tokens.weight")
    assert embed.shape == ckpt.shape("model.embed_tokens.weight") == (ckpt.config["vocab_size"], 32)
    assert ckpt.nbytes("model.embed_tokens.weight") == embed.numel() * 4
    assert "model.norm.weight" in ckpt and "nope" not in ckpt


def test_hf_config(single: Path) -> None:
    config = Checkpoint(single).hf_config()
    assert type(config).__name__ == "MixtralConfig"
    assert config.num_local_experts == EXPERTS and config.num_hidden_layers == LAYERS


def test_multi_file_checkpoint_matches_single(single: Path, sharded: Path) -> None:
    one, many = Checkpoint(single), Checkpoint(sharded)
    assert len(many.files()) == 3
    assert sorted(many.keys()) == sorted(one.keys())
    index = json.loads((sharded / INDEX_FILE).read_text())["weight_map"]
    for key in many:
        assert many.file_of(key) == sharded / index[key]
        assert many.nbytes(key) == one.nbytes(key)
    # Same seed, so the values don't depend on how the tensors are split into files.
    for key, tensor in many.iter_tensors():
        assert torch.equal(tensor, one.tensor(key)), key


def test_iter_tensors_groups_by_file(sharded: Path) -> None:
    ckpt = Checkpoint(sharded)
    keys = list(reversed(ckpt.keys()))  # interleave files on purpose
    names = [name for name, _ in ckpt.iter_tensors(keys)]
    assert sorted(names) == sorted(keys)
    files = [ckpt.file_of(name) for name in names]
    runs = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
    assert len(runs) == len(set(files)) == 3  # each file visited in one run: opened once


def test_expert_keys() -> None:
    name = "model.layers.12.block_sparse_moe.experts.5.w3.weight"
    assert parse_expert_key(name) == ExpertKey(12, 5, "w3")
    assert expert_key_name(12, 5, "w3") == name == ExpertKey(12, 5, "w3").name
    for other in (
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.block_sparse_moe.experts.0.w4.weight",
        "model.layers.0.block_sparse_moe.experts.0.w1.weight.extra",
        "x.model.layers.0.block_sparse_moe.experts.0.w1.weight",
    ):
        assert parse_expert_key(other) is None
    with pytest.raises(ValueError, match="w1"):
        expert_key_name(0, 0, "gate")


def test_all_tiny_expert_keys_parse(single: Path) -> None:
    parsed = {parse_expert_key(k) for k in Checkpoint(single)} - {None}
    assert len(parsed) == LAYERS * EXPERTS * 3


def test_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        Checkpoint(tmp_path / "file")


def test_missing_or_bad_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Checkpoint(tmp_path)


def test_not_a_supported_moe_family(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"'llama'.*supported MoE families are 'mixtral', 'qwen2_moe'"):
        Checkpoint(tmp_path)


def test_no_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no weights.*pytorch_model\.bin"):
        Checkpoint(tmp_path)


def test_index_lists_missing_file(tmp_path: Path) -> None:
    model = _tiny(tmp_path / "m", shards=3)
    (model / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete.*model-00002-of-00003\.safetensors"):
        Checkpoint(model)


def test_truncated_safetensors(tmp_path: Path) -> None:
    model = _tiny(tmp_path / "m")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    ckpt = Checkpoint(model)  # headers are parsed lazily
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*damaged or incomplete"):
        ckpt.keys()


def test_garbage_shard(tmp_path: Path) -> None:
    model = _tiny(tmp_path / "m", shards=3)
    (model / "model-00003-of-00003.safetensors").write_bytes(b"\x00garbage" * 10)
    ckpt = Checkpoint(model)
    with pytest.raises(CheckpointError, match=r"model-00003-of-00003\.safetensors"):
        ckpt.tensor("lm_head.weight")
    with pytest.raises(CheckpointError, match=r"model-00003-of-00003\.safetensors"):
        ckpt.nbytes("lm_head.weight")


def test_unknown_tensor(single: Path) -> None:
    with pytest.raises(CheckpointError, match="'nope' is not in"):
        Checkpoint(single).tensor("nope")
