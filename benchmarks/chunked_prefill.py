"""A long prompt joining a decoding batch: how long the batch's streams stall, whole or chunked.

    python -m benchmarks.chunked_prefill [--profile 3090-pcie4-1gbe] [--model DIR] [--workers 8]
        [--decoders 4] [--long-prompt 512] [--steps 0,64,128] [--new-tokens 48] [--repeats 3]
        [--json OUT]

One odmoe cluster per prefill step (``DeploymentSettings.prefill_step``; 0 = the whole prompt in one
batch step), deployed and emulated as in ``benchmarks.strategies``. Each run: ``--decoders``
clients send short prompts (16 tokens) at once and stream ``--new-tokens`` tokens; when
every one of them has 8 tokens, one more client sends a ``--long-prompt``-token prompt (8
new tokens). Measured on the clients' side: the longest gap between two tokens of a
decoding stream (the stall the long prefill causes; median over the decoders, then over
the runs), the decoders' median gap between tokens (their pace without it), and the long
prompt's time to first token. The decoders' tokens are checked against Transformers' own
run; the long prompt's against Transformers' run with the same pieces (chunked prefill
rounds differently from a whole one), and whether it also equals the whole-prompt run is
reported.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks import provenance, roles, substance
from benchmarks.concurrency import Stream, median_with_spread
from benchmarks.strategies import DEFAULT_PROFILE, bench_model, deployment_for, yield_cpu_to_the_pipeline
from benchmarks.workload import prompt_of
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.sim.hardware import PROFILES
from inference.tools.reference import reference_generate

if TYPE_CHECKING:
    from inference.tools.emulation import Emulation

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

SHORT_PROMPT = 16
LONG_NEW_TOKENS = 8
JOIN_AFTER_TOKENS = 8  # the long prompt is sent when every decoder has this many tokens


def gaps_ms(times: list[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in itertools.pairwise(times)]


def measure(cluster: LocalCluster, short: list[list[int]], long: list[int], new_tokens: int) -> tuple[dict, list]:
    """One run: the decoders, then the long prompt joining them; figures and every stream's tokens."""
    decoders = [Stream(prompt, new_tokens) for prompt in short]
    joiner = Stream(long, LONG_NEW_TOKENS)
    start = threading.Barrier(len(decoders))
    threads = [threading.Thread(target=d.run, args=(cluster, start)) for d in decoders]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 600
    while min(len(d.token_times) for d in decoders) < JOIN_AFTER_TOKENS:
        if time.monotonic() > deadline or any(d.error for d in decoders):
            raise RuntimeError(f"the decoders did not get going: {[d.error for d in decoders]}")
        time.sleep(0.002)
    join = threading.Thread(target=joiner.run, args=(cluster, threading.Barrier(1)))
    join.start()
    for thread in [*threads, join]:
        thread.join()
    failed = [s.error for s in [*decoders, joiner] if s.done is None]
    if failed:
        raise RuntimeError(f"{len(failed)} streams failed: {failed[0]}")
    figures = {
        "decoder_longest_gap_ms": statistics.median(max(gaps_ms(d.token_times)) for d in decoders),
        "decoder_median_gap_ms": statistics.median(g for d in decoders for g in gaps_ms(d.token_times)),
        "long_prompt_ttft_ms": joiner.ttft_ms,
        "long_prompt_pieces": joiner.done.metrics["prefill_pieces"],  # type: ignore[union-attr]
    }
    return figures, [list(s.done.token_ids) for s in [*decoders, joiner]]  # type: ignore[union-attr]


def build_parser() -> argparse.ArgumentParser:
    """The command line: the profile and the model, the decoders and the long prompt, the prefill steps, the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE)
    parser.add_argument("--model", type=Path, help="a Mixtral checkpoint directory (default: make one)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--long-prompt", type=int, default=512)
    parser.add_argument("--steps", default="0,64,128", help="comma-separated prefill steps (0 = whole)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    roles.add_argument(parser)
    return parser


def checked_steps(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """The prefill steps ``args`` name; a bad value is the parser's error."""
    try:
        steps = [int(part) for part in args.steps.split(",") if part]
    except ValueError:
        parser.error(f"--steps is a comma-separated list of token counts, e.g. 0,64; got {args.steps!r}")
    if not steps or min(steps) < 0:
        parser.error("--steps needs at least one count, each >= 0")
    if args.decoders < 1 or args.long_prompt < 2 or args.new_tokens <= JOIN_AFTER_TOKENS or args.repeats < 1:
        parser.error(f"--decoders >= 1, --long-prompt >= 2, --new-tokens > {JOIN_AFTER_TOKENS}, --repeats >= 1")
    return steps


def step_options(step: int, workers: int, emulation: Emulation, args: argparse.Namespace) -> ClusterOptions:
    """An odmoe cluster of ``workers`` workers whose main prefills ``step`` tokens a batch step (0:
    the whole prompt), with room for every stream in one batch."""
    base = DeploymentSettings(strategy="odmoe", max_batch=args.decoders + 1, prefill_step=step)
    return ClusterOptions(
        workers=workers,
        settings=emulation.settings(base, networked=True),
        in_process=args.in_process,
    )


