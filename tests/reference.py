"""Prompts and checkpoint shapes the end-to-end tests share."""

from __future__ import annotations

from inference.reference import reference_generate

# The second checkpoint differs in every size that placement and the protocol care about.
ODD_SHAPE = dict(layers=3, hidden=75, head_dim=16, heads=4, kv_heads=2, intermediate=97, experts=6, top_k=3, shards=3)

PROMPTS = [
    [1, 5, 6, 7, 8],
    [1, 100, 200, 300],
    [1, 42],
    [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32],
    [1, 450, 3, 77, 9, 250, 18],
]

__all__ = ["ODD_SHAPE", "PROMPTS", "reference_generate"]
