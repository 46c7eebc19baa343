"""The quality benchmark: its strategy list, and one short run through the real runtime."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.quality import parse_strategies
from inference.runtime.importance import write_similarity
from inference.runtime.prerouter import save_prerouter
from inference.tools.calibration import calibrate
from tests.paths import REPO
from tests.reference import random_prerouter


def test_importance_runs_once_per_threshold_and_unknown_strategies_are_refused() -> None:
    assert parse_strategies("odmoe,importance,prerouter", [0.2, 0.5]) == [
        ("odmoe", "odmoe", 0.0),
        ("importance@0.2", "importance", 0.2),
        ("importance@0.5", "importance", 0.5),
        ("prerouter", "prerouter", 0.0),
    ]
    with pytest.raises(ValueError, match="unknown strategy"):
        parse_strategies("belady", [0.3])
    with pytest.raises(ValueError, match="at least one"):
        parse_strategies("", [0.3])


@pytest.mark.slow
def test_a_short_run_scores_exact_and_approximate_strategies(tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    ids = torch.randint(3, 400, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    write_similarity(model, calibrate(model, ids, window=100), len(ids))
    save_prerouter(model, random_prerouter(model))
    text = tmp_path / "held-out.txt"
    text.write_text("Experts are loaded on demand and evicted after use. " * 20, encoding="utf-8")
    out = tmp_path / "quality.json"
    command = [
        *(sys.executable, "-m", "benchmarks.quality", "--model", str(model), "--workers", "2"),
        *("--strategies", "odmoe,importance,prerouter", "--thresholds", "0,1", "--held-out", str(text)),
        *("--ppl-tokens", "40", "--prompts", "2", "--new-tokens", "8", "--repeats", "2", "--json", str(out)),
        *("--baseline", "odmoe", "--in-process"),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["strategies"]
    exact, nothing, everything = runs["odmoe"], runs["importance@0"], runs["importance@1"]
    assert not exact["approximate"] and exact["token_agreement"] == 1.0 and exact["cache_hit_rate"] is None
    # With a threshold of 0 importance substitutes nothing: the exact model's perplexity and tokens.
    assert nothing["approximate"] and nothing["substitutions_per_token"] == 0
    assert nothing["ppl"] == pytest.approx(exact["ppl"], rel=1e-4) and nothing["token_agreement"] == 1.0
    assert everything["substitutions_per_token"] > 0 and everything["ppl"] != pytest.approx(exact["ppl"], rel=1e-4)
    assert all(run["same_tokens_every_repeat"] for run in runs.values())  # fresh caches, the same answers
    assert all(len(run["decode_tok_s_runs"]) == 2 for run in runs.values())  # two interleaved rounds
    assert exact["decode_vs_odmoe"] == 1.0  # each round's rate over the baseline's in the same round
    assert "| importance@1 | approximate |" in done.stdout
    prerouted = runs["prerouter"]
    assert prerouted["approximate"] and prerouted["late_experts_per_token"] == 0
    assert prerouted["tokens_of_its_own_rule"] is True and prerouted["expert_store"] == "hot"
    assert 0 <= prerouted["router_agreement"] <= 1 and prerouted["disk_reads_per_token"] > 0
