"""The strategies benchmark's model and prompts (``benchmarks.strategies``), shared by the benchmarks
that repeat its runs or predict them (``benchmarks.sim_prediction``), kept apart from both so
that neither imports the other for them."""

from __future__ import annotations

import random

BENCH_MODEL = dict(layers=8, hidden=512, intermediate=1792, heads=8, kv_heads=4)


def prompt_of(length: int, vocab: int, seed: int) -> list[int]:
    generator = random.Random(seed)
    return [1] + [generator.randrange(3, vocab) for _ in range(length - 1)]
