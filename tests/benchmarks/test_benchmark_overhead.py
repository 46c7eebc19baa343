"""The overhead benchmark: its pure figures, and one short run through a real main + worker."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import overhead


def _report(step: int, ms: float, layers: list[tuple[float, float]]) -> dict:
    return {
        "step": step,
        "ms": ms,
        "layers": [{"dispatch_ms": d, "worker_ms": w} for d, w in layers],
    }


def test_layer_samples_keep_decode_steps_only() -> None:
    reports = [
        _report(0, 50.0, [(9.0, 1.0)]),  # prefill
        _report(1, 4.0, [(1.0, 0.5), (1.5, 1.0)]),
        None,  # a token event without a report
        _report(2, 3.0, [(0.5, 0.25), (0.5, 0.5)]),
    ]
    assert overhead.layer_samples(reports) == [(1.0, 0.5), (1.5, 1.0), (0.5, 0.25), (0.5, 0.5)]


def test_layer_parts_keep_decode_steps_only() -> None:
    def layer(hops: float) -> dict:
        return {
            "breakdown_ms": {name: (hops if name == "hops" else 0.0) for name in overhead.BREAKDOWN},
            "hops_split_ms": {"receiving": hops / 4, "between_sockets": hops * 3 / 4},
        }

    reports = [{"step": 0, "layers": [layer(9.0)]}, None, {"step": 1, "layers": [layer(0.5), layer(0.25)]}]
    parts = overhead.layer_parts_ms(reports)
    assert parts["hops"] == [0.5, 0.25] and parts["worker_busy"] == [0.0, 0.0]
    assert parts["receiving"] == [0.125, 0.0625] and parts["between_sockets"] == [0.375, 0.1875]


def test_summary_and_percentiles() -> None:
    summary = overhead.summarize([(1.0, 0.5), (2.0, 0.5), (0.2, 0.5), (3.0, 1.0)])
    # coordination: 0.5, 1.5, 0 (never negative), 2.0
    assert summary["layers"] == 4
    assert summary["coordination_ms_median"] == pytest.approx(1.0)
    assert summary["coordination_ms_p90"] == pytest.approx(1.85)
    assert overhead.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert overhead.percentile([5.0], 0.9) == 5.0
    assert math.isnan(overhead.percentile([], 0.5))


@pytest.mark.slow
@pytest.mark.alone  # its parts are differences of clocks: another worker's cluster beside it can zero them
@pytest.mark.timeout(120)
def test_benchmark_runs_and_reports_sane_figures(tmp_path: Path, tiny_model: Path, capsys) -> None:
    out = tmp_path / "overhead.json"
    code = overhead.main(
        ["--model", str(tiny_model), "--new-tokens", "6", "--iterations", "60", "--no-full", "--json", str(out)]
    )
    assert code == 0
    figures = json.loads(out.read_text())
    measured = figures["measured"]
    assert measured["workers"] == 1 and measured["shadow"] is False
    assert measured["layers"] == len(overhead.PROMPTS) * 5 * 4  # 5 decode steps x 4 layers per prompt
    assert 0 <= measured["coordination_ms_median"] <= measured["coordination_ms_p90"]
    assert measured["dispatch_ms_median"] > 0 and measured["worker_ms_median"] > 0
    assert measured["main_ms_between_layers_median"] > 0  # from main's token intervals
    parts = measured["parts_ms_median"]  # the round trip in the cluster, by part
    assert list(parts) == [*overhead.BREAKDOWN, *overhead.HOPS_SPLIT] and min(parts.values()) >= 0
    # Each part is a difference of two processes' clocks, clamped at 0: on a loaded machine more
    # than half of the layers may clamp one (a median of 0.0 failed twice), so the test asks
    # that each part is measured in at least a tenth of the layers.
    p90 = measured["parts_ms_p90"]
    assert list(p90) == list(parts) and all(p90[name] >= parts[name] for name in parts)
    assert p90["hops"] > 0 and p90["worker_busy"] > 0 and p90["receiving"] > 0
    assert set(figures["breakdown_us"]) >= {"main: routing split", "worker: decode request"}
    assert all(us > 0 for us in figures["breakdown_us"].values())
    floors = (figures["raw_zmq_round_trip_us"], figures["raw_zmq_round_trip_in_rhythm_us"])
    assert all(0 < us < 1e6 for us in floors)
    assert figures["endpoint_round_trip_us"] > 0
    printed = capsys.readouterr().out
    assert "| coordination = round trip - busiest worker |" in printed
    assert "acceptance: median coordination <= 0.3 ms" in printed
    assert "| hops both ways: framing and decoding, CURVE, ZeroMQ, wake-ups, both receive loops |" in printed
    assert "| ... of the hops, in the receiving processes: decoding, other messages first (both sides) |" in printed
