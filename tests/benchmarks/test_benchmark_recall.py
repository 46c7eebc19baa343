"""The recall benchmark: its pure aggregation, its plots, and one small sweep through a real cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import recall
from benchmarks.plots import bar_plot, heatmaps, line_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000, path


def test_moving_average_is_centred_and_shrinks_at_the_ends() -> None:
    assert recall.moving_average([1.0, 2.0, 3.0, 4.0], 1) == [1.0, 2.0, 3.0, 4.0]
    assert recall.moving_average([0.0, 3.0, 6.0, 9.0], 3) == [1.5, 3.0, 6.0, 7.5]
    assert recall.moving_average([1.0, 1.0, 0.0, 0.0], 2) == [1.0, 0.5, 0.0, 0.0]
    assert recall.moving_average([], 5) == []
    assert recall.moving_average([0.5, 1.0], 100) == [0.75, 0.75]
    with pytest.raises(ValueError):
        recall.moving_average([1.0], 0)


def test_step_recalls_keep_decode_steps_only() -> None:
    per_step = [
        {"step": 0, "recall": None},
        {"step": 1, "recall": 1.0},
        {"step": 2, "recall": 0.5},
        {"step": 3, "recall": None},
    ]
    assert recall.step_recalls(per_step) == {1: 1.0, 2: 0.5}


def test_mean_by_position_averages_the_runs_that_reached_each_step() -> None:
    runs = [{1: 1.0, 2: 0.5, 3: 0.0}, {1: 0.5, 2: 0.5}]  # the second stopped early
    steps, means, counts = recall.mean_by_position(runs)
    assert steps == [1, 2, 3]
    assert means == [0.75, 0.5, 0.0]
    assert counts == [2, 2, 1]
    assert recall.mean_by_position([]) == ([], [], [])


def test_quarters_and_summary() -> None:
    assert recall.quarters([1.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.25, 0.25, 0.75]) == pytest.approx(
        [1.0, 0.5, 0.0, 1.25 / 3]
    )  # the last takes 3
    assert recall.quarters([0.5, 1.0]) == [0.5, 1.0]
    summary = recall.summarize([{1: 1.0, 2: 1.0, 3: 0.0, 4: 0.0}, {1: 1.0, 2: 0.0}])
    assert summary["recall"] == pytest.approx(0.5)  # pooled over the 6 decode steps
    assert summary["first_quarter"] == 1.0 and summary["last_quarter"] == 0.0
    assert summary["generations"] == 2 and summary["decode_steps"] == 6
    assert recall.summarize([])["recall"] is None


def test_first_miss_is_the_first_inexact_step() -> None:
    assert recall.first_miss({1: 1.0, 2: 1.0, 3: 0.5, 4: 1.0, 5: 0.0}) == 3
    assert recall.first_miss({2: 1.0, 1: 0.5}) == 1
    assert recall.first_miss({1: 1.0}) is None


def test_parse_ints_and_labels() -> None:
    assert recall.parse_ints("1, 4,16,0,") == [1, 4, 16, 0]
    assert recall.period_label(0) == "never" and recall.period_label(8) == "8"


def test_plot_helpers_write_pngs(tmp_path: Path) -> None:
    assert_png(
        line_plot(tmp_path / "a" / "line.png", {"x": ([1, 2, 3], [0.1, 0.5, 0.2])}, title="t", xlabel="x", ylabel="y")
    )
    assert_png(
        bar_plot(tmp_path / "bars.png", ["g1", "g2"], {"s1": [1, 2], "s2": [2, 1]}, title="t", xlabel="x", ylabel="y")
    )
    assert_png(
        heatmaps(
            tmp_path / "heat.png",
            {"p": [[1.0, 0.5], [0.2, 0.0]], "q": [[0.0, 0.1], [0.9, 1.0]]},
            row_labels=["1", "2"],
            col_labels=["1", "never"],
            title="t",
            row_title="r",
            col_title="c",
            vmin=0.0,
            vmax=1.0,
        )
    )


@pytest.mark.slow
def test_a_small_sweep_through_a_real_cluster(tiny_model: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "recall.json"
    plots = tmp_path / "plots"
    argv = [
        "--model",
        str(tiny_model),
        "--dtypes",
        "fp32",
        "--token-periods",
        "1,2",
        "--kv-periods",
        "1,0",
        "--new-tokens",
        "8",
        "--position-tokens",
        "12",
        "--prompts",
        "2",
        "--position-prompts",
        "2",
        "--window",
        "4",
        "--json",
        str(out),
        "--plots",
        str(plots),
    ]
    assert recall.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["token_periods"] == [1, 2] and record["kv_periods"] == [1, 0]
    fp32 = record["dtypes"]["fp32"]
    grid = {(e["token_period"], e["kv_period"]): e for e in fp32["sweep"]}
    assert set(grid) == {(1, 1), (1, 0), (2, 1), (2, 0)}
    assert all(0.0 <= e["recall"] <= 1.0 and e["generations"] == 2 for e in grid.values())
    # An fp32 shadow aligned every step routes exactly as main does.
    assert grid[(1, 1)]["recall"] == 1.0
    assert grid[(2, 0)]["kv_aligns"] == 0 < grid[(1, 1)]["kv_aligns"]
    position = fp32["position"]
    assert 0.0 <= position["recall"] <= 1.0
    assert position["token_aligns"] == position["kv_aligns"] == 0
    assert len(position["first_miss_step"]) == 2
    assert position["steps"][0] == 1 and len(position["steps"]) == len(position["mean_recall"]) <= 11
    for name in ("recall_vs_position.png", "recall_periods.png"):
        assert_png(plots / name)
    printed = capsys.readouterr()
    assert "| token period | KV period | fp32 |" in printed.out
    assert "[fp32] 4/4" in printed.err
