"""benchmarks.strategies end to end on the tiny model: runs, stays exact, writes what it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.strategies import add_ratios, copy_bound, deployment_for, parse_pairs, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_pairs_parse_and_bad_ones_say_why() -> None:
    assert parse_pairs("16:32,64:8") == [(16, 32), (64, 8)]
    for bad in ("16", "a:b", "0:8", "8:1"):
        with pytest.raises(ValueError):
            parse_pairs(bad)


def test_lru_offload_runs_on_one_box_and_the_others_on_the_network() -> None:
    assert deployment_for("lru-offload", 8).workers == 1 and not deployment_for("lru-offload", 8).networked
    assert deployment_for("odmoe", 8).workers == 8 and deployment_for("full-cache", 8).networked


def test_ratios_are_taken_against_full_cache_of_the_same_run() -> None:
    def run(decode: float) -> dict:
        return {
            "decode_tok_s": decode,
            "e2e_tok_s": decode / 2,
            "ttft_ms": 10.0,
            "recall": None,
            "peak_expert_bytes_per_worker": 1,
        }

    results = {
        name: summarize([run(v), run(v)]) for name, v in [("full-cache", 10.0), ("odmoe", 9.0), ("lru-offload", 3.0)]
    }
    add_ratios(results)
    assert results["odmoe"]["decode_tok_s_vs_full_cache"] == pytest.approx(0.9)
    assert results["odmoe"]["decode_vs_lru_offload"] == pytest.approx(3.0)
    assert results["full-cache"]["e2e_tok_s_vs_full_cache"] == 1.0


def test_the_copy_bound_is_each_workers_share_of_a_tokens_loads() -> None:
    bound = copy_bound(layers=8, top_k=2, workers=8, expert_bytes=1000, copy_bytes_per_s=100_000)
    assert bound["loads_per_worker_per_token"] == 2 and bound["load_ms"] == pytest.approx(10.0)
    assert bound["tok_s"] == pytest.approx(50.0)  # 2 loads x 10 ms per token


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
            "--json",
            str(out),
            "--plots",
            str(tmp_path),
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
    printed = capsys.readouterr().out
    assert "| odmoe |" in printed and "profile 3090-pcie4-1gbe" in printed and "copy-bound ceiling" in printed
    assert figures["strategies"]["odmoe"]["copy_bound"]["tok_s"] > 0
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
def test_an_approximate_strategy_is_marked_and_its_agreement_measured(tiny_model: Path, tmp_path: Path) -> None:
    import shutil

    import torch

    from benchmarks.strategies import main
    from inference.importance import calibrate, write_similarity

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    ids = torch.randint(3, 400, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    write_similarity(model, calibrate(model, ids, window=100), len(ids))
    out = tmp_path / "strategies.json"
    arguments = ["--model", str(model), "--workers", "2", "--pairs", "6:8", "--strategies", "full-cache,importance"]
    code = main([*arguments, "--json", str(out)])
    assert code == 0
    figures = json.loads(out.read_text())
    assert figures["exact"] is True  # the exact strategy's tokens; importance's are measured, not required
    full, importance = figures["strategies"]["full-cache"], figures["strategies"]["importance"]
    assert not full["approximate"] and full["token_agreement"] == 1.0
    assert importance["approximate"] and 0 <= importance["token_agreement"] <= 1
