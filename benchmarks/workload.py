"""The strategies benchmark's model and prompts (``benchmarks.strategies``), shared by the benchmarks
that repeat its runs or predict them (``benchmarks.sim_prediction``), kept apart from both so
that neither imports the other for them."""

from __future__ import annotations

import random

BENCH_MODEL = dict(layers=8, hidden=512, intermediate=1792, heads=8, kv_heads=4)


def prompt_of(length: int, vocab: int, seed: int) -> list[int]:
    generator = random.Random(seed)
    return [1] + [generator.randrange(3, vocab) for _ in range(length - 1)]


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """The (input, output) token counts of ``--pairs`` ("16:32,64:64"); ``ValueError`` saying which is wrong."""
    pairs = []
    for item in text.split(","):
        try:
            prompt_len, new_tokens = (int(part) for part in item.split(":"))
        except ValueError:
            raise ValueError(f"a length pair is INPUT:OUTPUT, e.g. 16:64; got {item!r}") from None
        if prompt_len < 1 or new_tokens < 2:
            raise ValueError(f"input must be >= 1 and output >= 2 tokens, got {item!r}")
        pairs.append((prompt_len, new_tokens))
    return pairs
