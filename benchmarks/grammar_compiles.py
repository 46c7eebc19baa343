"""Main's step time while another user's heavy grammar compiles, against the same load without it.

    python -m benchmarks.grammar_compiles [--model platform/demo-model] [--workers 2] [--streams 4]
        [--prompt-len 16] [--tokens 400] [--properties 8000] [--choices 32] [--rounds 5]
        [--json OUT] [--in-process]

One cluster (main and ``--workers`` workers as processes, no shadow, so the machine's cores go to
the roles measured). Each round runs the same ordinary load twice, the two runs taking turns at
going first: user alice's ``--streams`` streams, each its own prompt, ``--tokens`` greedy tokens.
In the heavy run, once each of alice's streams has its 8th token, user bob sends the hostile-tenant
report's schema (one object of ``--properties`` optional string properties: 231 KB at 8,000) as
``--choices`` generations (what a request with ``n`` = 32 sends main), with one property more every
round, so that main's cache of compiled grammars never holds it: each round compiles it afresh.
Main compiles it once for the 32, off its loop, and refuses it (past ``max_grammar_size``) when
the compile ends; every one of bob's answers must be a ``Failed`` naming that limit.

A step time is the interval between two consecutive tokens of one of alice's streams, on the
benchmark's clock (main samples every running sequence once a step). The heavy run keeps the
intervals that end while bob's grammar compiles (from bob's send to his last answer); the quiet run
keeps the intervals of the same tokens of the same streams, so that both cover the same part of the
streams. Reported: the median and p99 step time of each, pooled over the rounds, their ratios
(heavy over quiet; the targets of issue 51: median within 1.1×, p99 within 1.5×), each round's
ratios, and how long bob's grammar took to be refused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import llguidance

from benchmarks import provenance, roles, substance
from benchmarks.concurrency import median_with_spread
from benchmarks.workload import prompt_of
from inference.runtime.client import RuntimeClient
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.wire.generation import Done, Failed, Generate, Token

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO / "platform" / "demo-model"
TRIGGER_TOKEN = 8  # bob sends once each of alice's streams has this many tokens
LIMIT_NAMED = "over the limit max_grammar_size"


def heavy_grammar(properties: int) -> str:
    """The report's schema, as the control plane writes it for main."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})


def alice_stream(cluster: LocalCluster, prompt: list[int], tokens: int, arrivals: list[float]) -> None:
    """One of alice's streams: each token's arrival time (``time.perf_counter``) appended as it comes."""
    client = RuntimeClient(cluster.addresses.main, cluster.deployment, curve=cluster.client_keys())
    try:
        for event in client.stream(prompt, tokens, user="alice", timeout_s=600):
            if isinstance(event, Token):
                arrivals.append(time.perf_counter())
            elif isinstance(event, Done) and len(event.token_ids) != tokens:
                raise RuntimeError(f"alice's stream ended after {len(event.token_ids)} of {tokens} tokens")
    finally:
        client.close()


def bob_sends(cluster: LocalCluster, grammar: str, choices: int, prompt: list[int]) -> tuple[float, float, list[str]]:
    """Bob's ``choices`` generations under ``grammar``: when sent, when the last was answered, the answers."""
    client = RuntimeClient(cluster.addresses.main, cluster.deployment, curve=cluster.client_keys())
    try:
        ids = [f"bob-{uuid.uuid4().hex[:8]}" for _ in range(choices)]
        sent = time.perf_counter()
        for request_id in ids:
            client.endpoint.send(
                "main",
                Generate(request_id=request_id, prompt_ids=prompt, max_new_tokens=8, user="bob", grammar=grammar),
            )
        answers: dict[str, str] = {}
        deadline = time.monotonic() + 600
        while len(answers) < choices and time.monotonic() < deadline:
            received = client.endpoint.recv(timeout_s=0.5)
            msg = received.msg if received is not None else None
            if isinstance(msg, Failed) and msg.request_id in ids:
                answers[msg.request_id] = msg.error
            elif isinstance(msg, Done) and msg.request_id in ids:
                answers[msg.request_id] = f"done: {msg.finish_reason}"
        return sent, time.perf_counter(), [answers.get(i, "no answer") for i in ids]
    finally:
        client.close()


def run(cluster: LocalCluster, prompts: list[list[int]], tokens: int, heavy: tuple[str, int] | None) -> dict:
    """One run of alice's streams, and bob's heavy grammar (``(grammar, choices)``) if given."""
    arrivals: list[list[float]] = [[] for _ in prompts]
    streams = [
        threading.Thread(target=alice_stream, args=(cluster, prompt, tokens, mine), daemon=True)
        for prompt, mine in zip(prompts, arrivals, strict=True)
    ]
    for stream in streams:
        stream.start()
    bob: tuple[float, float, list[str]] | None = None
    if heavy is not None:
        while any(len(mine) < TRIGGER_TOKEN for mine in arrivals) and any(s.is_alive() for s in streams):
            time.sleep(0.001)
        bob = bob_sends(cluster, heavy[0], heavy[1], prompts[0])
    for stream in streams:
        stream.join()
    if any(len(mine) != tokens for mine in arrivals):
        raise RuntimeError("one of alice's streams failed")
    return {"arrivals": arrivals, "bob": bob}


def window(arrivals: list[list[float]], began: float, ended: float) -> list[tuple[int, int]]:
    """(stream, token index) of every interval that ends within [began, ended]."""
    return [(s, i) for s, times in enumerate(arrivals) for i in range(1, len(times)) if began <= times[i] <= ended]


