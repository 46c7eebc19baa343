"""odmoe with drafts on the OD-MoE paper's testbed, in the simulator, beside the paper's full cache.

`python -m benchmarks.paper_drafts --json benchmarks/results/paper-testbed-drafts-N.json`

The paper's testbed (``inference.sim.report``: Mixtral-8x7B fp16, one RTX 3090 per node, PCIe 4,
1 GbE, an int8 shadow on two nodes, 8 workers in groups of 2, its four length pairs) simulated
with the shadow drafting k tokens a pass (``inference.sim.strategies.drafting``), for each k and
each agreement of a fixed grid, and under ``auto`` (up to the largest k: main's ``DraftTuner`` choosing
each pass from the passes simulated so far), beside full cache and odmoe without drafts. Nothing here measured a
shadow's agreement on Mixtral: the grid spans it, and ``benchmarks.draft_agreement`` measures it on
the models this project has (the drafts page sets the two side by side).

Each row: decode tok/s with the simulator's ideal implementation (links and GPUs at their rates) and
its adjusted one (Transformers' overheads, measured; the paper's systems), each ÷ full cache and ÷
odmoe without drafts; tokens per pass and distinct experts per layer per pass (the adjusted run's).
The simulator is deterministic for its seed, so each figure is one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks import provenance
from inference.sim.hardware import DEFAULT_PROFILE, get_profile
from inference.sim.model_sizes import resolve_model
from inference.sim.report import PAPER_PAIRS
from inference.sim.simulate import average, run_pair
from inference.sim.strategies import Cluster
from inference.sim.traces import synthetic_trace

# What its figures depend on beyond its own imports (benchmarks.substance): nothing, it runs in one process.
DEPENDS_ON: tuple[str, ...] = ()

DRAFTS = (2, 4, 8)
AGREEMENTS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
KINDS = ("ideal", "adjusted")


def simulate(strategy: str, cluster: Cluster, trace: list) -> dict:
    """One strategy on the testbed, each kind averaged over the paper's length pairs."""
    model = resolve_model("mixtral-8x7b")
    profile = get_profile(DEFAULT_PROFILE)
    figures: dict = {}
    for kind in KINDS:
        runs = [run_pair(strategy, model, profile, cluster, trace, i, o, ideal=kind == "ideal") for i, o in PAPER_PAIRS]
        figures[f"{kind}_decode_tok_s"] = average(runs)["decode_tok_s"]
        tallies = [run["drafts"] for run in runs if run["drafts"]]
        if kind == "adjusted" and tallies:
            figures["tokens_per_pass"] = statistics.fmean(t["tokens_per_pass"] for t in tallies)
            figures["distinct_experts"] = statistics.fmean(t["distinct_experts"] for t in tallies)
            figures["drafts_per_pass"] = sum(t["drafted"] for t in tallies) / sum(t["passes"] for t in tallies)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    begun = provenance.begin()
    trace = synthetic_trace(resolve_model("mixtral-8x7b"), 256, args.seed)
    base = Cluster(seed=args.seed)
    rows = {"full-cache": simulate("full-cache", base, trace), "odmoe": simulate("odmoe", base, trace)}
    for k in DRAFTS:
        for agreement in AGREEMENTS:
            print(f"odmoe with {k} drafts at {agreement:.0%} ...", file=sys.stderr)
            cluster = Cluster(seed=args.seed, draft_tokens=k, draft_agreement=agreement)
            rows[f"odmoe+drafts{k} at {agreement:.0%}"] = {"draft_tokens": k, "agreement": agreement} | simulate(
                "odmoe", cluster, trace
            )
    for agreement in AGREEMENTS:
        print(f"odmoe with auto drafts at {agreement:.0%} ...", file=sys.stderr)
        cluster = Cluster(seed=args.seed, draft_tokens=max(DRAFTS), draft_agreement=agreement, draft_policy="auto")
        rows[f"odmoe+auto{max(DRAFTS)} at {agreement:.0%}"] = {
            "draft_tokens": max(DRAFTS),
            "draft_policy": "auto",
            "agreement": agreement,
        } | simulate("odmoe", cluster, trace)
    for name in ("full-cache", "odmoe"):  # one position a pass: top-k experts a layer
        rows[name] |= {"tokens_per_pass": 1.0, "distinct_experts": float(resolve_model("mixtral-8x7b").top_k)}
    for row in rows.values():
        for kind in KINDS:
            row[f"{kind}_vs_full_cache"] = row[f"{kind}_decode_tok_s"] / rows["full-cache"][f"{kind}_decode_tok_s"]
            row[f"{kind}_vs_odmoe"] = row[f"{kind}_decode_tok_s"] / rows["odmoe"][f"{kind}_decode_tok_s"]
    print(
        "| row | ideal tok/s | ÷ full cache | ÷ odmoe | adjusted tok/s | ÷ full cache | ÷ odmoe "
        "| tokens per pass | distinct experts per layer per pass |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    figures = ("decode_tok_s", "vs_full_cache", "vs_odmoe")
    for name, row in rows.items():
        cells = [f"{row[f'{kind}_{figure}']:.2f}" for kind in KINDS for figure in figures]
        print(f"| {name} | {' | '.join(cells)} | {row['tokens_per_pass']:.2f} | {row['distinct_experts']:.2f} |")
    if args.json:
        record = {
            "benchmark": "paper-testbed-drafts",
            "testbed": "paper",
            "profile": DEFAULT_PROFILE,
            "pairs": PAPER_PAIRS,
            "cluster": {"workers": base.workers, "group_size": base.group_size, "shadow_dtype": base.shadow_dtype},
            "rows": rows,
        }
        provenance.write(args.json, record, begun, depends_on=DEPENDS_ON)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
