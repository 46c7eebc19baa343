"""The shadow's model, built from its shard tensor by tensor, in every shadow dtype and from
fp32, bf16 and fp16 checkpoints: the same model as converting a loaded one, never the
full-precision model in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import MixtralForCausalLM

from inference import quant
from inference.checkpoint import Checkpoint, expert_key_name
from inference.model import build_model, load_config
from inference.shadow_model import build_shadow_model
from inference.sharding import build_shards, load_role_tensors
from inference.tiny import make_tiny
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
