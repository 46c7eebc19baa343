"""benchmarks.strategies end to end on the tiny model: runs, stays exact, writes what it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sim_prediction import costs_in_rhythm
from benchmarks.strategies import (
    DEFAULT_PROFILE,
    Calibration,
    add_ratios,
    aggregate_rounds,
    build_parser,
    calibration_given,
    copy_bound,
    deployment_for,
    parse_pairs,
    print_layer_means,
    run_record,
    split_bound,
    summarize,
)
from inference.runtime.metrics import BREAKDOWN
from inference.tools.emulation import emulation_for

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_pairs_parse_and_bad_ones_say_why() -> None:
    assert parse_pairs("16:32,64:8") == [(16, 32), (64, 8)]
    for bad in ("16", "a:b", "0:8", "8:1"):
        with pytest.raises(ValueError):
            parse_pairs(bad)


def test_lru_offload_runs_on_one_box_and_the_others_on_the_network() -> None:
    assert deployment_for("lru-offload", 8).workers == 1 and not deployment_for("lru-offload", 8).networked
    assert deployment_for("odmoe", 8).workers == 8 and deployment_for("full-cache", 8).networked


def run(decode: float, peak: int = 1) -> dict:
    """One length pair's figures as ``run_strategy`` records them."""
    return {
        "input": 6,
        "output": 4,
        "decode_tok_s": decode,
        "e2e_tok_s": decode / 2,
        "ttft_ms": 10.0,
        "recall": None,
        "peak_expert_bytes_per_worker": peak,
    }


def test_ratios_are_taken_against_full_cache_of_the_same_run() -> None:
    results = {
        name: summarize([run(v), run(v)]) for name, v in [("full-cache", 10.0), ("odmoe", 9.0), ("lru-offload", 3.0)]
    }
    add_ratios(results)
    assert results["odmoe"]["decode_tok_s_vs_full_cache"] == pytest.approx(0.9)
    assert results["odmoe"]["decode_vs_lru_offload"] == pytest.approx(3.0)
    assert results["full-cache"]["e2e_tok_s_vs_full_cache"] == 1.0


def test_rounds_report_medians_of_ratios_taken_within_each_round() -> None:
    decode = {  # per round; full cache is fastest in round 3, odmoe slowest there: drift of the machine
        "full-cache": [10.0, 8.0, 12.0],
        "odmoe": [8.0, 7.0, 6.0],
        "lru-offload": [2.0, 2.0, 3.0],
        "odmoe+hybrid": [14.0, 14.0, 9.0],
    }
    peaks = {"odmoe": [1, 3, 2]}
    rounds = [
        {
            name: summarize([run(rates[i], peaks.get(name, [1, 1, 1])[i])] * 2) | {"token_agreement": 1.0}
            for name, rates in decode.items()
        }
        for i in range(3)
    ]
    given = json.dumps(rounds)
    results = aggregate_rounds(rounds)
    assert json.dumps(rounds) == given  # pure: the rounds are left as they were
    odmoe, full = results["odmoe"], results["full-cache"]
    assert odmoe["decode_tok_s"] == 7.0 and odmoe["decode_tok_s_range"] == [6.0, 8.0]
    assert odmoe["decode_tok_s_spread"] == pytest.approx(2 / 7)
    assert odmoe["e2e_tok_s"] == 3.5 and odmoe["ttft_ms"] == 10.0 and odmoe["ttft_ms_spread"] == 0
    assert full["decode_tok_s"] == 10.0 and full["decode_tok_s_spread"] == pytest.approx(0.4)
    # odmoe ÷ full cache in each round: 0.8, 0.875, 0.5; median 0.8, not the ratio of the medians (0.7)
    assert odmoe["decode_tok_s_vs_full_cache"] == pytest.approx(0.8)
    assert odmoe["decode_tok_s_vs_full_cache_range"] == pytest.approx([0.5, 0.875])
    assert odmoe["decode_tok_s_vs_full_cache_spread"] == pytest.approx(0.375 / 0.8)
    assert [r["decode_tok_s_vs_full_cache"] for r in odmoe["rounds"]] == pytest.approx([0.8, 0.875, 0.5])
    assert full["decode_tok_s_vs_full_cache"] == 1.0 and full["decode_tok_s_vs_full_cache_spread"] == 0
    # odmoe ÷ lru-offload: 4, 3.5, 2; odmoe+hybrid ÷ odmoe: 1.75, 2, 1.5
    assert odmoe["decode_vs_lru_offload"] == pytest.approx(3.5)
    assert odmoe["decode_vs_lru_offload_range"] == pytest.approx([2.0, 4.0])
    assert results["odmoe+hybrid"]["decode_vs_without_hybrid"] == pytest.approx(1.75)
    assert results["odmoe+hybrid"]["decode_vs_without_hybrid_spread"] == pytest.approx(0.5 / 1.75)
    assert odmoe["peak_expert_bytes_per_worker"] == 3  # a peak is the largest over the rounds
    assert [p["decode_tok_s"] for p in odmoe["pairs"]] == [7.0, 7.0]  # each pair's median too
    assert odmoe["pairs"][0]["input"] == 6 and odmoe["pairs"][0]["recall"] is None
    assert odmoe["recall"] is None and odmoe["token_agreement"] == 1.0 and len(odmoe["rounds"]) == 3


