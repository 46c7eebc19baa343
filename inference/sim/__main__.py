"""Command line: `python -m inference.sim --testbed paper --json OUT` and what-if runs on other hardware."""

from __future__ import annotations

import argparse
import json
import sys

from inference.constants import DRAFT_POLICIES
from inference.sim.hardware import DEFAULT_PROFILE, PROFILES, get_profile, with_host_to_device
from inference.sim.model_sizes import resolve_model
from inference.sim.report import compare, depth_line, markdown_table, memory_lines
from inference.sim.strategies import STRATEGIES, Cluster
from inference.sim.strategies.base import SHADOW_BITS, SIMULATED_SHADOW_DTYPE
from inference.sim.traces import load_trace, synthetic_trace


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m inference.sim", description=__doc__)
    p.add_argument("--testbed", choices=["paper"], help="the OD-MoE paper's 10-node testbed (defaults below)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=list(PROFILES))
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--shadow-dtype", default=SIMULATED_SHADOW_DTYPE, choices=list(SHADOW_BITS))
    p.add_argument("--strategy", action="append", choices=list(STRATEGIES), help="repeatable; default all")
    p.add_argument("--trace", help="JSON routing trace (see inference/sim/traces.py for the format)")
    p.add_argument("--pcie-gbps", type=float, help="override host->GPU bandwidth, GB/s")
    p.add_argument(
        "--prefetch", action="store_true", help="lru-offload with speculative prefetch (not in their released code)"
    )
    p.add_argument("--no-prefetch", action="store_true", help="lru-offload as released (the default)")
    p.add_argument("--hybrid", action="store_true", help="odmoe/reactive workers may compute experts on their CPU")
    p.add_argument(
        "--prefetch-depth",
        type=int,
        help="experts a cacheless worker holds at once (default: 1 + ceil(compute / copy) of an expert, "
        "or its layer's experts + 1 if larger; inference.policies.depth)",
    )
    p.add_argument(
        "--drafts",
        type=int,
        default=0,
        help="odmoe with the shadow drafting this many tokens a pass (inference.sim.strategies.drafting); "
        "needs --draft-agreement",
    )
    p.add_argument(
        "--draft-agreement",
        type=float,
        help="the chance each draft equals main's token (measure it: python -m benchmarks.draft_agreement)",
    )
    p.add_argument(
        "--draft-policy",
        default="fixed",
        choices=list(DRAFT_POLICIES),
        help="fixed: every pass drafts --drafts tokens; auto: each pass 0 to --drafts, as main's DraftTuner "
        "picks from the passes simulated so far (inference.policies.drafting)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="also write the full result as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.drafts and args.draft_agreement is None:
        print(
            "error: --drafts needs --draft-agreement (the simulator does not guess a shadow's agreement)",
            file=sys.stderr,
        )
        return 2
    try:
        model = resolve_model("mixtral-8x7b")
        # Keyword-argument call whose names line up with overhead.py's ExpertResult(...): a different call.
        cluster = Cluster(
            workers=args.workers,
            group_size=args.group_size,
            shadow_dtype=args.shadow_dtype,
            lru_prefetch=args.prefetch,
            hybrid=args.hybrid,
            prefetch_depth=args.prefetch_depth,
            draft_tokens=args.drafts,
            draft_agreement=args.draft_agreement or 0.0,
            draft_policy=args.draft_policy,
            seed=args.seed,
        )
        trace = load_trace(args.trace, model) if args.trace else synthetic_trace(model, 256, args.seed)
        profile = get_profile(args.profile)
        if args.pcie_gbps:
            profile = with_host_to_device(profile, args.pcie_gbps * 1e9)
        result = compare(model, profile, cluster, trace, args.strategy)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"Mixtral-8x7B on {result['profile']['name']}, averaged over (input, output) = {result['pairs']}\n")
    print(markdown_table(result))
    print("\n" + depth_line(result))
    print("\nMemory per node, adjusted model:\n" + memory_lines(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
