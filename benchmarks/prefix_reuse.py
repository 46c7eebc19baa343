"""A conversation's second turn with and without prefix reuse: its time to first token.

    python -m benchmarks.prefix_reuse [--model platform/demo-model] [--workers 8] [--first 860]
        [--answer 32] [--follow 12] [--new-tokens 16] [--repeats 5] [--json OUT] [--in-process]

Two clusters of the same model side by side, one with ``prefix_cache`` on (the default) and one
with it off. Each round is a new conversation (its own seeded prompt, so no round finds another's
blocks): on each cluster, the first turn (``--first`` prompt tokens, ``--answer`` new tokens),
then the second turn, whose prompt is the first's, its answer and ``--follow`` more tokens (about
900 tokens with the defaults, on the demo model's context of 1,024), streamed for
``--new-tokens`` tokens. Measured on the client's side: the second turn's time to first token
(TTFT, from sending to its first token), on each cluster, and their ratio round by round; the
clusters take turns going first. Checked: the second turn with reuse gives the tokens of
Transformers' ``generate`` continuing from the first turn's cache cut to the positions reused
(``inference.tools.reference.reference_continue``); without, those of a fresh ``generate``;
and whether the two agree is reported (a prefix computed during decode may round otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import provenance, roles, substance
from benchmarks.concurrency import median_with_spread
from benchmarks.workload import prompt_of
from inference.runtime.client import RuntimeClient
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.tools.reference import reference_continue, reference_generate
from inference.wire.generation import Done

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO / "platform" / "demo-model"
NAMES = ("reuse", "no_reuse")  # the two clusters: prefix_cache on, and off


def second_turn(cluster: LocalCluster, prompt: list[int], new_tokens: int) -> tuple[float, Done]:
    """Stream ``prompt``: its time to first token in ms, and its ``Done``."""
    client = RuntimeClient(cluster.addresses.main, cluster.deployment, curve=cluster.client_keys())
    try:
        sent = time.perf_counter()
        first = 0.0
        for event in client.stream(prompt, new_tokens, timeout_s=600):
            if isinstance(event, Done):
                return (first - sent) * 1000, event
            if not first:
                first = time.perf_counter()
    finally:
        client.close()
    raise AssertionError("unreachable: a stream ends with Done or raises")


def build_parser() -> argparse.ArgumentParser:
    """The command line: the model and its workers, the two turns' lengths, the rounds, the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--first", type=int, default=860, help="the first turn's prompt tokens")
    parser.add_argument("--answer", type=int, default=32, help="the first turn's new tokens")
    parser.add_argument("--follow", type=int, default=12, help="tokens the second turn adds after the answer")
    parser.add_argument("--new-tokens", type=int, default=16, help="the second turn's new tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    roles.add_argument(parser)
    return parser


def checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, int]:
    """The model's vocabulary size and the second turn's prompt tokens; a count below 1, or a second
    turn that does not fit the model's context, is the parser's error."""
    if min(args.first, args.answer, args.follow, args.new_tokens, args.repeats, args.workers) < 1:
        parser.error("--first, --answer, --follow, --new-tokens, --repeats and --workers are at least 1")
    config = json.loads((args.model / "config.json").read_text())
    second_len = args.first + args.answer + args.follow
    if second_len + args.new_tokens > config["max_position_embeddings"]:
        parser.error(f"the second turn ({second_len} + {args.new_tokens} tokens) must fit the model's context")
    return config["vocab_size"], second_len


def one_round(
    clusters: dict[str, LocalCluster], round_: int, vocab: int, args: argparse.Namespace
) -> tuple[dict[str, float], int, bool, bool]:
    """Round ``round_``'s conversation on each cluster, the clusters taking turns going first: the
    second turn's TTFT on each, the prompt tokens reuse found cached, whether both answers are
    Transformers' (``reference_continue`` with reuse, ``reference_generate`` without), and whether
    reuse's equals a fresh whole-prompt prefill's."""
    first = prompt_of(args.first, vocab, seed=round_)
    order = NAMES if round_ % 2 == 0 else NAMES[::-1]
    ttft: dict[str, float] = {}
    answers: dict[str, Done] = {}
    second = []
    for name in order:
        cluster = clusters[name]
        answer = cluster.generate(first, args.answer).token_ids
        second = [*first, *answer, *prompt_of(args.follow + 1, vocab, seed=1000 + round_)[1:]]
        ttft[name], answers[name] = second_turn(cluster, second, args.new_tokens)
    reused = answers["reuse"].metrics["cached_prompt_tokens"]
    fresh = reference_generate(args.model, second, args.new_tokens)
    continued = reference_continue(args.model, (first, args.answer), (second, args.new_tokens), reused)
    exact = answers["reuse"].token_ids == continued and answers["no_reuse"].token_ids == fresh
    print(
        f"  round {round_ + 1}: TTFT {ttft['reuse']:.0f} ms with {reused} of {len(second)} "
        f"prompt tokens reused, {ttft['no_reuse']:.0f} ms without",
        file=sys.stderr,
    )
    return ttft, reused, exact, answers["reuse"].token_ids == fresh


