"""How often the shadow's drafts are main's tokens, per shadow dtype, and what that makes of a pass.

    python -m benchmarks.draft_agreement [--model DIR] [--dtypes fp32,bf16,int8,nf4] [--drafts 4]
        [--pairs 16:32,16:64,64:32,64:64] [--json OUT]

For each shadow dtype, the model is served with ``draft_tokens`` set (main, two workers and the
shadow as threads of this process: ``LocalCluster(in_process=True)``, no emulated copies, since only
counts are measured here), and the same greedy generations as ``benchmarks.strategies`` runs (its
prompts for the same length pairs) are made; every answer is checked against Transformers' tokens.
Reported per dtype, over every answer: the share of drafts main kept (agreement), the tokens per
decode pass, the distinct experts per layer per pass, and the bound on fewer expert bytes per token
those give, tokens per pass x top-k / distinct experts per layer per pass (``strategies``' second
term of its drafts bound). Without ``--model`` the strategies benchmark's random Mixtral is made
(``benchmarks.workload.BENCH_MODEL``); ``--model platform/demo-model`` measures the demo model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import provenance, substance
from benchmarks.workload import BENCH_MODEL, parse_pairs, prompt_of
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.tools.reference import reference_generate
from inference.tools.tiny import make_tiny

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

DTYPES = "fp32,bf16,int8,nf4"


def measure(model: Path, dtype: str, drafts: int, prompts: list[tuple[list[int], int]], expected: list) -> dict:
    """One shadow dtype: every generation's drafts figures, summed over the answers."""
    settings = DeploymentSettings(shadow_dtype=dtype, draft_tokens=drafts)
    answers = []
    with LocalCluster(model, ClusterOptions(workers=2, settings=settings, in_process=True)) as cluster:
        for prompt, new_tokens in prompts:
            answers.append(cluster.generate(prompt, new_tokens))
    figures = [a.metrics["drafts"] for a in answers]
    drafted, accepted = sum(f["drafted"] for f in figures), sum(f["accepted"] for f in figures)
    passes = sum(f["decode_passes"] for f in figures)
    decoded = sum(len(a.token_ids) - 1 for a in answers)
    return {
        "agreement": accepted / drafted if drafted else None,
        "drafted": drafted,
        "accepted": accepted,
        "tokens_per_pass": decoded / passes if passes else None,
        "distinct_experts_per_pass": statistics.fmean(f["distinct_experts"] for f in figures),
        "exact": [a.token_ids for a in answers] == expected,
        "answers": figures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: the strategies' random Mixtral)")
    parser.add_argument("--dtypes", default=DTYPES, help="comma-separated shadow dtypes")
    parser.add_argument("--drafts", type=int, default=4, help="draft_tokens")
    parser.add_argument("--pairs", default="16:32,16:64,64:32,64:64", help="comma-separated INPUT:OUTPUT counts")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    begun = provenance.begin()
    try:
        pairs = parse_pairs(args.pairs)
    except ValueError as exc:
        parser.error(str(exc))
    with tempfile.TemporaryDirectory(prefix="odmoe-agreement-") as tmp:
        model = args.model or make_tiny(Path(tmp) / "model", seed=0, **BENCH_MODEL)
        config = json.loads((model / "config.json").read_text())
        top_k = config["num_experts_per_tok"]
        prompts = [(prompt_of(n_in, config["vocab_size"], seed=i), n_out) for i, (n_in, n_out) in enumerate(pairs)]
        expected = [reference_generate(model, prompt, n) for prompt, n in prompts]
        dtypes = {}
        for dtype in [d for d in args.dtypes.split(",") if d]:
            print(f"shadow {dtype} ...", file=sys.stderr)
            dtypes[dtype] = measure(model, dtype, args.drafts, prompts, expected)
    print(f"drafts of {args.drafts} tokens on {args.model or 'the strategies benchmark model'}, top-{top_k}\n")
    print("| shadow | agreement | tokens per pass | distinct experts per layer per pass | fewer bytes bound | exact |")
    print("|---|---:|---:|---:|---:|---|")
    for dtype, f in dtypes.items():
        bound = f["tokens_per_pass"] * top_k / f["distinct_experts_per_pass"]
        f["bytes_bound"] = bound
        print(
            f"| {dtype} | {f['agreement']:.1%} | {f['tokens_per_pass']:.2f} | {f['distinct_experts_per_pass']:.2f} "
            f"| {bound:.2f}x | {f['exact']} |"
        )
    if args.json:
        record = {
            "benchmark": "draft-agreement",
            "model": str(args.model) if args.model else "bench-model",
            "draft_tokens": args.drafts,
            "pairs": pairs,
            "top_k": top_k,
            "dtypes": dtypes,
        }
        provenance.write(args.json, record, begun, "torch", "transformers", depends_on=DEPENDS_ON)
    return 0 if all(f["exact"] for f in dtypes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
