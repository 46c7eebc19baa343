"""``benchmarks.main_memory`` on a tiny checkpoint: it serves each count at once and records main's peaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import main_memory
from inference.tools.tiny import make_tiny

pytestmark = pytest.mark.slow


def test_records_main_peak_for_each_sequence_count(tmp_path: Path) -> None:
    model = make_tiny(tmp_path / "model", seed=0)
    out = tmp_path / "memory.json"
    argv = ["--model", str(model), "--sequences", "1,2", "--prompt-len", "8", "--new-tokens", "3", "--workers", "2"]
    assert main_memory.main([*argv, "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["sequences"] for r in results["runs"]] == [1, 2]
    for run in results["runs"]:
        assert 0 < run["main_ready_rss_bytes"] <= run["main_ready_peak_bytes"] <= run["main_peak_bytes"]
        assert run["main_growth_bytes"] == run["main_peak_bytes"] - run["main_ready_rss_bytes"]
    # Two points: the slope is their difference.
    peaks = [r["main_peak_bytes"] for r in results["runs"]]
    assert results["main_peak_bytes_per_sequence"] == pytest.approx(peaks[1] - peaks[0])
    # layers x (keys, values) x key-value heads x head dim x fp32 bytes x positions
    assert results["kv_bytes_per_sequence"] == 4 * 2 * 2 * 16 * 4 * 11


def test_prompts_differ_and_stay_in_the_vocabulary() -> None:
    prompts = main_memory.prompts_for(8, 64, 512)
    assert len({tuple(p) for p in prompts}) == 8
    assert all(3 <= t < 512 for p in prompts for t in p)
