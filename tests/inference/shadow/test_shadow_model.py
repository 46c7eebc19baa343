"""The shadow's model, built from its shard tensor by tensor, in every shadow dtype and from
fp32, bf16 and fp16 checkpoints: the same model as converting a loaded one, never the
full-precision model in memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import MixtralForCausalLM

from inference.building.sharding import add_shadow_shards, build_shards
from inference.modelio.checkpoint import Checkpoint, expert_key_name
from inference.modelio.model import build_model, load_config
from inference.modelio.shards import ShardError, ShardSet, file_sha256, load_role_tensors, verify_shard
from inference.shadow import quant
from inference.shadow.shadow_model import build_shadow_model
from inference.tools.tiny import make_tiny
from tests.reference import ODD_SHAPE

SHADOW_DTYPES = ["fp32", "bf16", "fp16", "int8", "nf4"]
PROMPT = torch.tensor([[1, 5, 6, 7, 8, 42, 100]])


def _shadow_dir(tmp: Path, dtype: str, shape: dict) -> Path:
    model = make_tiny(tmp / "model", seed=4, dtype=dtype, **shape)
    return build_shards(model, tmp / "shards", workers=2).shadow


@pytest.fixture(scope="module")
def fp32_odd_shadow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _shadow_dir(tmp_path_factory.mktemp("fp32"), "float32", ODD_SHAPE)


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def half_shadow(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _shadow_dir(tmp_path_factory.mktemp(request.param), request.param, dict(shards=3))


def _logits(model: MixtralForCausalLM) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=PROMPT).logits


@pytest.mark.parametrize("dtype", SHADOW_DTYPES)
def test_streamed_build_equals_converting_the_loaded_fp32_model(fp32_odd_shadow: Path, dtype: str) -> None:
    # The old way: the whole fp32 model in memory, then converted in place.
    loaded = build_model(load_config(fp32_odd_shadow), load_role_tensors(fp32_odd_shadow), with_experts=True)
    loaded.set_experts_implementation("eager")  # hidden 75: the grouped GEMM refuses these strides
    quant.quantize_shadow_(loaded, dtype)
    streamed, report = build_shadow_model(fp32_odd_shadow, dtype, torch.device("cpu"), eager_experts=True)
    assert torch.equal(_logits(streamed), _logits(loaded))
    assert report["bytes"] == quant.module_bytes(loaded)
    assert report["source_bytes"] == sum(t.nbytes for _, t in load_role_tensors(fp32_odd_shadow))


def test_a_shadow_in_the_checkpoints_own_dtype_is_the_model_itself(half_shadow: Path) -> None:
    config = load_config(half_shadow)
    own = {torch.bfloat16: "bf16", torch.float16: "fp16"}[config.dtype]
    shadow, report = build_shadow_model(half_shadow, own, torch.device("cpu"))
    reference = MixtralForCausalLM.from_pretrained(half_shadow.parent.parent / "model", dtype="auto").eval()
    assert reference.dtype == config.dtype and shadow.dtype == config.dtype
    assert torch.equal(_logits(shadow), _logits(reference))
    # Nothing cast, nothing dropped: the weights are the shard's bytes (the rest is RoPE's buffers).
    assert sum(p.nbytes for p in shadow.parameters()) == report["source_bytes"]


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_quantized_shadow_of_a_half_checkpoint(half_shadow: Path, scheme: str) -> None:
    ckpt_dtype = load_config(half_shadow).dtype
    shadow, report = build_shadow_model(half_shadow, scheme, torch.device("cpu"))
    # Experts are quantized fused (w1 over w3), straight from the checkpoint's own values.
    source = Checkpoint(half_shadow.parent.parent / "model")
    w1, w3 = (source.tensor(expert_key_name(1, 3, p)) for p in ("w1", "w3"))
    want = quant.quantize_weight(torch.cat([w1, w3]), scheme)
    got = quant.expert_qweight(shadow.model.layers[1].mlp.experts, "gate_up", 3)
    assert torch.equal(got.data, want.data) and torch.equal(got.state, want.state)
    # What is not quantized keeps the checkpoint's dtype, which is also the compute dtype.
    assert shadow.model.embed_tokens.weight.dtype == ckpt_dtype
    assert shadow.model.layers[0].mlp.gate.weight.dtype == ckpt_dtype
    assert isinstance(shadow.lm_head, quant.QuantizedLinear)
    assert _logits(shadow).dtype == ckpt_dtype
    assert report["bytes"] < 0.6 * report["source_bytes"]


def test_cast_shadow_keeps_the_routers_precision(half_shadow: Path) -> None:
    ckpt_dtype = load_config(half_shadow).dtype
    other = "fp16" if ckpt_dtype == torch.bfloat16 else "bf16"
    shadow, _ = build_shadow_model(half_shadow, other, torch.device("cpu"))
    assert shadow.model.layers[0].mlp.gate.weight.dtype == ckpt_dtype
    assert shadow.model.layers[0].self_attn.q_proj.weight.dtype != ckpt_dtype
    assert torch.isfinite(_logits(shadow)).all()


def test_unknown_dtype_is_refused(fp32_odd_shadow: Path) -> None:
    with pytest.raises(ValueError, match="unsupported shadow dtype 'int4'"):
        build_shadow_model(fp32_odd_shadow, "int4", torch.device("cpu"))


@pytest.fixture(scope="module")
def preconverted(tmp_path_factory: pytest.TempPathFactory) -> ShardSet:
    tmp = tmp_path_factory.mktemp("preconverted")
    model = make_tiny(tmp / "model", seed=7, dtype="bfloat16", shards=3)
    return build_shards(model, tmp / "shards", workers=2, shadow_dtypes=("nf4", "int8", "fp16"))


@pytest.mark.parametrize("dtype", ["nf4", "int8", "fp16"])
def test_a_preconverted_shadow_shard_is_the_same_model(preconverted: ShardSet, dtype: str) -> None:
    shard = preconverted.shadow_for(dtype)
    assert shard.name == f"shadow-{dtype}"
    assert verify_shard(shard, expect_role="shadow")["shadow_dtype"] == dtype
    converted_here, report = build_shadow_model(preconverted.shadow, dtype, torch.device("cpu"))
    from_shard, shard_report = build_shadow_model(shard, dtype, torch.device("cpu"))
    assert not report["pre_converted"] and shard_report["pre_converted"]
    assert torch.equal(_logits(from_shard), _logits(converted_here))
    # What a shadow box downloads: the converted bytes, not the checkpoint's.
    on_disk = sum(p.stat().st_size for p in shard.glob("*.safetensors"))
    full = sum(p.stat().st_size for p in preconverted.shadow.glob("*.safetensors"))
    print(f"{dtype}: shadow shard {on_disk / full:.3f} of the full one")
    assert on_disk < full
    assert ShardSet.load(preconverted.root).shadow_for("bf16") == preconverted.shadow  # not built: the full one


def test_a_preconverted_shard_serves_only_its_dtype(preconverted: ShardSet) -> None:
    with pytest.raises(ValueError, match="converted to nf4, but int8 was asked for"):
        build_shadow_model(preconverted.shadow_for("nf4"), "int8", torch.device("cpu"))


def test_unknown_preconverted_dtype_is_refused_before_writing(tmp_path: Path) -> None:
    model = make_tiny(tmp_path / "model", seed=0)
    with pytest.raises(ShardError, match="unknown shadow dtype 'int4'"):
        build_shards(model, tmp_path / "shards", workers=2, shadow_dtypes=("int4",))
    assert not (tmp_path / "shards").exists()


def test_a_shadow_dtype_is_added_to_a_built_set_without_rebuilding_it(tmp_path: Path) -> None:
    model = make_tiny(tmp_path / "model", seed=8, dtype="bfloat16")
    built = build_shards(model, tmp_path / "shards", workers=2)
    before = {p: p.stat().st_mtime_ns for p in built.root.glob("*/part-*.safetensors")}
    grown = add_shadow_shards(model, built.root, ["int8", "int8"])
    assert grown.shadow_dtypes == ("int8",) and ShardSet.load(built.root).shadow_dtypes == ("int8",)
    verify_shard(grown.shadow_for("int8"), expect_role="shadow")
    assert {p: p.stat().st_mtime_ns for p in before} == before  # the other shards were left alone
    assert add_shadow_shards(model, built.root, ["int8"]) == grown  # nothing left to add


def _tamper(shard: Path, change) -> None:
    """Rewrite ``shard``'s parts through ``change(records)`` and re-sign its manifest, as a bad build would."""
    manifest = json.loads((shard / "manifest.json").read_text())
    records = dict(load_role_tensors(shard, verify=False))
    for part in shard.glob("part-*.safetensors"):
        part.unlink()
    save_file(change(records), shard / "part-00001.safetensors")
    manifest["files"] = [
        {"path": p.name, "size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(shard.iterdir())
        if p.name != "manifest.json"
    ]
    (shard / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda r: r | {"model.layers.0.mlp.experts.gate_up.0.qdata": torch.zeros(3, 1, dtype=torch.uint8)}, "expect"),
        (lambda r: r | {"model.layers.0.mlp.experts.down.99.qdata": torch.zeros(3, 1, dtype=torch.uint8)}, "no such"),
        (lambda r: r | {"lm_head.weight_state": torch.zeros(5)}, "expected"),
        (lambda r: r | {"model.evil.weight": torch.zeros(2)}, "not part of this model"),
    ],
)
def test_a_malformed_preconverted_shard_is_refused(tmp_path: Path, change, reason: str) -> None:
    model = make_tiny(tmp_path / "model", seed=9)
    shard = build_shards(model, tmp_path / "shards", workers=1, shadow_dtypes=("nf4",)).shadow_for("nf4")
    _tamper(shard, change)
    verify_shard(shard)  # it arrived as (badly) built: only the records' check can tell
    with pytest.raises(ValueError, match=reason):
        build_shadow_model(shard, "nf4", torch.device("cpu"))


def test_a_shard_converted_by_another_layout_is_refused(tmp_path: Path) -> None:
    model = make_tiny(tmp_path / "model", seed=9)
    shard = build_shards(model, tmp_path / "shards", workers=1, shadow_dtypes=("int8",)).shadow_for("int8")
    manifest = json.loads((shard / "manifest.json").read_text())
    (shard / "manifest.json").write_text(json.dumps(manifest | {"records": "odmoe-shadow-records/0"}))
    with pytest.raises(ValueError, match="build the shards again"):
        build_shadow_model(shard, "int8", torch.device("cpu"))
