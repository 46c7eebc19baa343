"""The shadow's cast / quantized model copies (``inference.shadow.quant``) on a tiny random Mixtral."""

from __future__ import annotations

import bitsandbytes.functional as bnbf
import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter

from inference.shadow import quant
from inference.shadow.quant import (
    EXPERTS_IMPLEMENTATION,
    SHADOW_DTYPES,
    QuantizedLinear,
    dequantize_weight,
    expert_qweight,
    quantize_shadow_,
    quantize_weight,
)

VOCAB = 128
TOP_K = 2
N_LAYERS = 2


def _config() -> MixtralConfig:
    return MixtralConfig(
        num_hidden_layers=N_LAYERS,
        hidden_size=64,
        intermediate_size=96,
        num_local_experts=8,
        num_experts_per_tok=TOP_K,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )


def _model(config: MixtralConfig | None = None, seed: int = 0, router_std: float = 0.5) -> MixtralForCausalLM:
    """A random tiny Mixtral whose routers are peaked (large weights), so top-k choices are not ties."""
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config or _config()).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MixtralTopKRouter):
                module.weight.normal_(0.0, router_std)
    return model


def _input_ids(seed: int = 1, batch: int = 4, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _routing(model: MixtralForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Top-k expert ids [layers, tokens, k], read from the routers by forward hooks."""
    picks: list[torch.Tensor] = []
    routers = [m for m in model.modules() if isinstance(m, MixtralTopKRouter)]
    handles = [r.register_forward_hook(lambda _m, _a, out: picks.append(out[2])) for r in routers]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(picks)


def _agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(share of the reference's top-k experts also picked, share of tokens with the identical set)."""
    hits = (ref.unsqueeze(-1) == got.unsqueeze(-2)).any(-1)  # [layers, tokens, k]
    return hits.float().mean().item(), hits.all(-1).float().mean().item()


@pytest.mark.parametrize("dtype", SHADOW_DTYPES)
def test_forward_and_generate(dtype: str) -> None:
    model = _model()
    input_ids = _input_ids(batch=2, seq=8)
    report = quantize_shadow_(model, dtype)
    assert report["dtype"] == dtype
    assert report["bytes_after"] <= report["bytes_before"]
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (2, 8, VOCAB)
    assert torch.isfinite(logits).all()
    out = model.generate(input_ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 12)
    assert torch.equal(out[:, :8], input_ids)


def test_fp32_is_unchanged() -> None:
    model = _model()
    input_ids = _input_ids()
    with torch.no_grad():
        before = model(input_ids).logits
    report = quantize_shadow_(model, "fp32")
    with torch.no_grad():
        after = model(input_ids).logits
    assert torch.equal(before, after)
    assert report["bytes_after"] == report["bytes_before"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("keep_routers_fp32", [True, False])
def test_cast_dtypes(dtype: str, keep_routers_fp32: bool) -> None:
    model = _model()
    quantize_shadow_(model, dtype, keep_routers_fp32=keep_routers_fp32)
    target = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    router_dtype = torch.float32 if keep_routers_fp32 else target
    for name, param in model.named_parameters():
        expected = router_dtype if name.endswith("mlp.gate.weight") else target
        assert param.dtype == expected, name
    with torch.no_grad():
        assert model(_input_ids()).logits.dtype == target


@pytest.mark.parametrize(("scheme", "bound"), [("int8", 0.01), ("nf4", 0.15)])
def test_weight_round_trip(scheme: str, bound: float) -> None:
    torch.manual_seed(0)
    weight = torch.randn(192, 64)
    q = quantize_weight(weight, scheme)
    assert q.shape == weight.shape
    err = (dequantize_weight(q) - weight).abs().max() / weight.abs().max()
    print(f"{scheme}: max round-trip error {err:.4f} of absmax")
    assert err < bound


def test_nf4_dequantize_matches_bitsandbytes() -> None:
    """Our torch nf4 dequantizer agrees with bitsandbytes' where its CPU kernel is right (aligned rows)."""
    torch.manual_seed(0)
    weight = torch.randn(96, 128)
    q = quantize_weight(weight, "nf4")
    want = bnbf.dequantize_4bit(q.data, quant._nf4_quant_state(q))
    assert torch.equal(dequantize_weight(q), want)


@pytest.mark.parametrize(("scheme", "bound"), [("int8", 0.01), ("nf4", 0.15)])
def test_model_weights_round_trip(scheme: str, bound: float) -> None:
    model = _model()
    experts = model.model.layers[0].mlp.experts
    q_proj = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    gate_up = experts.gate_up_proj.detach()[3].clone()
    down = experts.down_proj.detach()[5].clone()
    quantize_shadow_(model, scheme)
    for ref, q in [
        (q_proj, model.model.layers[0].self_attn.q_proj.qweight),
        (gate_up, expert_qweight(experts, "gate_up", 3)),
        (down, expert_qweight(experts, "down", 5)),
    ]:
        assert (dequantize_weight(q) - ref).abs().max() / ref.abs().max() < bound


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_quantized_structure(scheme: str) -> None:
    model = _model()
    report = quantize_shadow_(model, scheme)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == []
    assert isinstance(model.lm_head, QuantizedLinear)
    for module in model.modules():
        if isinstance(module, MixtralTopKRouter):
            assert module.weight.dtype == torch.float32
        if isinstance(module, MixtralExperts):
            assert module.gate_up_proj.numel() == 0
            assert module.down_proj.numel() == 0
            assert module.config._experts_implementation == EXPERTS_IMPLEMENTATION
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.model.norm.weight.dtype == torch.float32
    ratio = report["experts_bytes_after"] / report["experts_bytes_before"]
    model_ratio = report["bytes_after"] / report["bytes_before"]
    print(f"{scheme}: experts storage {ratio:.3f} of fp32, whole model {model_ratio:.3f}")
    if scheme == "int8":
        assert 0.25 <= ratio < 0.28
    else:
        assert 0.125 <= ratio < 0.15


@pytest.mark.parametrize(("dtype", "threshold"), [("bf16", 0.9), ("fp16", 0.9), ("int8", 0.8), ("nf4", 0.6)])
def test_routing_agreement(dtype: str, threshold: float) -> None:
    input_ids = _input_ids()
    ref = _routing(_model(), input_ids)
    shadow = _model()
    quantize_shadow_(shadow, dtype)
    got = _routing(shadow, input_ids)
    assert got.shape == ref.shape == (N_LAYERS, input_ids.numel(), TOP_K)
    hit, exact = _agreement(ref, got)
    print(f"{dtype}: routing agreement {hit:.3f} of top-{TOP_K} experts, {exact:.3f} of tokens exact")
    assert hit >= threshold
    assert exact >= threshold - 0.1


def test_quantized_experts_match_dequantized_eager() -> None:
    """The registered implementation computes what eager would with the dequantized weights."""
    model = _model()
    input_ids = _input_ids()
    quantize_shadow_(model, "int8")
    with torch.no_grad():
        got = model(input_ids).logits
        for module in model.modules():
            if isinstance(module, MixtralExperts):
                for name in ("gate_up", "down"):
                    dense = [dequantize_weight(expert_qweight(module, name, e)) for e in range(8)]
                    setattr(module, f"{name}_proj", torch.nn.Parameter(torch.stack(dense)))
                del module.odmoe_scheme
        model.config._experts_implementation = "eager"
        want = model(input_ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_other_models_keep_their_implementation() -> None:
    config = _config()
    shadow, sibling, separate = _model(config), _model(config), _model()
    assert sibling.config is config
    default = config._experts_implementation
    input_ids = _input_ids()
    with torch.no_grad():
        before = sibling(input_ids).logits
    quantize_shadow_(shadow, "int8")
    assert shadow.config._experts_implementation == EXPERTS_IMPLEMENTATION
    assert config._experts_implementation == default
    assert sibling.model.layers[0].mlp.experts.config._experts_implementation == default
    assert separate.config._experts_implementation == default
    with torch.no_grad():
        assert torch.equal(sibling(input_ids).logits, before)


def test_bnb_4bit_kernel_path_matches_dequantize(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA-only ``bnb.matmul_4bit`` call (forced on CPU here) agrees with dequantize + matmul."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    qlinear = QuantizedLinear.from_linear(linear, "nf4")
    x = torch.randn(5, 64)
    want = qlinear(x)
    monkeypatch.setattr(quant, "_use_bnb_kernel", lambda _x, q: q.scheme == "nf4")
    torch.testing.assert_close(qlinear(x), want, rtol=1e-4, atol=1e-5)


def test_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match=r"fp32, bf16, fp16, int8, nf4"):
        quantize_shadow_(_model(), "int4")


def test_rejects_converted_model() -> None:
    model = _model()
    quantize_shadow_(model, "bf16")
    with pytest.raises(ValueError, match="fp32"):
        quantize_shadow_(model, "int8")
