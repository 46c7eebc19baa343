"""The importance strategy (approximate): similarity, the substitution rule, main's view of the
caches, calibration, and the strategy served end to end."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from inference.policies.strategies import RUNTIME_STRATEGIES, STRATEGIES, get_strategy
from inference.runtime.importance import (
    SIMILARITY_FILE,
    ResidentExperts,
    load_similarity,
    similarity_from_outputs,
    substitute,
    write_similarity,
)
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings, SpecError, validate_settings
from inference.tools.calibration import calibrate
from tests.reference import PROMPTS, reference_generate


def test_similarity_is_the_mean_cosine_of_the_experts_outputs() -> None:
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    outputs = torch.stack([a, 3 * a, torch.tensor([[0.0, 1.0], [1.0, 0.0]]), -a])
    table = similarity_from_outputs(outputs)
    assert table.shape == (4, 4)
    assert torch.allclose(table.diagonal(), torch.ones(4))
    assert table[0, 1] == pytest.approx(1.0)  # the same direction, another scale
    assert table[0, 2] == pytest.approx(0.0)  # orthogonal on both rows
    assert table[0, 3] == pytest.approx(-1.0)
    assert torch.equal(table, table.T)
    with pytest.raises(ValueError):
        similarity_from_outputs(torch.zeros(3, 0, 2))


SIMILAR = torch.tensor(
    [
        [1.0, 0.9, 0.1, 0.5],
        [0.9, 1.0, 0.2, 0.4],
        [0.1, 0.2, 1.0, 0.3],
        [0.5, 0.4, 0.3, 1.0],
    ]
)


def test_only_unimportant_experts_that_nobody_holds_are_substituted_by_the_most_similar_held_one() -> None:
    index = torch.tensor([[0, 1], [2, 0], [3, 2]])
    weights = torch.tensor([[0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])
    chosen, count = substitute(index, weights, {1, 3}, SIMILAR, threshold=0.35)
    # token 0: expert 1 is held; token 1: expert 0 (0.3) -> 1, its most similar held one;
    # token 2: expert 2 (0.4) is important enough and stays although nobody holds it.
    assert chosen.tolist() == [[0, 1], [2, 1], [3, 2]]
    assert count == 1
    assert index.tolist() == [[0, 1], [2, 0], [3, 2]]  # the routing itself is untouched


def test_a_substitute_is_never_an_expert_the_token_already_computes() -> None:
    chosen, count = substitute(torch.tensor([[1, 0]]), torch.tensor([[0.9, 0.1]]), {1}, SIMILAR, 0.5)
    assert chosen.tolist() == [[1, 0]] and count == 0  # 1 is the only held one, and already chosen
    chosen, count = substitute(torch.tensor([[1, 0]]), torch.tensor([[0.9, 0.1]]), {1, 2, 3}, SIMILAR, 0.5)
    assert chosen.tolist() == [[1, 3]] and count == 1  # 0's most similar held one besides 1
    assert substitute(torch.tensor([[1, 0]]), torch.tensor([[0.9, 0.1]]), {2}, SIMILAR, 0.0)[1] == 0
    assert substitute(torch.tensor([[1, 0]]), torch.tensor([[0.9, 0.1]]), set(), SIMILAR, 0.5)[1] == 0


def test_mains_view_of_the_caches_keeps_the_most_recently_used_per_worker_and_layer() -> None:
    held = ResidentExperts(capacity_per_layer=2)
    held.used(0, 5, [1, 2])
    held.used(1, 5, [4])
    held.used(0, 6, [7])
    assert held.resident(5) == {1, 2, 4} and held.resident(6) == {7}
    held.used(0, 5, [1, 3])  # 1 is used again, 3 comes in: 2 is the least recent and goes
    assert held.resident(5) == {1, 3, 4}
    held.forget(0)
    assert held.resident(5) == {4} and held.resident(6) == set()
    assert ResidentExperts(0).resident(5) == set()


def test_approximate_strategies_are_marked_and_served_by_the_runtime_only() -> None:
    assert "importance" in RUNTIME_STRATEGIES and "importance" not in STRATEGIES
    assert not get_strategy("importance").exact and all(get_strategy(s).exact for s in STRATEGIES)
    assert get_strategy("importance").cache == "lru" and get_strategy("importance").predictor is None
    validate_settings(DeploymentSettings(strategy="importance", importance_threshold=0.5))
    with pytest.raises(SpecError, match="importance_threshold"):
        validate_settings(DeploymentSettings(strategy="importance", importance_threshold=1.5))


@pytest.fixture(scope="module")
def calibrated(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model with its similarity table (random ids: its routers are random too)."""
    model = tmp_path_factory.mktemp("importance") / "model"
    shutil.copytree(tiny_model, model)
    ids = torch.randint(3, 400, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    write_similarity(model, calibrate(model, ids, window=128), len(ids))
    return model


def test_calibration_compares_every_expert_of_every_layer(calibrated: Path) -> None:
    table = load_similarity(calibrated)
    assert table.shape == (4, 8, 8)  # the tiny model's layers and experts
    assert torch.allclose(table.diagonal(dim1=1, dim2=2), torch.ones(4, 8), atol=1e-5)
    assert torch.allclose(table, table.transpose(1, 2), atol=1e-6)
    assert (table.abs() <= 1 + 1e-5).all()


def test_a_missing_table_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="python -m inference calibrate"):
        load_similarity(tmp_path)


def test_a_table_calibrated_for_another_model_is_refused(tmp_path: Path) -> None:
    write_similarity(tmp_path, torch.eye(8).expand(4, 8, 8), tokens=10)
    assert load_similarity(tmp_path, layers=4, experts=8).shape == (4, 8, 8)
    with pytest.raises(ValueError, match="is for 4 layers of 8 experts, the model has 32 of 8"):
        load_similarity(tmp_path, layers=32, experts=8)
    with pytest.raises(ValueError, match="the model has 4 of 6"):
        load_similarity(tmp_path, layers=4, experts=6)


@pytest.mark.slow
def test_importance_serves_substitutes_and_without_a_threshold_is_exact(calibrated: Path) -> None:
    prompts = PROMPTS[:3]
    exact = DeploymentSettings(strategy="importance", cache_experts=1, importance_threshold=0.0)
    with LocalCluster(calibrated, ClusterOptions(workers=2, settings=exact, in_process=True)) as cluster:
        assert "shadow" not in cluster.roles
        plain = [cluster.generate(p, 16) for p in prompts]
    for prompt, result in zip(prompts, plain, strict=True):
        assert result.token_ids == reference_generate(calibrated, prompt, 16)
        assert result.metrics["substitutions"] == 0

    lossy = DeploymentSettings(strategy="importance", cache_experts=1, importance_threshold=1.0)
    runs = []
    for _ in range(2):  # a fresh cluster each time: the same requests give the same tokens
        with LocalCluster(calibrated, ClusterOptions(workers=2, settings=lossy, in_process=True)) as cluster:
            runs.append([cluster.generate(p, 16) for p in prompts])
    first, second = runs
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    assert all(len(r.token_ids) == 16 for r in first)
    assert sum(r.metrics["substitutions"] for r in first) > 0
    hit = [r.metrics["cache_hit_rate"] for r in first]
    assert all(
        later > earlier for later, earlier in zip(hit, [r.metrics["cache_hit_rate"] for r in plain], strict=True)
    )
    shutil.rmtree(calibrated / "unused", ignore_errors=True)
    assert (calibrated / SIMILARITY_FILE).is_file()