def test_rounds_report_where_a_layer_went_part_by_part() -> None:
    def with_parts(hops: float | None) -> dict:
        figures = run(8.0)
        figures["main_between_layers_ms"] = None if hops is None else 1.0
        figures["layer_parts_ms"] = None if hops is None else {"hops": hops, "worker_busy": 2.0}
        return figures

    rounds = [{"odmoe": summarize([with_parts(h), with_parts(None)])} for h in (0.5, 0.75, 0.25)]
    odmoe = aggregate_rounds(rounds)["odmoe"]
    # A pair that reported nothing (None) is left out; then each part is the median over the rounds.
    assert odmoe["layer_parts_ms"]["hops"] == 0.5 and odmoe["layer_parts_ms"]["worker_busy"] == 2.0
    assert odmoe["layer_parts_ms"]["main_before_send"] is None
    assert odmoe["main_between_layers_ms"] == 1.0
    assert odmoe["pairs"][0]["layer_parts_ms"] == {"hops": 0.5, "worker_busy": 2.0}
    assert odmoe["pairs"][1]["layer_parts_ms"] is None


def test_the_means_of_a_layers_parts_are_averaged_over_the_pairs_and_printed_per_token(
    capsys: pytest.CaptureFixture,
) -> None:
    def with_means(between: float, hops: float) -> dict:
        figures = run(100.0)  # a token every 10 ms
        figures["main_between_layers_mean_ms"] = between
        figures["layer_parts_mean_ms"] = {"hops": hops, "worker_busy": 2.0}
        return figures

    odmoe = summarize([with_means(1.0, 1.0), with_means(2.0, 2.0)])
    assert odmoe["main_between_layers_mean_ms"] == 1.5
    assert odmoe["layer_parts_mean_ms"]["hops"] == 1.5 and odmoe["layer_parts_mean_ms"]["worker_python"] is None
    reactive = summarize([run(100.0)])  # recorded before the means: no row
    print_layer_means({"odmoe": odmoe, "reactive": reactive}, layers=2)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[-1] == "| odmoe | 1.500 |  | 1.500 |  | 2.000 |  | 10.0 | 10.0 |"  # 2 × (1.5 + 1.5 + 2.0)
    assert not any(row.startswith("| reactive") for row in rows)


def test_the_costs_in_the_runtimes_rhythm_come_from_its_layer_breakdown() -> None:
    rhythm = {
        "main_between_layers_ms": 1.5,
        "parts_ms": {
            "main_before_send": 0.25,
            "hops": 0.5,
            "worker_python": 0.25,
            "worker_busy": 2.0,
            "main_after_answers": 0.125,
        },
    }
    costs = costs_in_rhythm(rhythm, top_k=2, hold_wake=1e-4)
    assert costs.main_layer_s == pytest.approx(1.5e-3) and costs.step_fixed_s == 0.0  # per token: in the layers
    assert costs.main_before_send_s == pytest.approx(0.25e-3) and costs.main_dispatch_s == pytest.approx(0.125e-3)
    assert costs.round_trip_s == pytest.approx(0.5e-3)  # the hops; the worker's own Python comes after them
    assert costs.worker_python_s == pytest.approx(0.25e-3) and costs.hold_wake_s == 1e-4
    assert costs.expert_compute_s == pytest.approx(1e-3)  # the request's two experts


def test_one_round_gives_the_figures_of_a_single_run() -> None:
    single = {name: summarize([run(v), run(v / 2)]) for name, v in [("full-cache", 10.0), ("odmoe", 9.0)]}
    results = aggregate_rounds([single])
    add_ratios(single)
    for name, figures in single.items():
        assert {key: results[name][key] for key in figures} == figures
        assert results[name]["decode_tok_s_range"] == [figures["decode_tok_s"]] * 2
        assert results[name]["decode_tok_s_spread"] == 0 and results[name]["rounds"] == [figures]


