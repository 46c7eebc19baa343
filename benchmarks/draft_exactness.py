"""Drafts change no token: the whole matrix of families, dtypes, shadows and sampling, recorded.

`python -m benchmarks.draft_exactness --json benchmarks/results/draft-exactness-N.json`

For each of the five families in fp32 and bf16 (a small checkpoint of each, in the release
layout), 8 staggered streams in one batch are served greedily and with seeded sampling by a
cluster without drafts, and by one drafting 4 tokens a pass for each shadow dtype (fp16, int8,
nf4). Every greedy answer must equal Transformers' ``generate``, and every answer, greedy or
sampled, the cluster's without drafts (sampling has no Transformers reference here beyond main's
sampler, which ``tests/inference/runtime/engine/test_engine.py`` checks against seeded
``generate``). Lossy shadows make drafts that main rejects, so rejection is exercised in every
cell; each cell records its drafts kept.
``tests/inference/runtime/test_drafts_e2e.py`` runs a pairwise subset of this matrix in ``make test``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchmarks import provenance, roles, substance
from benchmarks.streams import run_streams
from benchmarks.workload import prompt_of
from inference.modelio.families import FAMILIES
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.tools.reference import reference_generate
from inference.tools.tiny import make_tiny
from inference.wire.generation import Done

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

DTYPES = ("float32", "bfloat16")
SHADOWS = ("fp16", "int8", "nf4")
DRAFTS = 4
SHAPE = dict(layers=3, hidden=36, intermediate=22, experts=7, top_k=3, heads=3, kv_heads=1, head_dim=12)
STREAMS = [(3, 24), (9, 10), (5, 30), (17, 16), (2, 20), (11, 6), (4, 28), (13, 12)]  # (prompt, new) tokens
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_p": 0.95}
STAGGER_S = 0.03


def serve(cluster: LocalCluster, prompts: list[list[int]], sampled: bool) -> list[Done]:
    """The 8 streams at once, each on its own client, started ``STAGGER_S`` apart."""
    options = [SAMPLING | {"seed": 100 + i} if sampled else {} for i in range(len(prompts))]
    news = [new for _, new in STREAMS]
    results = run_streams(cluster, prompts, news, stagger_s=STAGGER_S, per_stream=options)
    failed = [r for r in results if not isinstance(r, Done)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(prompts)} streams failed: {failed[0]!r}")
    return results  # type: ignore[return-value]


def run_model(model: Path, vocab: int, shadows: list[str], in_process: bool) -> dict[str, dict]:
    """One checkpoint's cells of the matrix, by shadow: its cluster without drafts, then one with each."""
    prompts = [prompt_of(n, vocab, seed=i) for i, (n, _) in enumerate(STREAMS)]
    expected = [reference_generate(model, p, new) for p, (_, new) in zip(prompts, STREAMS, strict=True)]
    options = {"workers": 3, "in_process": in_process}
    with LocalCluster(model, ClusterOptions(settings=DeploymentSettings(), **options)) as plain:
        greedy = serve(plain, prompts, sampled=False)
        sampled = serve(plain, prompts, sampled=True)
    plain_exact = [d.token_ids for d in greedy] == expected
    cells = {}
    for shadow in shadows:
        settings = DeploymentSettings(draft_tokens=DRAFTS, shadow_dtype=shadow)
        with LocalCluster(model, ClusterOptions(settings=settings, **options)) as drafted:
            drafted_greedy = serve(drafted, prompts, sampled=False)
            drafted_sampled = serve(drafted, prompts, sampled=True)
        answers = drafted_greedy + drafted_sampled
        drafts = [d.metrics["drafts"] for d in answers]
        made, kept = sum(d["drafted"] for d in drafts), sum(d["accepted"] for d in drafts)
        cells[shadow] = {
            "without_drafts_greedy_equals_generate": plain_exact,
            "greedy_equals_generate": [d.token_ids for d in drafted_greedy] == expected,
            "greedy_equals_without_drafts": [d.token_ids for d in drafted_greedy] == [d.token_ids for d in greedy],
            "sampled_equals_without_drafts": [d.token_ids for d in drafted_sampled] == [d.token_ids for d in sampled],
            "drafted": made,
            "accepted": kept,
            "agreement": kept / made if made else 0.0,
            "largest_batch": max(d.metrics["max_batch"] for d in answers),
        }
    return cells


def exact(cell: dict) -> bool:
    """Whether every answer of a cell is what it must be."""
    return all(value for key, value in cell.items() if "equals" in key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated model families")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated checkpoint dtypes")
    parser.add_argument("--shadows", default=",".join(SHADOWS), help="comma-separated shadow dtypes")
    parser.add_argument("--json", type=Path)
    roles.add_argument(parser)
    args = parser.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    dtypes = [d for d in args.dtypes.split(",") if d]
    shadows = [s for s in args.shadows.split(",") if s]
    for what, chosen, known in (
        ("families", families, FAMILIES),
        ("dtypes", dtypes, DTYPES),
        ("shadows", shadows, SHADOWS),
    ):
        if not chosen or set(chosen) - set(known):
            parser.error(f"--{what}: choose from {', '.join(known)}")
    begun = provenance.begin()
    cells: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="odmoe-exactness-") as tmp:
        for family in families:
            for dtype in dtypes:
                print(f"{family} {dtype} ...", file=sys.stderr)
                seed = 40 + list(FAMILIES).index(family)
                model = make_tiny(
                    Path(tmp) / f"{family}-{dtype}", family=family, seed=seed, shards=3, dtype=dtype, **SHAPE
                )
                vocab = json.loads((model / "config.json").read_text())["vocab_size"]
                for shadow, cell in run_model(model, vocab, shadows, args.in_process).items():
                    cells[f"{family} {dtype}, {shadow} shadow"] = cell
    print(f"drafts of {DRAFTS} tokens, 8 staggered streams, greedy and seeded sampling\n")
    print("| cell | exact | drafts kept | largest batch |")
    print("|---|---|---:|---:|")
    for name, cell in cells.items():
        print(f"| {name} | {'yes' if exact(cell) else 'NO'} | {cell['agreement']:.1%} | {cell['largest_batch']} |")
    everything = all(exact(cell) for cell in cells.values())
    print(f"\nevery answer exact: {everything}")
    if args.json:
        record = {
            "benchmark": "draft-exactness",
            "draft_tokens": DRAFTS,
            "streams": STREAMS,
            "sampling": SAMPLING,
            "shape": SHAPE,
            "roles": roles.kind(args),
            "exact": everything,
            "cells": cells,
        }
        provenance.write(args.json, record, begun, "torch", "transformers", depends_on=DEPENDS_ON)
    return 0 if everything else 1


if __name__ == "__main__":
    raise SystemExit(main())
