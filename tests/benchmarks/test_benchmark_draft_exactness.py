"""``benchmarks.draft_exactness`` runs a corner of its matrix and writes what it says it does (the whole
matrix is a recorded run: ``benchmarks/results/draft-exactness-*.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import draft_exactness


def test_one_checkpoint_with_a_lossy_shadow_is_exact_and_recorded(tmp_path: Path) -> None:
    out = tmp_path / "exactness.json"
    args = ["--families", "qwen3_moe", "--dtypes", "bfloat16", "--shadows", "nf4", "--in-process", "--json", str(out)]
    assert draft_exactness.main(args) == 0  # every answer what it must be
    record = json.loads(out.read_text())
    assert record["roles"] == "threads" and record["exact"] and record["commit"]
    (cell,) = record["cells"].values()
    assert cell["drafted"] > 0 and cell["largest_batch"] >= 2  # drafts made in a batch of streams
    assert all(value for key, value in cell.items() if "equals" in key)


def test_an_unknown_shadow_is_refused_before_anything_runs(capsys) -> None:
    with pytest.raises(SystemExit):
        draft_exactness.main(["--shadows", "fp8"])
    assert "--shadows: choose from fp16, int8, nf4" in capsys.readouterr().err