def measure(args: argparse.Namespace, vocab: int) -> tuple[dict[str, list[float]], list[int], bool, int]:
    """Both clusters, warmed up, through ``--repeats`` rounds (``one_round``): each one's TTFTs, the
    prompt tokens reused in each round, whether every answer was exact, and in how many rounds
    reuse's tokens equalled a fresh prefill's."""
    ttft: dict[str, list[float]] = {name: [] for name in NAMES}
    cached: list[int] = []
    exact, agree = True, 0
    with tempfile.TemporaryDirectory(prefix="odmoe-prefix-reuse-") as tmp:
        clusters = {}
        for name in NAMES:
            options = ClusterOptions(
                workers=args.workers,
                settings=DeploymentSettings(prefix_cache=name == "reuse"),
                in_process=args.in_process,
            )
            clusters[name] = LocalCluster(args.model, options, work_dir=Path(tmp) / name)
        try:
            for cluster in clusters.values():
                cluster.start()
                cluster.generate(prompt_of(8, vocab, seed=99), 4)  # warm-up: first-call allocations everywhere
            for round_ in range(args.repeats):
                ms, reused, matched, agrees = one_round(clusters, round_, vocab, args)
                for name in NAMES:
                    ttft[name].append(ms[name])
                cached.append(reused)
                exact &= matched
                agree += agrees
        finally:
            for cluster in clusters.values():
                cluster.close()
    return ttft, cached, exact, agree


def print_table(result: dict) -> None:
    """The run's shape, then the second turn's TTFT with reuse and without, and their ratio, from ``result``."""
    print(
        f"second turn of {result['second_prompt_tokens']} prompt tokens "
        f"({statistics.median(result['cached_prompt_tokens']):.0f} reused), {result['workers']} workers; "
        f"median of {result['repeats']} rounds (min–max)\n"
    )
    print("| | TTFT ms |\n|---|---:|")
    for name, label in zip(NAMES, ("prefix reuse", "without"), strict=True):
        f = result["ttft_ms"][name]
        print(f"| {label} | {f['median']:.0f} ({f['min']:.0f}–{f['max']:.0f}) |")
    r = result["ttft_ratio"]
    print(f"| ratio, round by round | {r['median']:.3f} ({r['min']:.3f}–{r['max']:.3f}) |")
    print(f"\ntokens as Transformers continuing from the same cache (reuse) and fresh (without): {result['exact']}")
    print(f"reuse's tokens equal a fresh whole-prompt prefill's: {result['reuse_equals_fresh_prefill']}")


def summary(
    args: argparse.Namespace, second_len: int, ttft: dict[str, list[float]], cached: list[int], exact: bool, agree: int
) -> dict:
    """What the run records: its settings, the prompt tokens reused each round, each cluster's TTFT
    and their ratio round by round (medians with their spread), and whether the answers were exact."""
    ratios = [a / b for a, b in zip(ttft["reuse"], ttft["no_reuse"], strict=True)]
    return {
        "roles": roles.kind(args),
        "model": str(args.model.relative_to(REPO)) if args.model.is_relative_to(REPO) else str(args.model),
        "workers": args.workers,
        "first_prompt_tokens": args.first,
        "first_answer_tokens": args.answer,
        "second_prompt_tokens": second_len,
        "second_new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "cached_prompt_tokens": cached,
        "ttft_ms": {name: median_with_spread(values) for name, values in ttft.items()},
        "ttft_ratio": median_with_spread(ratios),
        "exact": exact,
        "reuse_equals_fresh_prefill": f"{agree} of {args.repeats}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    begun = provenance.begin()
    vocab, second_len = checked(parser, args)
    ttft, cached, exact, agree = measure(args, vocab)
    result = summary(args, second_len, ttft, cached, exact, agree)
    print_table(result)
    if args.json:
        provenance.write(args.json, result, begun, "torch", "transformers", depends_on=DEPENDS_ON)
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
