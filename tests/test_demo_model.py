"""The shipped demo model: a valid checkpoint in the release layout, trained (not random), served exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.checkpoint import Checkpoint
from inference.launcher import ClusterOptions, LocalCluster
from inference.reference import reference_generate
from inference.textstream import load_tokenizer

DEMO = Path(__file__).resolve().parents[1] / "platform" / "demo-model"


def test_the_shipped_demo_model_is_the_checkpoint_its_record_describes() -> None:
    checkpoint = Checkpoint(DEMO)
    record = json.loads((DEMO / "training.json").read_text())
    assert (checkpoint.n_layers, checkpoint.n_experts, checkpoint.top_k) == (4, 8, 2)
    assert sum(checkpoint.nbytes(key) for key in checkpoint) == record["parameters"] * 4  # float32
    assert record["router_top_k_mass"] > 0.6 and record["corpus"]["pages"] > 100
    assert sum(f.stat().st_size for f in DEMO.iterdir()) < 40e6


@pytest.mark.slow
def test_the_runtime_serves_the_demo_model_exactly() -> None:
    tokenizer = load_tokenizer(DEMO)
    prompt = tokenizer("In Python, a dictionary")["input_ids"]
    with LocalCluster(DEMO, ClusterOptions(workers=2)) as cluster:
        done = cluster.generate(prompt, 16)
    assert done.token_ids == reference_generate(DEMO, prompt, 16)
    assert done.metrics["recall"] > 0.9  # an fp32 shadow aligned every step
