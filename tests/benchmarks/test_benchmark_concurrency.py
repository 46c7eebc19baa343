"""The concurrency benchmark: its pure figures, and one short run through the real runtime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import concurrency
from tests.paths import REPO


def test_stream_counts_are_parsed_and_checked() -> None:
    assert concurrency.parse_counts("8,1,2,2") == [1, 2, 8]
    for bad in ("", "0,1", "a"):
        with pytest.raises(ValueError):
            concurrency.parse_counts(bad)


@pytest.mark.parametrize(
    "bad",
    [["--streams", "0"], ["--strategies", "nope"], ["--new-tokens", "1"], ["--max-resident-experts", "-1"]],
)
def test_bad_arguments_are_refused_before_any_process_starts(bad: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        concurrency.main(bad)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_figures_are_medians_with_spread_and_scale_against_one_stream() -> None:
    runs = [{"aggregate_decode_tok_s": v, "per_stream_decode_tok_s": v / 2} for v in (10.0, 12.0, 11.0)]
    one = concurrency.summarize(runs)
    assert one["aggregate_decode_tok_s"] == {"median": 11.0, "min": 10.0, "max": 12.0, "runs": [10.0, 12.0, 11.0]}
    four = concurrency.summarize([{"aggregate_decode_tok_s": 33.0, "per_stream_decode_tok_s": 4.4}])
    per_count = {1: one, 4: four}
    concurrency.add_scaling(per_count)
    assert per_count[4]["aggregate_decode_tok_s_vs_1_stream"] == pytest.approx(3.0)
    assert per_count[4]["per_stream_decode_tok_s_vs_1_stream"] == pytest.approx(0.8)


@pytest.mark.slow
def test_a_short_run_writes_its_json_and_every_stream_is_exact(tmp_path: Path, tiny_model: Path) -> None:
    out = tmp_path / "concurrency.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.concurrency",
        "--model",  # the session's tiny model: its emulated copies scale to its small experts
        str(tiny_model),
        "--strategies",
        "odmoe",
        "--workers",
        "2",
        "--streams",
        "1,3",
        "--new-tokens",
        "6",
        "--repeats",
        "1",
        "--json",
        str(out),
        "--in-process",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["exact"] is True
    three = result["strategies"]["odmoe"]["3"]
    assert three["largest_batch"]["median"] >= 2  # the streams ran as one batch
    # The decode step splits into main's expert rounds and main's own work, both measured.
    step = three["decode_step_ms"]["median"]
    rounds = three["expert_rounds_ms_per_step"]["median"]
    assert 0 < rounds < step
    assert three["main_ms_per_step"]["median"] == pytest.approx(step - rounds)
    assert three["aggregate_decode_tok_s"]["median"] > 0 and three["loads_per_token"]["median"] > 0
    assert "| odmoe | 3 |" in done.stdout