def test_the_ratios_are_none_without_full_cache_and_get_no_range() -> None:
    results = aggregate_rounds([{"odmoe": summarize([run(v)])} for v in (8.0, 6.0)])
    assert results["odmoe"]["decode_tok_s"] == 7.0 and results["odmoe"]["decode_tok_s_vs_full_cache"] is None
    assert "decode_tok_s_vs_full_cache_range" not in results["odmoe"]


def _write_record(path: Path, expert_compute_s: float) -> None:
    """A ``--json`` file as the benchmark writes it, for a run scaled by ``expert_compute_s``."""
    emulation = emulation_for(DEFAULT_PROFILE, expert_compute_s, 1000, 10)
    calibration = Calibration("measured", expert_compute_s, expert_compute_s)
    record = run_record(build_parser().parse_args([]), emulation, calibration, [(6, 4)], [], True, {}, {})
    path.write_text(json.dumps(record, indent=2))


def test_calibration_takes_the_time_a_previous_runs_json_was_scaled_by(tmp_path: Path) -> None:
    previous = tmp_path / "previous.json"
    _write_record(previous, 0.00153)
    assert json.loads(previous.read_text())["calibration"] == {
        "source": "measured",
        "expert_compute_here_s": 0.00153,
        "measured_here_s": 0.00153,
    }
    parser = build_parser()
    assert calibration_given(parser.parse_args(["--calibration", str(previous)]), parser) == (str(previous), 0.00153)
    source, seconds = calibration_given(parser.parse_args(["--expert-compute-ms", "1.53"]), parser)
    assert source == "--expert-compute-ms" and seconds == pytest.approx(0.00153)
    assert calibration_given(parser.parse_args([]), parser) is None  # measured


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["--expert-compute-ms", "1.5", "--calibration", "{previous}"], "not allowed with"),
        (["--expert-compute-ms", "0"], "--expert-compute-ms must be a positive number"),
        (["--expert-compute-ms", "-1.5"], "--expert-compute-ms must be a positive number"),
        (["--expert-compute-ms", "nan"], "--expert-compute-ms must be a positive number"),
        (["--calibration", "{missing}"], "cannot read"),
        (["--calibration", "{not_json}"], "cannot read"),
        (["--calibration", "{without_key}"], "has no emulation.expert_compute_here_s"),
        (["--calibration", "{zero}"], "must be a positive number, got 0"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--max-resident-experts", "0"], "--max-resident-experts must be at least 1"),
    ],
)
def test_bad_calibration_and_repeats_are_refused_before_running(
    arguments: list[str], says: str, tmp_path: Path, capsys
) -> None:
    from benchmarks.strategies import main

    files = {name: tmp_path / f"{name}.json" for name in ("previous", "missing", "not_json", "without_key", "zero")}
    _write_record(files["previous"], 0.0015)
    files["not_json"].write_text("decode 7.0 tok/s")
    files["without_key"].write_text(json.dumps({"emulation": {"scale": 1.0}, "strategies": {}}))
    files["zero"].write_text(json.dumps({"emulation": {"expert_compute_here_s": 0}}))
    with pytest.raises(SystemExit) as refused:
        main([argument.format(**files) for argument in arguments])
    assert refused.value.code == 2
    assert says in capsys.readouterr().err


def test_the_copy_bound_is_each_workers_share_of_a_tokens_loads() -> None:
    bound = copy_bound(layers=8, top_k=2, workers=8, expert_bytes=1000, copy_bytes_per_s=100_000)
    assert bound["loads_per_worker_per_token"] == 2 and bound["load_ms"] == pytest.approx(10.0)
    assert bound["tok_s"] == pytest.approx(50.0)  # 2 loads x 10 ms per token


def test_the_split_bound_balances_the_copies_against_the_cpu_experts_on_the_critical_path() -> None:
    # copies 10 ms and CPU 5 ms per expert: 16 experts, x on the CPUs, (16 - x) x 10 / 8 = x / 2 x 5
    bound = split_bound(8, 2, 8, 1000, copy_bytes_per_s=100_000, host_memory_bytes_per_s=200_000)
    assert bound["cpu_experts_per_token"] == pytest.approx(16 / 3)
    assert bound["tok_s"] == pytest.approx(1000 / (16 / 3 / 2 * 5))  # 13.3 ms per token
    plain = copy_bound(8, 2, 8, 1000, 100_000)
    assert bound["tok_s"] / plain["tok_s"] == pytest.approx(1 + 2 * 10 / (8 * 5))
    # a CPU far slower than the copies leaves (almost) everything to them
    slow_cpu = split_bound(8, 2, 8, 1000, copy_bytes_per_s=100_000, host_memory_bytes_per_s=1)
    assert slow_cpu["tok_s"] == pytest.approx(plain["tok_s"], rel=1e-3)


