"""The shipped demo model: a valid checkpoint in the release layout, trained (not random), served exactly;
its prerouter, trained on it and served as its own rule."""

from __future__ import annotations

import json

import pytest

from inference.modelio.checkpoint import Checkpoint
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.prerouter import load_prerouter, prerouted_generate
from inference.runtime.spec import DeploymentSettings
from inference.runtime.textstream import load_tokenizer
from inference.tools.reference import reference_generate
from tests.paths import REPO

DEMO = REPO / "platform" / "demo-model"


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
    with LocalCluster(DEMO, ClusterOptions(workers=2, in_process=True)) as cluster:
        done = cluster.generate(prompt, 16)
    assert done.token_ids == reference_generate(DEMO, prompt, 16)
    assert done.metrics["recall"] > 0.9  # an fp32 shadow aligned every step


def test_the_shipped_prerouter_is_the_demo_models_and_its_record_says_how_it_was_trained() -> None:
    trained = load_prerouter(DEMO, layers=4, experts=8, hidden=192, top_k=2)
    record = trained.record
    assert record["recipe"]["head_steps"] > 0 and record["recipe"]["lora_steps"] > 0
    assert record["tokens"]["train"] > 1_000_000  # the demo corpus's training share, not a test's text
    assert {"exact_ppl", "prerouted_ppl_without_lora", "prerouted_ppl", "exact_path_agreement"} <= set(record)
    assert any(bool(t.abs().sum()) for k, t in trained.lora.items() if k.endswith(".b"))  # a trained adapter


@pytest.mark.slow
def test_the_runtime_serves_the_demo_models_prerouter_as_its_own_rule() -> None:
    tokenizer = load_tokenizer(DEMO)
    prompt = tokenizer("In Python, a dictionary")["input_ids"]
    with LocalCluster(
        DEMO, ClusterOptions(workers=2, settings=DeploymentSettings(strategy="prerouter"), in_process=True)
    ) as cluster:
        done = cluster.generate(prompt, 16)
    assert done.token_ids == prerouted_generate(DEMO, prompt, 16)
    assert done.metrics["late_experts"] == 0
