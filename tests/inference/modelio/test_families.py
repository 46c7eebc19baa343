"""Model families through their adapters (inference/families): each family's release layout is
the one Transformers itself writes, a checkpoint shows its experts in the shard layout (a fused
layout read by slices), and every family serves token-identical to Transformers end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from inference.modelio.checkpoint import Checkpoint, CheckpointError, expert_key_name
from inference.modelio.families import FAMILIES, FamilyError, family_for
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.tools.reference import reference_generate
from inference.tools.tiny import make_tiny
from tests.matrix import covered
from tests.reference import PROMPTS

NEW_FAMILIES = ("qwen2_moe", "qwen3_moe", "olmoe", "granitemoe")
# Odd sizes (nothing a power of two, a hidden size heads do not divide), top-3 of 7.
FAMILY_SHAPE = dict(layers=3, hidden=36, intermediate=22, experts=7, top_k=3, heads=3, kv_heads=1, head_dim=12)
NEW_TOKENS = 16


def _family_model(root: Path, family: str, dtype: str = "float32") -> Path:
    seed = 20 + list(FAMILIES).index(family)
    return make_tiny(root / f"{family}-{dtype}", family=family, seed=seed, shards=3, dtype=dtype, **FAMILY_SHAPE)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: _family_model(root, family) for family in NEW_FAMILIES}


def _release_tensors(directory: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(str(directory / name), "pt") as handle:
                shapes |= {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
    return shapes


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_writes_the_release_layout_transformers_itself_writes(family: str, tmp_path: Path) -> None:
    ours = make_tiny(tmp_path / "ours", family=family, **FAMILY_SHAPE)
    config = json.loads((ours / "config.json").read_text())
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path / "theirs")
    assert _release_tensors(ours) == _release_tensors(tmp_path / "theirs")


def test_every_family_in_the_registry_checks_its_configs() -> None:
    with pytest.raises(FamilyError, match=r"'deepseek_v2'.*supported MoE families"):
        family_for({"model_type": "deepseek_v2"})
    qwen = FAMILIES["qwen2_moe"].release_config({**FAMILY_SHAPE, "vocab": 64, "shared_intermediate": 30})
    family_for(qwen)
    with pytest.raises(FamilyError, match=r"layers \[1\] are dense"):
        family_for(qwen | {"mlp_only_layers": [1]})
    with pytest.raises(FamilyError, match="decoder_sparse_step is 2"):
        family_for(qwen | {"decoder_sparse_step": 2})
    with pytest.raises(FamilyError, match="'shared_expert_intermediate_size' must be a positive integer"):
        family_for({k: v for k, v in qwen.items() if k != "shared_expert_intermediate_size"})


def test_a_dense_layer_checkpoint_is_refused_with_the_reason(tmp_path: Path) -> None:
    model = make_tiny(tmp_path / "m", family="qwen3_moe", **FAMILY_SHAPE)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"mlp_only_layers": [0]}))
    with pytest.raises(CheckpointError, match=r"config.json: layers \[0\] are dense"):
        Checkpoint(model)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_a_checkpoint_shows_its_experts_in_the_shard_layout(family: str, family_models: dict[str, Path]) -> None:
    ckpt = Checkpoint(family_models[family])
    keys = ckpt.keys()
    experts = [k for k in keys if ".block_sparse_moe.experts." in k]
    assert len(experts) == 3 * 7 * 3  # layers x experts x (w1, w2, w3)
    assert not [k for k in keys if ckpt.family.is_release_expert(k) and k not in experts]
    # The same bits as Transformers' own loading fuses into each layer's experts module.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_models[family])
    for layer in range(3):
        fused = ckpt.family.experts(model.model.layers[layer])
        for expert in (0, 6):
            gate, down, up = (ckpt.tensor(expert_key_name(layer, expert, p)) for p in ("w1", "w2", "w3"))
            assert torch.equal(torch.cat([gate, up]), fused.gate_up_proj[expert])
            assert torch.equal(down, fused.down_proj[expert])
            assert ckpt.shape(expert_key_name(layer, expert, "w1")) == (22, 36)
            assert ckpt.nbytes(expert_key_name(layer, expert, "w2")) == 36 * 22 * 4


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_fused_expert_is_read_by_its_slice_alone(tmp_path: Path) -> None:
    """Granite keeps a layer's experts in one [E, 2I, H] tensor: reading expert e touches only its
    rows and returns a tensor owning only them, so sharding never holds a whole fused tensor."""
    model = make_tiny(tmp_path / "g", family="granitemoe", layers=1, hidden=256, intermediate=512, experts=16)
    ckpt = Checkpoint(model)
    fused_bytes = 16 * 2 * 512 * 256 * 4  # 16.8 MB
    projection_bytes = 512 * 256 * 4
    before = _rss_bytes()
    expert = [ckpt.tensor(expert_key_name(0, 5, proj)) for proj in ("w1", "w2", "w3")]
    grown = _rss_bytes() - before
    assert [t.untyped_storage().nbytes() for t in expert] == [projection_bytes] * 3
    print(f"reading one expert of a {fused_bytes / 1e6:.1f} MB fused tensor grew RSS by {grown / 1e6:.2f} MB")
    assert grown < fused_bytes / 4  # measured here: 2.1 MB (the expert's pages and its copy)
    sizes = [t.untyped_storage().nbytes() for name, t in ckpt.iter_tensors() if ".experts." in name]
    assert sizes == [projection_bytes] * (16 * 3)


@pytest.mark.parametrize(
    ("family", "strategy", "workers"),
    covered(NEW_FAMILIES, [("odmoe", 1), ("odmoe", 8), ("full-cache", 3), ("reactive", 4), ("lru-offload", 4)]),
)
def test_every_family_is_token_identical_to_transformers(
    family: str, strategy: str, workers: int, family_models: dict[str, Path]
) -> None:
    model = family_models[family]
    prompts = [PROMPTS[0], PROMPTS[3]]
    expected = [reference_generate(model, prompt, NEW_TOKENS) for prompt in prompts]
    options = ClusterOptions(workers=workers, settings=DeploymentSettings(strategy=strategy), in_process=True)
    with LocalCluster(model, options) as cluster:
        results = [cluster.generate(prompt, NEW_TOKENS) for prompt in prompts]
    for prompt, want, got in zip(prompts, expected, results, strict=True):
        assert got.token_ids == want, f"{family} {strategy} x{workers}, prompt {prompt}: tokens differ"
        if strategy == "odmoe":
            assert got.metrics["recall"] == 1.0  # an fp32 shadow reproduces the family's router


@pytest.mark.slow
@pytest.mark.parametrize("shadow", ["fp32", "nf4"])
def test_a_tied_lm_head_is_served_as_the_embedding(shadow: str, tmp_path: Path) -> None:
    """Granite's releases tie the LM head to the embedding: no lm_head tensor; main, an fp32 and a
    quantized shadow (which keeps the tied head unquantized, as the embedding) all serve it."""
    model = make_tiny(tmp_path / "g", family="granitemoe", seed=9, shards=2, tied_embeddings=True, **FAMILY_SHAPE)
    assert "lm_head.weight" not in Checkpoint(model)
    expected = reference_generate(model, PROMPTS[3], NEW_TOKENS)
    with LocalCluster(
        model, ClusterOptions(workers=3, settings=DeploymentSettings(shadow_dtype=shadow), in_process=True)
    ) as cluster:
        done = cluster.generate(PROMPTS[3], NEW_TOKENS)
    assert done.token_ids == expected
    if shadow == "fp32":
        assert done.metrics["recall"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "dtype", "shadow"),
    [
        ("qwen2_moe", "bfloat16", "nf4"),
        ("qwen3_moe", "float16", "int8"),
        ("olmoe", "bfloat16", "bf16"),
        ("granitemoe", "bfloat16", "nf4"),
    ],
)
def test_every_family_in_half_precision_with_a_lossy_shadow(
    family: str, dtype: str, shadow: str, tmp_path: Path
) -> None:
    model = _family_model(tmp_path, family, dtype)
    expected = reference_generate(model, PROMPTS[3], NEW_TOKENS, dtype="auto")
    options = ClusterOptions(workers=3, settings=DeploymentSettings(shadow_dtype=shadow), in_process=True)
    with LocalCluster(model, options) as cluster:
        done = cluster.generate(PROMPTS[3], NEW_TOKENS)
    assert done.token_ids == expected
    print(f"{family} {dtype}, {shadow} shadow: recall {done.metrics['recall']:.3f}")


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_the_memory_plan_of_a_config_is_its_checkpoints(family: str, family_models: dict[str, Path]) -> None:
    from inference.building.memory import memory_from_checkpoint, memory_from_config

    ckpt = Checkpoint(family_models[family])
    for shadow_dtype in ("fp32", "nf4"):
        options = dict(workers=3, context_tokens=256, settings=DeploymentSettings(shadow_dtype=shadow_dtype))
        real, computed = memory_from_checkpoint(ckpt, **options), memory_from_config(ckpt.config, **options)
        assert computed.roles == real.roles
        assert (computed.total_bytes, computed.expert_bytes) == (real.total_bytes, real.expert_bytes)


def test_release_sizes_add_up_to_their_published_parameter_counts() -> None:
    from inference.building.memory import memory_from_config

    # Total parameters as the model cards state them (bf16: two bytes each).
    for name, billions in (("qwen3-30b-a3b", 30.5), ("qwen1.5-moe-a2.7b", 14.3), ("olmoe-1b-7b", 6.9)):
        plan = memory_from_config(name, workers=8)
        assert round(plan.total_bytes / 2e9, 1) == billions, name


def test_the_memory_cli_plans_a_release_of_every_family_and_says_what_is_wrong(tmp_path: Path, capsys) -> None:
    from inference.building.memory import main as memory_cli

    for name in ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "olmoe-1b-7b"):
        assert memory_cli(["--model", name, "--workers", "8"]) == 0
        assert capsys.readouterr().out.startswith(f"{name} (bfloat16), odmoe")
    assert memory_cli(["--checkpoint", str(tmp_path / "missing")]) == 1
    assert "error: checkpoint directory" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["granitemoe", "qwen3_moe"])
def test_experts_of_another_shape_than_the_configs_are_refused_before_sharding(family: str, tmp_path: Path) -> None:
    from inference.building.sharding import build_shards
    from inference.modelio.shards import ShardError

    model = make_tiny(tmp_path / "m", family=family, **FAMILY_SHAPE)
    config = json.loads((model / "config.json").read_text())
    field = "intermediate_size" if family == "granitemoe" else "moe_intermediate_size"
    (model / "config.json").write_text(json.dumps(config | {field: 11}))  # the files' experts are 22 wide
    with pytest.raises(ShardError, match=r"the config says \[") as refused:
        build_shards(model, tmp_path / "out", workers=2)
    print(refused.value)
    assert not (tmp_path / "out").exists()