@pytest.mark.alone
@pytest.mark.slow
def test_the_benchmark_runs_every_strategy_exactly(tiny_model: Path, tmp_path: Path, capsys) -> None:
    from benchmarks.strategies import main

    out = tmp_path / "strategies.json"
    code = main(
        [
            "--model",
            str(tiny_model),
            "--workers",
            "2",
            "--pairs",
            "6:4,10:4",
            "--expert-compute-ms",
            "0.02",  # about what the tiny model's expert takes here: the run takes as long as measured
            "--json",
            str(out),
            "--plots",
            str(tmp_path),
            "--in-process",
        ]
    )
    assert code == 0  # every output token-identical to Transformers
    figures = json.loads(out.read_text())
    assert figures["profile"] == "3090-pcie4-1gbe" and figures["exact"] is True
    assert set(figures["strategies"]) == {"odmoe", "full-cache", "reactive", "lru-offload"}
    for name, result in figures["strategies"].items():
        assert result["decode_tok_s"] > 0 and result["ttft_ms"] > 0 and len(result["pairs"]) == 2, name
    assert figures["strategies"]["full-cache"]["decode_tok_s_vs_full_cache"] == 1.0
    assert figures["emulation"]["load_to_compute"] > 10
    assert figures["max_resident_experts"] == figures["emulation"]["prefetch_depth"] == 2  # the profile's depth
    assert figures["emulation"]["expert_compute_here_s"] == pytest.approx(2e-5)  # scaled by the given time
    calibration = figures["calibration"]
    assert calibration["source"] == "--expert-compute-ms" and calibration["measured_here_s"] > 0
    assert calibration["expert_compute_here_s"] == pytest.approx(2e-5) and figures["repeats"] == 1
    # The simulator is given the costs of a main + one worker of the runtime measured just before the
    # run; the same pieces timed alone (an expert: this machine's own time, whatever the scale) are kept.
    prediction = figures["sim_prediction"]["plain"]
    measurement = prediction["measurement"]
    rhythm = measurement["in_rhythm"]
    assert prediction["machine"] == costs_in_rhythm(rhythm, 2, rhythm["hold_wake_s"]).as_dict()
    assert 0 < rhythm["hold_wake_s"] < 0.05  # the emulated link's held messages are handed out late
    assert measurement["tight_loop"]["expert_compute_s"] == calibration["measured_here_s"]
    assert set(measurement["in_rhythm"]["parts_ms"]) == set(BREAKDOWN)
    odmoe = figures["strategies"]["odmoe"]
    assert odmoe["sim_predicted_decode_tok_s"] > 0 and odmoe["sim_predicted_decode_tok_s_tight_loop_costs"] > 0
    assert odmoe["layer_parts_ms"]["worker_busy"] > 0 and odmoe["main_between_layers_ms"] > 0
    assert odmoe["layer_parts_mean_ms"]["worker_busy"] > 0 and odmoe["main_between_layers_mean_ms"] > 0
    printed = capsys.readouterr().out
    assert "| odmoe |" in printed and "profile 3090-pcie4-1gbe" in printed and "copy-bound ceiling" in printed
    assert figures["strategies"]["odmoe"]["copy_bound"]["tok_s"] > 0
    assert "copy + host-memory ceiling" in printed
    assert "| the same timed alone in tight loops |" in printed
    assert odmoe["split_bound"]["tok_s"] > odmoe["copy_bound"]["tok_s"]
    assert (tmp_path / "strategies.png").read_bytes().startswith(PNG_MAGIC)


def test_an_approximate_strategy_on_a_model_without_its_table_is_refused_before_running(
    tiny_model: Path, capsys
) -> None:
    from benchmarks.strategies import main

    with pytest.raises(SystemExit) as refused:
        main(["--model", str(tiny_model), "--strategies", "odmoe,importance"])
    assert refused.value.code == 2
    assert "importance needs" in capsys.readouterr().err


