"""The chunked-prefill benchmark: one short run through the real runtime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO


@pytest.mark.slow
def test_a_short_run_measures_the_stall_whole_and_in_pieces(tmp_path: Path, tiny_model: Path) -> None:
    out = tmp_path / "chunked.json"
    command = [
        *(sys.executable, "-m", "benchmarks.chunked_prefill", "--workers", "2", "--decoders", "2"),
        *("--model", str(tiny_model)),  # the session's tiny model: its emulated copies scale to its small experts
        *("--long-prompt", "40", "--steps", "0,16", "--new-tokens", "16", "--repeats", "1", "--json", str(out)),
        "--in-process",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["exact"] is True  # each answer is Transformers' own run with the same pieces
    whole, pieces = result["prefill_steps"]["0"], result["prefill_steps"]["16"]
    assert whole["long_prompt_pieces"]["median"] == 1 and pieces["long_prompt_pieces"]["median"] == 3
    for figures in (whole, pieces):
        assert figures["decoder_longest_gap_ms"]["median"] >= figures["decoder_median_gap_ms"]["median"] > 0
        assert figures["long_prompt_ttft_ms"]["median"] > 0
    assert "| 16 | 3 |" in done.stdout
