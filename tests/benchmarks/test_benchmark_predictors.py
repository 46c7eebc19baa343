"""The predictors benchmark: its argument parsing, and one short run through the real runtime."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.predictors import parse_predictors
from inference.runtime.prerouter import save_prerouter
from tests.paths import REPO
from tests.reference import random_prerouter


def test_predictors_are_named_with_the_shadows_precision() -> None:
    assert parse_predictors("shadow:int8,next-gate") == [("shadow", "int8"), ("next-gate", None)]
    for bad, why in [
        ("oracle", "unknown predictor"),
        ("shadow", "names its precision"),
        ("shadow:int3", "names its precision"),
        ("next-gate:fp32", "only the shadow takes a precision"),
        ("", "at least one"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_predictors(bad)


@pytest.mark.slow
def test_a_short_run_compares_the_shadow_with_mains_next_gate_and_heads(tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    save_prerouter(model, random_prerouter(model))
    out = tmp_path / "predictors.json"
    command = [
        *(sys.executable, "-m", "benchmarks.predictors", "--model", str(model), "--workers", "2"),
        *("--predictors", "shadow:fp32,next-gate,prerouter", "--prompts", "2", "--new-tokens", "8"),
        *("--json", str(out), "--in-process"),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["exact"] is True
    shadow, gate = result["predictors"]["shadow:fp32"], result["predictors"]["next-gate"]
    assert shadow["recall"] == pytest.approx(1.0)  # an fp32 shadow aligned every step routes as main does
    assert gate["lead_layers"] == 1 and gate["predictor_gpu_bytes"] == 0 and gate["nodes"] == shadow["nodes"] - 1
    assert shadow["predictor_gpu_bytes"] > 0
    assert "| next-gate |" in done.stdout
    heads = result["predictors"]["prerouter"]
    assert heads["lead_layers"] == 1 and heads["nodes"] == gate["nodes"] and heads["predictor_gpu_bytes"] > 0