def intervals_ms(arrivals: list[list[float]], tokens: list[tuple[int, int]]) -> list[float]:
    return [(arrivals[s][i] - arrivals[s][i - 1]) * 1000 for s, i in tokens]


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def build_parser() -> argparse.ArgumentParser:
    """The command line: the model and its workers, alice's load, bob's grammar, the rounds, the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--properties", type=int, default=8000)
    parser.add_argument("--choices", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    roles.add_argument(parser)
    return parser


def one_round(
    cluster: LocalCluster, round_: int, vocab: int, args: argparse.Namespace
) -> tuple[dict, list[float], list[float]]:
    """Round ``round_``: the heavy run and the quiet one, taking turns at going first; the round's
    figures, and the step times (``intervals_ms``) of the heavy run within bob's window and of the
    quiet run at the same tokens."""
    prompts = [prompt_of(args.prompt_len, vocab, seed=100 * round_ + s) for s in range(args.streams)]
    grammar = heavy_grammar(args.properties + round_)
    order = ["heavy", "quiet"] if round_ % 2 == 0 else ["quiet", "heavy"]
    runs = {
        name: run(cluster, prompts, args.tokens, (grammar, args.choices) if name == "heavy" else None) for name in order
    }
    sent, last, answers = runs["heavy"]["bob"]
    tokens = window(runs["heavy"]["arrivals"], sent, last)
    heavy = intervals_ms(runs["heavy"]["arrivals"], tokens)
    quiet = intervals_ms(runs["quiet"]["arrivals"], tokens)
    figures = {
        "first": order[0],
        "refused_after_s": round(last - sent, 3),
        "steps_in_window": len(tokens),
        "median_ratio": statistics.median(heavy) / statistics.median(quiet),
        "max_ms": {"heavy": max(heavy), "quiet": max(quiet)},
        "answers": sorted(set(answers)),
    }
    print(
        f"round {round_ + 1}: bob's grammar refused after {last - sent:.2f} s; {len(tokens)} intervals; "
        f"median step {statistics.median(heavy):.1f} ms heavy, {statistics.median(quiet):.1f} ms quiet",
        file=sys.stderr,
    )
    return figures, heavy, quiet


def measure(args: argparse.Namespace, vocab: int) -> tuple[list[dict], list[float], list[float], bool]:
    """``--rounds`` rounds (``one_round``) on one cluster without a shadow: each round's figures, the
    heavy and the quiet step times pooled over the rounds, and whether every one of bob's answers
    named the limit."""
    options = ClusterOptions(workers=args.workers, shadow=False, in_process=args.in_process)
    quiet_ms: list[float] = []
    heavy_ms: list[float] = []
    rounds: list[dict] = []
    refused_all = True
    with LocalCluster(args.model, options) as cluster:
        for round_ in range(args.rounds):
            figures, heavy, quiet = one_round(cluster, round_, vocab, args)
            refused_all &= all(LIMIT_NAMED in answer for answer in figures["answers"])
            heavy_ms += heavy
            quiet_ms += quiet
            rounds.append(figures)
    return rounds, heavy_ms, quiet_ms, refused_all


def print_table(result: dict) -> None:
    """The run's shape, then the pooled step times of each run and their ratio, and bob's refusals, from ``result``."""
    steps, ratio = result["step_ms"], result["ratio"]
    print(
        f"{result['streams']} streams of alice, bob's {result['properties']}-property schema as "
        f"{result['choices']} choices; {len(result['rounds'])} rounds, intervals pooled\n"
    )
    print("| | median ms | p99 ms | intervals |\n|---|---:|---:|---:|")
    for name in ("quiet", "heavy"):
        print(f"| {name} | {steps[name]['median']:.1f} | {steps[name]['p99']:.1f} | {steps[name]['n']} |")
    print(f"| heavy / quiet | {ratio['median']:.3f} | {ratio['p99']:.3f} | |")
    spread = result["refused_after_s"]
    print(f"\nbob's grammar refused after {spread['median']:.2f} s ({spread['min']:.2f}–{spread['max']:.2f})")
    print(f"every one of bob's answers names the limit: {result['every_answer_names_the_limit']}")


def summary(
    args: argparse.Namespace, rounds: list[dict], heavy_ms: list[float], quiet_ms: list[float], refused_all: bool
) -> dict:
    """What the run records: its settings, each round's figures, the pooled step times and their
    ratios (heavy over quiet), how long bob's grammar took to be refused."""
    return {
        "benchmark": "grammar-compiles",
        "roles": roles.kind(args),
        "model": str(args.model.relative_to(REPO)) if args.model.is_relative_to(REPO) else str(args.model),
        "workers": args.workers,
        "streams": args.streams,
        "prompt_len": args.prompt_len,
        "tokens": args.tokens,
        "properties": args.properties,
        "choices": args.choices,
        "rounds": rounds,
        "step_ms": {
            "heavy": {"median": statistics.median(heavy_ms), "p99": p99(heavy_ms), "n": len(heavy_ms)},
            "quiet": {"median": statistics.median(quiet_ms), "p99": p99(quiet_ms), "n": len(quiet_ms)},
        },
        "ratio": {
            "median": statistics.median(heavy_ms) / statistics.median(quiet_ms),
            "p99": p99(heavy_ms) / p99(quiet_ms),
            "median_by_round": median_with_spread([r["median_ratio"] for r in rounds]),
        },
        "refused_after_s": median_with_spread([r["refused_after_s"] for r in rounds]),
        "every_answer_names_the_limit": refused_all,
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    begun = provenance.begin()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    rounds, heavy_ms, quiet_ms, refused_all = measure(args, vocab)
    result = summary(args, rounds, heavy_ms, quiet_ms, refused_all)
    print_table(result)
    if args.json:
        provenance.write(args.json, result, begun, "llguidance", depends_on=DEPENDS_ON)
    return 0 if refused_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
