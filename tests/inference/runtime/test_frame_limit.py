"""The data plane's frame limit follows the model's sizes: the KV of every layer and position,
or a whole prompt's hidden rows, whichever is bigger (every end-to-end test runs under it)."""

from __future__ import annotations

from pathlib import Path

from inference.runtime.frame_limit import SLACK_BYTES, max_frame_bytes, max_frame_bytes_of

MIXTRAL_8X7B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
}


def test_mixtrals_limit_is_its_full_kv_in_float32() -> None:
    kv = 32 * 8 * 32768 * 128 * 4  # layers x kv heads x positions x head dim x 4 bytes: 4 GiB
    assert max_frame_bytes(MIXTRAL_8X7B) == kv + SLACK_BYTES


def test_a_wide_model_with_few_layers_is_bound_by_its_hidden_rows() -> None:
    config = {**MIXTRAL_8X7B, "num_hidden_layers": 1, "num_key_value_heads": 1}
    assert max_frame_bytes(config) == 32768 * 4096 * 4 + SLACK_BYTES


def test_a_shard_without_a_config_has_no_limit(tmp_path: Path, tiny_model: Path) -> None:
    assert max_frame_bytes_of(tmp_path) is None
    assert 0 < max_frame_bytes_of(tiny_model) < 64 << 20
