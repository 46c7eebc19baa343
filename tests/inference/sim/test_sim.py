"""Cluster simulator: roofline arithmetic, monotonicity, the paper testbed, bad input, traces, CLI."""

from __future__ import annotations

import json

import pytest

from inference.sim import estimate, list_profiles
from inference.sim.__main__ import main as cli_main
from inference.sim.costs import Costs
from inference.sim.efficiency import IDEAL
from inference.sim.hardware import get_profile, with_host_to_device
from inference.sim.model_sizes import from_hf_config, mixtral_8x7b
from inference.sim.report import PAPER_PAIRS, compare
from inference.sim.simulate import run_pair
from inference.sim.sources import CONSTANTS
from inference.sim.strategies import Cluster
from inference.sim.traces import load_trace, repeat_rate, synthetic_trace

MODEL = mixtral_8x7b()
PROFILE = get_profile("3090-pcie4-1gbe")


def test_mixtral_sizes_by_hand() -> None:
    assert MODEL.expert_params == 3 * 4096 * 14336 == 176_160_768
    assert MODEL.expert_bytes() == pytest.approx(352.3e6, rel=1e-3)
    assert MODEL.attention_params == 4096 * (2 * 4096 + 2 * 1024)
    assert MODEL.total_params == pytest.approx(46.70e9, rel=2e-3)
    assert MODEL.kv_bytes_per_token_layer() == 2 * 8 * 128 * 2


def test_decode_roofline_by_hand() -> None:
    # 2 experts + attention/gate/norms per layer, KV at 128 positions, LM head + final norm, embedding row.
    per_layer = 2 * 352_321_536 + (41_943_040 + 8 * 4096 + 2 * 4096) * 2 + 128 * 4096
    expected = 32 * per_layer + (32000 * 4096 + 4096) * 2 + 4096 * 2
    assert MODEL.decode_bytes_per_token(128) == pytest.approx(expected)
    full = run_pair("full-cache", MODEL, PROFILE, Cluster(), synthetic_trace(MODEL, 8), 128, 9, ideal=True)
    seconds = expected / 936e9 + 7 * (10e-6 + 8192 / 31.5e9)  # plus 7 PCIe hops of the hidden state
    assert full["decode_tok_s"] == pytest.approx(1 / seconds, rel=0.01)


def test_ideal_expert_load_by_hand() -> None:
    costs = Costs(MODEL, PROFILE, IDEAL)
    assert costs.expert_load() == pytest.approx(10e-6 + 352_321_536 / 31.5e9)
    assert costs.message(8192) == pytest.approx(100e-6 + 8192 / 125e6)


def test_more_pcie_bandwidth_is_never_slower() -> None:
    trace = synthetic_trace(MODEL, 16)
    for strategy in ("reactive", "lru-offload", "odmoe"):
        rates = []
        for gbps in (8, 16, 25, 50):
            profile = with_host_to_device(PROFILE, gbps * 1e9)
            rates.append(run_pair(strategy, MODEL, profile, Cluster(), trace, 16, 17, ideal=False)["decode_tok_s"])
        assert rates == sorted(rates), strategy


def test_lower_recall_is_never_faster() -> None:
    trace = synthetic_trace(MODEL, 16)
    rates = [
        run_pair("odmoe", MODEL, PROFILE, Cluster(), trace, 16, 17, ideal=False, recall=r)["decode_tok_s"]
        for r in (0.5, 0.8, 0.95, 1.0)
    ]
    assert rates == sorted(rates)


def test_paper_testbed_structure() -> None:
    """Structural facts of the paper-testbed comparison; its ratios are reported (README), not banded."""
    result = compare(MODEL, "3090-pcie4-1gbe", Cluster(), synthetic_trace(MODEL, 256))
    rows = result["strategies"]
    memory = rows["odmoe"]["adjusted"]["memory_bytes"]
    assert all(memory[f"worker{w}"] < 1.5e9 for w in range(8))  # two fp16 experts and a CUDA context
    assert result["pairs"] == PAPER_PAIRS
    for row in rows.values():
        assert row["ideal"]["decode_tok_s"] >= row["adjusted"]["decode_tok_s"]  # overheads only slow down


def test_transformers_moe_block_by_hand() -> None:
    """Transformers' eager expert loop: the measured fixed ops, then each hit expert as its own segment."""
    from inference.sim.efficiency import transformers_eager

    costs = Costs(MODEL, PROFILE, transformers_eager())
    per_op = CONSTANTS["eager_dense_layer_cpu"].value / CONSTANTS["hf_mistral_ops_per_layer"].value
    per_hit = (125 - 102) * per_op  # the op counts measured with top-2 and top-1 routing
    fixed = (102 - 23 - 74) * per_op
    gpu = 352_321_536 / (936e9 * CONSTANTS["gpt_fast_compiled_mbu"].value)
    assert costs.impl.moe_cpu_per_hit_expert == pytest.approx(per_hit)
    assert costs.moe_block([1, 1, 0, 0, 0, 0, 0, 0]) == pytest.approx(fixed + 2 * max(per_hit, gpu))
    assert "hf_moe_loop_cpu_per_expert" not in CONSTANTS  # the Qwen-derived figure is gone


