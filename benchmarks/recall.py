"""Routing recall of the shadow by precision and alignment, measured through the runtime.

    python -m benchmarks.recall [--model DIR] [--dtypes fp32,bf16,fp16,int8,nf4] [--new-tokens 64] [--json OUT]

For each shadow precision, a local cluster (main, shadow, workers on 127.0.0.1) generates
the same prompts twice: with the shadow aligned to main every step (token and KV period
1) and never aligned (periods 0). Recall is the share of main's really-routed experts that
the shadow named for that step and layer. Printed as a Markdown table with recall over the
first and the last quarter of the steps, to show drift without alignment. Without
``--model`` the tiny random model of the tests is used; its routers are random, so its
figures say little about a trained model's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from inference.constants import SHADOW_DTYPES
from inference.launcher import ClusterOptions, LocalCluster
from inference.spec import Settings
from inference.tiny import make_tiny

PROMPTS = [[1, 5, 6, 7, 8], [1, 100, 200, 300], [1, 42, 43, 44], [1, 450, 3, 77, 9, 250, 18]]
ALIGNMENTS = {"every step": (1, 1), "never": (0, 0)}


def measure(model_dir: Path, dtype: str, periods: tuple[int, int], new_tokens: int, workers: int) -> dict:
    settings = Settings(shadow_dtype=dtype, token_period=periods[0], kv_period=periods[1])
    with LocalCluster(model_dir, ClusterOptions(workers=workers, settings=settings)) as cluster:
        results = [cluster.generate(prompt, new_tokens) for prompt in PROMPTS]
    by_step: dict[int, list[float]] = {}
    for result in results:
        for step in result.metrics["per_step"]:
            if step["step"] > 0:
                by_step.setdefault(step["step"], []).append(step["recall"])
    steps = sorted(by_step)
    quarter = max(1, len(steps) // 4)
    return {
        "recall": statistics.fmean(r.metrics["recall"] for r in results),
        "first_quarter": statistics.fmean(v for s in steps[:quarter] for v in by_step[s]),
        "last_quarter": statistics.fmean(v for s in steps[-quarter:] for v in by_step[s]),
        "per_layer": [
            statistics.fmean(col) for col in zip(*(r.metrics["recall_per_layer"] for r in results), strict=True)
        ],
        "per_step": {s: statistics.fmean(by_step[s]) for s in steps},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--dtypes", default=",".join(SHADOW_DTYPES))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = set(dtypes) - set(SHADOW_DTYPES)
    if unknown:
        parser.error(f"unknown shadow dtypes {sorted(unknown)}; choose from {', '.join(SHADOW_DTYPES)}")
    figures: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="odmoe-recall-") as tmp:
        model_dir = args.model or make_tiny(Path(tmp) / "model", seed=0)
        for dtype in dtypes:
            figures[dtype] = {
                name: measure(model_dir, dtype, periods, args.new_tokens, args.workers)
                for name, periods in ALIGNMENTS.items()
            }
    print(
        f"model: {args.model or 'tiny random Mixtral (make-tiny, seed 0)'}; {len(PROMPTS)} prompts x "
        f"{args.new_tokens} new tokens, greedy"
    )
    print()
    print(
        "| shadow | aligned every step | never aligned | never aligned, first quarter | never aligned, last quarter |"
    )
    print("|---|---:|---:|---:|---:|")
    for dtype, by in figures.items():
        never = by["never"]
        print(
            f"| {dtype} | {by['every step']['recall']:.2%} | {never['recall']:.2%} | "
            f"{never['first_quarter']:.2%} | {never['last_quarter']:.2%} |"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
