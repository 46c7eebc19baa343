"""Served output with the experts stored coded (``expert_codec="exponent-plane"``): a cluster whose
workers keep, read and decode coded experts gives Transformers' own greedy tokens, in bf16 and
fp16 (the dtypes releases ship in) and fp32, from RAM and from disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.modelio.shards import ShardSet
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.tools.tiny import make_tiny
from tests.reference import ODD_SHAPE, PROMPTS, reference_generate

NEW_TOKENS = 16


@pytest.mark.parametrize(
    ("dtype", "store", "workers"),
    [("bfloat16", "ram", 3), ("float16", "ram", 4), ("bfloat16", "disk", 2), ("float32", "ram", 2)],
)
def test_a_cluster_on_coded_experts_gives_transformers_tokens(
    dtype: str, store: str, workers: int, tmp_path: Path
) -> None:
    model = make_tiny(tmp_path / "model", seed=11, dtype=dtype, **ODD_SHAPE)
    prompts = PROMPTS[:2]
    expected = [reference_generate(model, prompt, NEW_TOKENS, dtype="auto") for prompt in prompts]
    settings = DeploymentSettings(expert_codec="exponent-plane", expert_store=store, shadow_dtype="int8")
    options = ClusterOptions(workers=workers, settings=settings, in_process=True)
    with LocalCluster(model, options, work_dir=tmp_path / "run") as cluster:
        assert ShardSet.load(cluster.shard_dir).expert_codec == "exponent-plane"
        for prompt, want in zip(prompts, expected, strict=True):
            assert cluster.generate(prompt, NEW_TOKENS).token_ids == want, f"prompt {prompt}"
