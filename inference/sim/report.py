"""The paper-testbed comparison: run every strategy over the paper's setting and format the table.

Paper testbed: 1 main (one RTX 3090), shadow on two 3090s (int8), 8 workers (one 3090 each) in groups
of 2, 1 GbE, Mixtral-8x7B fp16; results averaged over (input, output) = (16, 64), (16, 256),
(128, 64), (128, 256). The paper's own figures are shown beside ours, never used to set anything.
"""

from __future__ import annotations

import math

from inference.policies.depth import prefetch_depth
from inference.sim.costs import Costs
from inference.sim.efficiency import for_strategy
from inference.sim.hardware import Profile, get_profile
from inference.sim.model_sizes import ModelSizes
from inference.sim.simulate import average, run_pair
from inference.sim.sources import constants_table
from inference.sim.strategies import STRATEGIES, Cluster
from inference.sim.strategies.base import Setup
from inference.sim.traces import Trace

PAPER_PAIRS = [(16, 64), (16, 256), (128, 64), (128, 256)]

# OD-MoE paper (Wang et al. 2025), speed table and memory breakdown; for comparison only.
PAPER_FIGURES = {
    "full-cache": {"decode_tok_s": 4.89, "e2e_tok_s": 4.8425, "memory_gb": 180, "ttft_ms": None},
    "odmoe": {"decode_tok_s": 3.6925, "e2e_tok_s": 3.37, "memory_gb": 60, "ttft_ms": 2244},
    "lru-offload": {"decode_tok_s": 2.2375, "e2e_tok_s": 2.1725, "memory_gb": 11, "ttft_ms": 1845},
    "reactive": None,
}


def compare(
    model: ModelSizes, profile_name: str | Profile, cluster: Cluster, trace: Trace, strategies: list[str] | None = None
) -> dict:
    profile = get_profile(profile_name)
    rows = {}
    for name in strategies or list(STRATEGIES):
        row = {}
        for kind in ("ideal", "adjusted"):
            runs = [run_pair(name, model, profile, cluster, trace, i, o, ideal=kind == "ideal") for i, o in PAPER_PAIRS]
            row[kind] = average(runs)
        row["paper"] = PAPER_FIGURES.get(name)
        rows[name] = row
    for kind in ("ideal", "adjusted"):
        base = rows.get("full-cache", {}).get(kind, {}).get("decode_tok_s")
        for row in rows.values():
            row[kind]["ratio_to_full_cache"] = row[kind]["decode_tok_s"] / base if base else None
    return {
        "profile": profile.as_dict(),
        "cluster": cluster.__dict__,
        "prefetch_depth": depth_of(model, profile, cluster),
        "pairs": PAPER_PAIRS,
        "strategies": rows,
        "constants": constants_table(),
    }


def depth_of(model: ModelSizes, profile: Profile, cluster: Cluster) -> dict:
    """The workers' prefetch depth in the adjusted model, with what the rule weighs (`inference.policies.depth`)."""
    setup = Setup(Costs(model, profile, for_strategy("odmoe", ideal=False)), cluster)
    return {
        "depth": setup.prefetch_depth,
        "chosen_by": "the rule" if cluster.prefetch_depth is None else "--prefetch-depth",
        "expert_copy_ms": setup.costs.expert_load() * 1000,
        "expert_compute_ms": setup.costs.expert_call(1) * 1000,
        "layer_term": math.ceil(model.top_k / cluster.group_size) + 1,
    }


def depth_line(result: dict) -> str:
    d = result["prefetch_depth"]
    experts = "expert" if d["depth"] == 1 else "experts"
    return (
        f"Prefetch depth per worker: {d['depth']} {experts} ({d['chosen_by']}; an expert's copy "
        f"{d['expert_copy_ms']:.2f} ms, its compute {d['expert_compute_ms']:.3f} ms: the link's term, "
        f"1 + ceil(compute / copy), is {prefetch_depth(d['expert_copy_ms'], d['expert_compute_ms'])}; the layer's, "
        f"ceil(top-k / group) + 1, is {d['layer_term']})"
    )


def _fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def markdown_table(result: dict) -> str:
    head = (
        "| strategy | paper decode tok/s | paper e2e tok/s | paper TTFT ms | paper mem GB "
        "| ideal decode | ideal TTFT ms | ideal ratio | adjusted decode | adjusted e2e | adjusted TTFT ms "
        "| adjusted ratio | mem GB (sim) |\n|" + "---|" * 13
    )
    lines = [head]
    for name, row in result["strategies"].items():
        paper = row["paper"] or {}
        ideal, adjusted = row["ideal"], row["adjusted"]
        paper_ratio = f" ({paper['decode_tok_s'] / PAPER_FIGURES['full-cache']['decode_tok_s']:.1%})" if paper else ""
        lines.append(
            f"| {name} | {_fmt(paper.get('decode_tok_s'), 4)}{paper_ratio} | {_fmt(paper.get('e2e_tok_s'), 4)} "
            f"| {_fmt(paper.get('ttft_ms'), 0)} | {_fmt(paper.get('memory_gb'), 0)} "
            f"| {ideal['decode_tok_s']:.2f} | {ideal['ttft_ms']:.0f} | {_pct(ideal['ratio_to_full_cache'])} "
            f"| {adjusted['decode_tok_s']:.2f} | {adjusted['e2e_tok_s']:.2f} | {adjusted['ttft_ms']:.0f} "
            f"| {_pct(adjusted['ratio_to_full_cache'])} | {adjusted['memory_total_bytes'] / 1e9:.1f} |"
        )
    return "\n".join(lines)


def memory_lines(result: dict) -> str:
    lines = []
    for name, row in result["strategies"].items():
        parts = ", ".join(f"{role} {size / 1e9:.2f}" for role, size in row["adjusted"]["memory_bytes"].items())
        lines.append(f"- {name} (GB): {parts}")
    return "\n".join(lines)


def constants_markdown() -> str:
    """README's table of every constant the simulator uses, with its unit and source."""
    lines = ["| constant | value | source |", "|---|---|---|"]
    for name, c in constants_table().items():
        lines.append(f"| `{name}` | {c['value']:.4g} {c['unit']} | {c['source']} |")
    return "\n".join(lines)