def test_mixtral_offloading_miss_is_a_swap_on_the_compute_stream() -> None:
    """A miss copies one expert out and one in, on the kernels' stream: by hand for one cold layer."""
    from inference.sim.efficiency import mixtral_offloading
    from inference.sim.strategies.base import Setup
    from inference.sim.strategies.lru_offload import LruOffload

    costs = Costs(MODEL, PROFILE, mixtral_offloading())
    lru = LruOffload(Setup(costs, Cluster()))
    lru._fresh_state()
    lru.cache[0].clear()
    bits = CONSTANTS["mixtral_offloading_expert_bits"].value
    done = lru._layer(0, [0, 1], 1, 128, 0.0)
    segment = max(costs.impl.moe_cpu_per_hit_expert, 2 * costs.expert_load(bits) + costs.expert_gpu(1, bits))
    attention = costs.attention_layer(1, 128, CONSTANTS["mixtral_offloading_attention_bits"].value)
    assert done == pytest.approx(attention + costs.impl.moe_fixed_cpu + 2 * segment)
    assert not Cluster().lru_prefetch  # their released code has no speculative prefetch


def test_every_constant_has_a_source() -> None:
    for name, constant in CONSTANTS.items():
        assert constant.source and constant.unit and constant.why, name


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"profile": "nope"}, "unknown hardware profile"),
        ({"strategy": "magic"}, "unknown strategy"),
        ({"workers": 7, "group_size": 2}, "multiple of group_size"),
        ({"shadow_dtype": "fp8"}, "shadow_dtype"),
        ({"output_tokens": 1}, "output_tokens"),
        ({"input_tokens": "12"}, "input_tokens"),
        ({"model": {"hidden_size": 8}}, "model_type is None"),
        ({"model": "gpt-5"}, "unknown model"),
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        estimate(**kwargs)


@pytest.mark.alone
def test_estimate_is_json_and_fast() -> None:
    import time

    estimate()
    start = time.perf_counter()
    result = estimate(strategy="odmoe", input_tokens=128, output_tokens=128)
    assert time.perf_counter() - start < 0.2  # < 50 ms on an idle box; slack for a busy CI runner
    json.dumps(result)
    for kind in ("ideal", "adjusted"):
        assert {"decode_tok_s", "ttft_ms", "e2e_tok_s", "memory_bytes"} <= set(result[kind])
    assert result["assumptions"] and result["profile"]["name"] == "3090-pcie4-1gbe"
    assert {p["name"] for p in list_profiles()} >= {"3090-pcie4-1gbe", "3090-pcie4-10gbe", "3080-pcie4-1gbe"}


def test_estimate_accepts_a_hf_config() -> None:
    config = {
        "model_type": "mixtral",
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
    }
    assert from_hf_config(config).head_dim == 64
    assert estimate(model=config, workers=4, group_size=2)["adjusted"]["decode_tok_s"] > 0


def test_synthetic_trace_has_mixtral_locality() -> None:
    trace = synthetic_trace(MODEL, 2000, seed=1)
    assert repeat_rate(trace, 15) == pytest.approx(0.63, abs=0.03)
    assert repeat_rate(trace, 0) == pytest.approx(0.48, abs=0.03)
    counts = [sum(e in step[7] for step in trace) for e in range(8)]
    assert max(counts) / min(counts) < 1.25  # near-uniform load


def test_trace_files(tmp_path) -> None:
    steps = [[[0, 1]] * 32, [[2, 3]] * 32]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(steps))
    assert load_trace(bare, MODEL) == steps
    metrics = tmp_path / "metrics.json"
    per_step = [{"step": 0, "layers": [{"real": [0, 1, 2]}] * 32}] + [
        {"step": i + 1, "layers": [{"real": layer} for layer in step]} for i, step in enumerate(steps)
    ]
    metrics.write_text(json.dumps({"per_step": per_step}))
    assert load_trace(metrics, MODEL) == steps
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps([[[0, 9]] * 32]))
    with pytest.raises(ValueError, match="expert ids"):
        load_trace(broken, MODEL)
    with pytest.raises(ValueError, match="32 layers"):
        estimate(trace=[[[0, 1]]])


def test_cli_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "paper.json"
    assert cli_main(["--testbed", "paper", "--json", str(out), "--strategy", "full-cache", "--strategy", "odmoe"]) == 0
    table = capsys.readouterr().out
    assert "| odmoe |" in table and "adjusted ratio" in table
    data = json.loads(out.read_text())
    assert set(data["strategies"]) == {"full-cache", "odmoe"}
    for row in data["strategies"].values():
        assert {"ideal", "adjusted", "paper"} <= set(row)
        assert row["adjusted"]["ratio_to_full_cache"] > 0
    assert "rtx3090_memory_bandwidth" in data["constants"]
    assert cli_main(["--workers", "7"]) == 2