@pytest.mark.slow
def test_an_approximate_strategy_is_marked_and_its_agreement_measured_in_every_round(
    tiny_model: Path, tmp_path: Path, capsys
) -> None:
    import shutil

    import torch

    from benchmarks.strategies import main
    from inference.runtime.importance import write_similarity
    from inference.tools.calibration import calibrate

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    ids = torch.randint(3, 400, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    write_similarity(model, calibrate(model, ids, window=100), len(ids))
    out = tmp_path / "strategies.json"
    arguments = ["--model", str(model), "--workers", "2", "--pairs", "6:8", "--strategies", "full-cache,importance"]
    code = main([*arguments, "--repeats", "2", "--json", str(out), "--in-process"])
    assert code == 0
    figures = json.loads(out.read_text())
    assert figures["exact"] is True  # the exact strategy's tokens in both rounds; importance's are measured
    assert figures["repeats"] == 2 and figures["calibration"]["source"] == "measured"
    full, importance = figures["strategies"]["full-cache"], figures["strategies"]["importance"]
    assert not full["approximate"] and full["token_agreement"] == 1.0
    assert importance["approximate"] and 0 <= importance["token_agreement"] <= 1
    assert len(full["rounds"]) == len(importance["rounds"]) == 2 and len(importance["pairs"]) == 1
    low, high = importance["decode_tok_s_range"]
    assert low <= importance["decode_tok_s"] <= high and importance["decode_tok_s_spread"] >= 0
    assert [r["decode_tok_s_vs_full_cache"] for r in full["rounds"]] == [1.0, 1.0]
    full_low, full_high = full["decode_tok_s_range"]
    assert f"| {full['decode_tok_s']:.2f} ({full_low:.2f}–{full_high:.2f}) |" in capsys.readouterr().out


def test_a_checkpoint_too_big_for_one_worker_here_keeps_the_tight_loop_costs(tiny_model: Path, monkeypatch) -> None:
    from benchmarks import sim_prediction

    config = json.loads((tiny_model / "config.json").read_text())
    monkeypatch.setattr(sim_prediction.os, "sysconf", lambda name: 1)  # a machine with (almost) no memory free
    costs, record = sim_prediction.measure_machine(config, 1e-3, model_dir=tiny_model, link_latency_s=1e-3)
    assert "would not fit one worker here" in record["in_rhythm_skipped"] and "in_rhythm" not in record
    assert costs.as_dict() == record["tight_loop"] and costs.expert_compute_s == 1e-3


def test_drafted_rows_run_beside_odmoe_with_their_bound_and_the_simulator_s_prediction(
    tiny_model: Path, tmp_path: Path
) -> None:
    from benchmarks.strategies import main

    out = tmp_path / "strategies.json"
    arguments = ["--model", str(tiny_model), "--workers", "2", "--pairs", "6:12", "--strategies", "odmoe,full-cache"]
    assert main([*arguments, "--drafts", "3,auto4", "--json", str(out), "--in-process"]) == 0
    figures = json.loads(out.read_text())
    assert figures["exact"] is True and figures["drafts"] == ["3", "auto4"]
    assert figures["commit"] and figures["started"] <= figures["ended"]  # its own provenance
    fixed, auto = figures["strategies"]["odmoe+drafts3"], figures["strategies"]["odmoe+drafts-auto4"]
    plain = figures["strategies"]["odmoe"]
    for row in (fixed, auto):
        assert row["decode_vs_without_drafts"] == pytest.approx(row["decode_tok_s"] / plain["decode_tok_s"])
        assert row["drafts_of_bound"] == pytest.approx(row["decode_vs_without_drafts"] / row["drafts_bound"])
        assert 1 <= row["tokens_per_pass"] <= 5 and row["top_k"] == 2
    # The simulator predicts each, from the drafts it measured before the run at k (auto: up to k, as
    # main's tuner picks at the agreement that measurement gives).
    assert fixed["sim_predicted_decode_tok_s"] > 0 and auto["sim_predicted_decode_tok_s"] > 0
    before = figures["sim_prediction"]["drafts3"]["drafts_before_run"]
    assert before["exact"] and 1 <= before["tokens_per_pass"] <= 4
    assert 1 <= figures["sim_prediction"]["drafts-auto4"]["drafts_before_run"]["tokens_per_pass"] <= 5
    # Main's real engine predicts the fixed k too (its shadow the run's dtype); auto it cannot.
    driven = figures["sim_prediction"]["drafts3"]["engine_driven"]
    assert fixed["sim_engine_predicted_decode_tok_s"] == driven["predicted_decode_tok_s"]["odmoe"] > 0
    assert 1 <= driven["tokens_per_pass"] <= 4 and driven["shadow_dtype"] == "fp32"
    assert (
        auto["sim_engine_predicted_decode_tok_s"] is None
        and figures["sim_prediction"]["drafts-auto4"]["engine_driven"] is None
    )