def repeated(
    cluster: LocalCluster,
    short: list[list[int]],
    long: list[int],
    expected: list[list[int]],
    whole: list[int],
    args: argparse.Namespace,
) -> tuple[dict, bool, bool]:
    """``--repeats`` runs (``measure``) on ``cluster``, warmed up first: the figures' medians with
    their spread, whether every run's answers were ``expected``, and whether the last run's long
    answer equalled ``whole``, the whole-prompt run's."""
    if "shadow" in cluster.processes:  # a process of its own, not a thread of this one
        yield_cpu_to_the_pipeline(cluster.processes["shadow"].pid)
    cluster.generate(short[0][:8], 4)  # warm-up: first-call allocations in every process
    repeats = []
    exact, whole_equal = True, False
    for _ in range(args.repeats):
        figures, outputs = measure(cluster, short, long, args.new_tokens)
        exact &= outputs == expected
        whole_equal = outputs[-1] == whole
        repeats.append(figures)
    return {key: median_with_spread([r[key] for r in repeats]) for key in repeats[0]}, exact, whole_equal


def measure_all(
    parser: argparse.ArgumentParser, args: argparse.Namespace, steps: list[int]
) -> tuple[dict[int, dict], bool, dict[int, bool], Emulation]:
    """Each prefill step's figures (``repeated``), whether every answer was Transformers' with the
    same pieces, whether each step's long answer equalled the whole-prompt run's, and the emulation
    the clusters ran; a long prompt the model's context cannot hold is the parser's error."""
    results: dict[int, dict] = {}
    exact, whole_equal = True, {}
    with tempfile.TemporaryDirectory(prefix="odmoe-chunked-prefill-") as tmp:
        model_dir, config, _, emulation = bench_model(args.model, Path(tmp), args.profile)
        limit = config["max_position_embeddings"]
        if args.long_prompt + LONG_NEW_TOKENS > limit:
            parser.error(f"--long-prompt + {LONG_NEW_TOKENS} must fit the model's context of {limit} tokens")
        vocab = config["vocab_size"]
        short = [prompt_of(SHORT_PROMPT, vocab, seed=i) for i in range(args.decoders)]
        long = prompt_of(args.long_prompt, vocab, seed=1000)
        expected_short = [reference_generate(model_dir, p, args.new_tokens) for p in short]
        whole = reference_generate(model_dir, long, LONG_NEW_TOKENS)
        deployment = deployment_for("odmoe", args.workers)
        for step in steps:
            expected_long = reference_generate(model_dir, long, LONG_NEW_TOKENS, prefill_step=step)
            expected = [*expected_short, expected_long]
            options = step_options(step, deployment.workers, emulation, args)
            with LocalCluster(model_dir, options, work_dir=Path(tmp) / f"step-{step}") as cluster:
                results[step], matched, whole_equal[step] = repeated(cluster, short, long, expected, whole, args)
            exact &= matched
            stall = results[step]["decoder_longest_gap_ms"]["median"]
            print(f"  prefill_step {step}: longest decoder gap {stall:.0f} ms", file=sys.stderr)
    return results, exact, whole_equal, emulation


def print_table(results: dict[int, dict], whole_equal: dict[int, bool], exact: bool, args: argparse.Namespace) -> None:
    """The run's shape, then a Markdown row per prefill step, and whether every answer was exact."""
    print(
        f"profile {args.profile}; odmoe, {args.workers} workers; {args.decoders} decoding streams "
        f"({SHORT_PROMPT}-token prompts, {args.new_tokens} new tokens); a {args.long_prompt}-token prompt joins "
        f"after {JOIN_AFTER_TOKENS} tokens; median of {args.repeats} runs (min–max)\n"
    )
    print(
        "| prefill step | pieces | decoders' longest gap ms | decoders' median gap ms | long prompt TTFT ms "
        "| long answer = whole-prompt run |"
    )
    print("|---:|---:|---:|---:|---:|---|")
    # Alike concurrency.py's table by shape, on purpose: each benchmark's table has its own columns.
    for step, f in results.items():
        longest, ttft = f["decoder_longest_gap_ms"], f["long_prompt_ttft_ms"]
        print(
            f"| {step or 'whole'} | {f['long_prompt_pieces']['median']:.0f} "
            f"| {longest['median']:.0f} ({longest['min']:.0f}–{longest['max']:.0f}) "
            f"| {f['decoder_median_gap_ms']['median']:.0f} "
            f"| {ttft['median']:.0f} ({ttft['min']:.0f}–{ttft['max']:.0f}) | {whole_equal[step]} |"
        )
    print(f"\nevery answer token-identical to Transformers' run with the same prefill pieces: {exact}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    begun = provenance.begin()
    steps = checked_steps(parser, args)
    results, exact, whole_equal, emulation = measure_all(parser, args, steps)
    print_table(results, whole_equal, exact, args)
    roles.write_emulated(
        args,
        emulation,
        {
            "decoders": args.decoders,
            "long_prompt": args.long_prompt,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "exact": exact,
            "long_answer_equals_whole_prompt_run": {str(s): v for s, v in whole_equal.items()},
            "prefill_steps": {str(s): f for s, f in results.items()},
        },
        begun,
        DEPENDS_ON,
    )
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
