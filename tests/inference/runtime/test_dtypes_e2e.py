"""End to end on half-precision checkpoints, the dtype real releases ship in: every role
computes in the checkpoint's dtype and greedy output is token-identical to Transformers
loaded with ``dtype="auto"``, whatever the shadow's dtype, the worker count or the strategy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.routing import grouped_mm_works
from inference.runtime.spec import DeploymentSettings
from inference.tools.tiny import make_tiny
from tests.reference import ODD_SHAPE, PROMPTS, reference_generate

pytestmark = pytest.mark.slow

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Odd sizes, several safetensors shards and an index: the release layout.
    return make_tiny(tmp_path_factory.mktemp("bf16") / "model", seed=5, dtype="bfloat16", **ODD_SHAPE)


@pytest.fixture(scope="module")
def bf16_aligned_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Strides torch's grouped GEMM takes, as every real release's are: Transformers' default experts
    # path (grouped_mm) is the reference, not the eager loop the odd shapes above fall back to.
    return make_tiny(
        tmp_path_factory.mktemp("bf16-aligned") / "model",
        seed=0,
        dtype="bfloat16",
        hidden=512,
        intermediate=256,
        shards=2,
    )


@pytest.fixture(scope="module")
def fp16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("fp16") / "model", seed=6, dtype="float16", shards=4)


def _check(model: Path, options: ClusterOptions, prompts: list[list[int]]) -> list[float]:
    expected = [reference_generate(model, prompt, NEW_TOKENS, dtype="auto") for prompt in prompts]
    with LocalCluster(model, options) as cluster:
        results = [cluster.generate(prompt, NEW_TOKENS) for prompt in prompts]
    for prompt, want, got in zip(prompts, expected, results, strict=True):
        assert got.token_ids == want, f"prompt {prompt}: tokens differ from Transformers"
    return [got.metrics["recall"] for got in results]


@pytest.mark.parametrize(
    ("model_name", "shadow_dtype", "workers"),
    [
        ("bf16_model", "nf4", 3),
        ("bf16_model", "int8", 1),
        ("bf16_model", "bf16", 4),
        ("bf16_model", "fp16", 3),
        ("fp16_model", "fp16", 4),
        ("fp16_model", "nf4", 1),
        ("fp16_model", "int8", 3),
        ("fp16_model", "bf16", 4),
    ],
)
def test_every_shadow_dtype_gives_the_checkpoints_own_tokens(
    model_name: str, shadow_dtype: str, workers: int, request
) -> None:
    model: Path = request.getfixturevalue(model_name)
    options = ClusterOptions(workers=workers, settings=DeploymentSettings(shadow_dtype=shadow_dtype), in_process=True)
    recalls = _check(model, options, PROMPTS[:2])
    print(f"{model_name} {shadow_dtype} shadow, {workers} workers: recall {recalls}")
    # A shadow in the checkpoint's own dtype is main's model itself: it predicts every expert.
    own = {"bf16_model": "bf16", "fp16_model": "fp16"}[model_name]
    if shadow_dtype == own:
        assert recalls == [1.0] * len(recalls)


@pytest.mark.parametrize("strategy", ["full-cache", "reactive", "lru-offload"])
def test_every_strategy_is_exact_in_bf16(bf16_model: Path, strategy: str) -> None:
    options = ClusterOptions(workers=3, settings=DeploymentSettings(strategy=strategy), in_process=True)
    _check(bf16_model, options, PROMPTS[2:4])


def test_dtype_overrides_what_main_and_workers_compute_in(bf16_model: Path) -> None:
    # --dtype float32 on a bf16 release: the same tokens as Transformers loading it in fp32.
    options = ClusterOptions(
        workers=3, settings=DeploymentSettings(dtype="float32", shadow_dtype="int8"), in_process=True
    )
    prompts = PROMPTS[:2]
    expected = [reference_generate(bf16_model, prompt, NEW_TOKENS, dtype="float32") for prompt in prompts]
    with LocalCluster(bf16_model, options) as cluster:
        for prompt, want in zip(prompts, expected, strict=True):
            assert cluster.generate(prompt, NEW_TOKENS).token_ids == want


def test_bf16_at_aligned_shapes_gives_transformers_default_tokens(bf16_aligned_model: Path) -> None:
    """Transformers' grouped experts sum a token's fp32 weighted outputs and round once, so main keeps
    the workers' fp32 answers unrounded until its sum. Measured: rounding each answer to bf16 on
    arrival (the eager arithmetic) changed 2 of these 4 prompts' 32 tokens on this checkpoint."""
    assert grouped_mm_works(512, 256, torch.bfloat16, torch.device("cpu"))
    prompts, new_tokens = PROMPTS[:4], 32
    expected = [reference_generate(bf16_aligned_model, prompt, new_tokens, dtype="auto") for prompt in prompts]
    with LocalCluster(bf16_aligned_model, ClusterOptions(workers=3, in_process=True)) as cluster:
        for prompt, want in zip(prompts, expected, strict=True):
            assert cluster.generate(prompt, new_tokens).token_ids == want, f"prompt {prompt}: tokens differ"
