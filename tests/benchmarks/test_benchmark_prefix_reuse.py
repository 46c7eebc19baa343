"""The prefix-reuse benchmark: one short run through the real runtime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO


@pytest.mark.slow
def test_a_short_run_measures_the_second_turn_with_and_without_reuse(tmp_path: Path) -> None:
    out = tmp_path / "prefix-reuse.json"
    command = [
        *(sys.executable, "-m", "benchmarks.prefix_reuse", "--workers", "2", "--first", "70", "--answer", "8"),
        *("--follow", "4", "--new-tokens", "6", "--repeats", "2", "--json", str(out), "--in-process"),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["roles"] == "threads" and result["exact"] is True
    # The first turn's cache held 70 + 8 - 1 positions: four whole blocks of 16.
    assert result["cached_prompt_tokens"] == [64, 64]
    assert result["second_prompt_tokens"] == 82
    assert len(result["ttft_ms"]["reuse"]["runs"]) == len(result["ttft_ratio"]["runs"]) == 2
    assert all(ms > 0 for ms in result["ttft_ms"]["no_reuse"]["runs"])
    assert "| ratio, round by round |" in done.stdout
