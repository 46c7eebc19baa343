"""Many streams at once: what continuous batching gives each strategy, on an emulated profile.

    python -m benchmarks.concurrency [--profile 3090-pcie4-1gbe] [--model DIR] [--workers 8]
        [--streams 1,2,4,8,16] [--strategies odmoe,full-cache,reactive,lru-offload]
        [--prompt-len 16] [--new-tokens 32] [--repeats 3] [--batch-arithmetic exact|fused]
        [--max-resident-experts 2 (0: from each worker's group)]
        [--json OUT] [--plots DIR]

For each strategy one cluster is started, deployed as in ``benchmarks.strategies`` (the
same emulated expert copies and network, lru-offload on one box), with room for the
largest stream count in main's batch. For each stream count S, S clients each send a
different prompt at the same moment and stream their answers; measured on the clients'
side: the aggregate decode rate (every stream's tokens after its first, over the time
from the first stream's first token to the last stream's last), each stream's own decode
rate, and the time to first token (TTFT) from sending. From the workers' statistics of
the run: expert loads and bytes copied per generated token, the lever batching pulls (one
load serves every row routed to it). Each stream count runs ``--repeats`` times; the
median is reported with the spread. Every output is checked token for token against
Transformers (each stream's own run) under the default ``exact`` batch arithmetic;
``fused`` (one GEMM per expert over every sequence's rows) is measured for its speed, and
whether its tokens matched is reported, not required.
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
from benchmarks.overhead import percentile
from benchmarks.plots import line_plot
from benchmarks.strategies import DEFAULT_PROFILE, bench_model, deployment_for, yield_cpu_to_the_pipeline
from benchmarks.workload import prompt_of
from inference.constants import BATCH_ARITHMETICS
from inference.policies.depth import LINK_DEPTH
from inference.policies.strategies import STRATEGIES
from inference.runtime.client import RuntimeClient
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.sim.hardware import PROFILES
from inference.tools.reference import reference_generate
from inference.wire.generation import Done

if TYPE_CHECKING:
    from inference.tools.emulation import Emulation

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

DEFAULT_STREAMS = "1,2,4,8,16"


class Stream:
    """One client's generation: when it was sent, when each token came, what it ended with."""

    def __init__(self, prompt: list[int], new_tokens: int) -> None:
        self.prompt, self.new_tokens = prompt, new_tokens
        self.sent = 0.0
        self.token_times: list[float] = []
        self.done: Done | None = None
        self.error = ""

    def run(self, cluster: LocalCluster, start: threading.Barrier) -> None:
        client = RuntimeClient(cluster.addresses.main, cluster.deployment, curve=cluster.client_keys())
        try:
            start.wait()
            self.sent = time.perf_counter()
            for event in client.stream(self.prompt, self.new_tokens, timeout_s=600):
                if isinstance(event, Done):
                    self.done = event
                else:
                    self.token_times.append(time.perf_counter())
        except Exception as exc:  # reported, and the run counts as failed
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            client.close()

    @property
    def ttft_ms(self) -> float:
        return (self.token_times[0] - self.sent) * 1000

    @property
    def decode_tok_s(self) -> float:
        span = self.token_times[-1] - self.token_times[0]
        return (len(self.token_times) - 1) / span if span > 0 else 0.0


def measure(cluster: LocalCluster, prompts: list[list[int]], new_tokens: int) -> tuple[dict, list[list[int]]]:
    """All ``prompts`` at once, one client each; the run's figures and each stream's tokens."""
    streams = [Stream(prompt, new_tokens) for prompt in prompts]
    start = threading.Barrier(len(streams))
    threads = [threading.Thread(target=s.run, args=(cluster, start)) for s in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [s.error for s in streams if s.done is None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(streams)} streams failed: {failed[0]}")
    first = min(s.token_times[0] for s in streams)
    last = max(s.token_times[-1] for s in streams)
    decoded = sum(len(s.token_times) - 1 for s in streams)
    generated = sum(len(s.token_times) for s in streams)
    # The session's worker statistics come with the answer that ended it (the last one).
    loads = max(s.done.metrics.get("expert_loads", 0) for s in streams)  # type: ignore[union-attr]
    expert_bytes = max(s.done.metrics.get("expert_bytes", 0) for s in streams)  # type: ignore[union-attr]
    # Where a decode step goes: a batch step gives every stream one token, so its time is a
    # stream's gap between tokens; main's expert rounds (one per layer for the whole batch:
    # requests out, workers' loads and compute, results back) are timed by main; the rest is
    # main's own work for every sequence (attention, routers, sampling).
    gaps = [statistics.median(b - a for a, b in itertools.pairwise(s.token_times)) * 1000 for s in streams]
    # Of the rounds, the busiest worker's load wait + compute per layer (the rest: messages).
    decode_steps = [step for s in streams for step in s.done.metrics["per_step"] if step["step"] > 0]  # type: ignore[union-attr]
    rounds = [sum(layer["dispatch_ms"] for layer in step["layers"]) for step in decode_steps]
    busiest = [sum(layer["worker_ms"] for layer in step["layers"]) for step in decode_steps]
    step_ms = statistics.median(gaps)
    rounds_ms = statistics.median(rounds) if rounds else 0.0
    figures = {
        "decode_step_ms": step_ms,
        "expert_rounds_ms_per_step": rounds_ms,
        "busiest_worker_ms_per_step": statistics.median(busiest) if busiest else 0.0,
        "main_ms_per_step": step_ms - rounds_ms,
        "aggregate_decode_tok_s": decoded / (last - first) if last > first else 0.0,
        # From the first send to the last token: what sending them all at once took.
        "wall_s": last - min(s.sent for s in streams),
        "per_stream_decode_tok_s": statistics.fmean(s.decode_tok_s for s in streams),
        "ttft_p50_ms": percentile([s.ttft_ms for s in streams], 0.5),
        "ttft_p95_ms": percentile([s.ttft_ms for s in streams], 0.95),
        "largest_batch": max(s.done.metrics["max_batch"] for s in streams),  # type: ignore[union-attr]
        "loads_per_token": loads / generated,
        "bytes_copied_per_token": loads * expert_bytes / generated,
    }
    return figures, [list(s.done.token_ids) for s in streams]  # type: ignore[union-attr]


def median_with_spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def summarize(repeats: list[dict]) -> dict:
    """The median of each figure over the repeats, with its spread."""
    return {key: median_with_spread([r[key] for r in repeats]) for key in repeats[0]}


def add_scaling(per_count: dict[int, dict]) -> None:
    """Each stream count's medians against the 1-stream run's (when there is one)."""
    base = per_count.get(1)
    if base is None:
        return
    for count, figures in per_count.items():
        for key in ("aggregate_decode_tok_s", "per_stream_decode_tok_s"):
            figures[f"{key}_vs_1_stream"] = figures[key]["median"] / base[key]["median"]
        if "wall_s" in base:  # sent at once against one after another (count times one stream's run), medians
            figures["wall_vs_one_after_another"] = figures["wall_s"]["median"] / (count * base["wall_s"]["median"])


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise ValueError(f"--streams is a comma-separated list of counts, e.g. 1,2,4,8; got {text!r}") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"stream counts must be >= 1, got {text!r}")
    return sorted(set(counts))


def print_table(results: dict[str, dict[int, dict]], args: argparse.Namespace, exact: bool) -> None:
    print(
        f"profile {args.profile}; {args.workers} workers for the cluster strategies (lru-offload on one box); "
        f"prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens per stream; {args.batch_arithmetic} "
        "batch arithmetic; "
        f"{args.max_resident_experts or 'the prefetch depth of its group (inference.policies.depth) as'} "
        "resident experts per worker; "
        f"median of {args.repeats} runs (min–max)"
    )
    print()
    print(
        "| strategy | streams | aggregate decode tok/s | × 1 stream | per-stream decode tok/s | × 1 stream "
        "| TTFT p50 ms | TTFT p95 ms | expert loads per token | MB copied per token |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, per_count in results.items():
        for count, f in per_count.items():
            agg, per = f["aggregate_decode_tok_s"], f["per_stream_decode_tok_s"]
            print(
                f"| {name} | {count} | {agg['median']:.2f} ({agg['min']:.2f}–{agg['max']:.2f}) "
                f"| {f.get('aggregate_decode_tok_s_vs_1_stream', float('nan')):.2f} "
                f"| {per['median']:.2f} ({per['min']:.2f}–{per['max']:.2f}) "
                f"| {f.get('per_stream_decode_tok_s_vs_1_stream', float('nan')):.2f} "
                f"| {f['ttft_p50_ms']['median']:.0f} | {f['ttft_p95_ms']['median']:.0f} "
                f"| {f['loads_per_token']['median']:.2f} | {f['bytes_copied_per_token']['median'] / 1e6:.2f} |"
            )
    # Three tables alike by shape, on purpose: each has its own columns.
    print("\nwhere a decode step goes (medians): main's expert rounds and main's own work for every sequence\n")
    print("| strategy | streams | decode step ms | expert rounds ms | of which busiest worker ms | main's own ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, per_count in results.items():
        for count, f in per_count.items():
            print(
                f"| {name} | {count} | {f['decode_step_ms']['median']:.1f} "
                f"| {f['expert_rounds_ms_per_step']['median']:.1f} | {f['busiest_worker_ms_per_step']['median']:.1f} "
                f"| {f['main_ms_per_step']['median']:.1f} |"
            )
    print("\nall streams sent at once against one after another (wall time, medians)\n")
    print("| strategy | streams | wall s | × one after another |")
    print("|---|---:|---:|---:|")
    for name, per_count in results.items():
        for count, f in per_count.items():
            ratio = f.get("wall_vs_one_after_another", float("nan"))
            print(f"| {name} | {count} | {f['wall_s']['median']:.2f} | {ratio:.2f} |")
    print(f"\nevery stream's output token-identical to Transformers: {exact}")


# A benchmark's command line, alike strategies.py's build_parser by shape: each declares its own options.
def build_parser() -> argparse.ArgumentParser:
    """The command line: the profile and the model, the strategies and stream counts, the load, the outputs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE)
    parser.add_argument("--model", type=Path, help="a Mixtral checkpoint directory (default: make one)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--streams", default=DEFAULT_STREAMS, help="comma-separated concurrent stream counts")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-experts", type=int, default=2, help="lru-offload: experts cached per layer")
    parser.add_argument("--batch-arithmetic", choices=BATCH_ARITHMETICS, default="exact")
    parser.add_argument(
        "--max-resident-experts",
        type=int,
        default=LINK_DEPTH,
        help=f"experts a cacheless worker may hold on its device at once (default {LINK_DEPTH}, the link's prefetch "
        "depth on every profile, as in benchmarks.strategies; 0: the runtime's default, from each worker's group)",
    )
    parser.add_argument("--json", type=Path)
    roles.add_argument(parser)
    parser.add_argument("--plots", type=Path, help="write concurrency.png here")
    return parser


def checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """The stream counts and the strategies ``args`` name; a bad value is the parser's error."""
    try:
        counts = parse_counts(args.streams)
    except ValueError as exc:
        parser.error(str(exc))
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {', '.join(STRATEGIES)}")
    if args.prompt_len < 1 or args.new_tokens < 2 or args.repeats < 1 or args.max_resident_experts < 0:
        parser.error(
            "--prompt-len >= 1, --new-tokens >= 2, --repeats >= 1 and --max-resident-experts >= 0 are required"
        )
    return counts, strategies


def cluster_options(strategy: str, counts: list[int], emulation: Emulation, args: argparse.Namespace) -> ClusterOptions:
    """``strategy``'s cluster, deployed as in ``benchmarks.strategies``, with room for the most streams in a batch."""
    deployment = deployment_for(strategy, args.workers)
    base = DeploymentSettings(
        strategy=strategy,
        cache_experts=args.cache_experts,
        max_batch=max(counts),
        batch_arithmetic=args.batch_arithmetic,
        max_resident_experts=args.max_resident_experts,
    )
    return ClusterOptions(
        workers=deployment.workers,
        settings=emulation.settings(base, networked=deployment.networked),
        in_process=args.in_process,
    )


def measure_count(
    cluster: LocalCluster, prompts: list[list[int]], expected: list[list[int]], args: argparse.Namespace
) -> tuple[dict, bool]:
    """All ``prompts`` at once, ``--repeats`` times: the figures' medians with their spread
    (``summarize``), and whether every output equalled ``expected``."""
    exact = True
    repeats = []
    for _ in range(args.repeats):
        figures, outputs = measure(cluster, prompts, args.new_tokens)
        exact &= outputs == expected
        repeats.append(figures)
    return summarize(repeats), exact


def measure_strategy(
    strategy: str,
    model_dir: Path,
    emulation: Emulation,
    prompts: list[list[int]],
    expected: list[list[int]],
    counts: list[int],
    args: argparse.Namespace,
    work_dir: Path,
) -> tuple[dict[int, dict], bool]:
    """One cluster of ``strategy``, warmed up: each stream count's figures (``measure_count``),
    scaled against one stream's (``add_scaling``), and whether every output equalled ``expected``."""
    exact = True
    per_count: dict[int, dict] = {}
    with LocalCluster(model_dir, cluster_options(strategy, counts, emulation, args), work_dir=work_dir) as cluster:
        if "shadow" in cluster.processes:
            yield_cpu_to_the_pipeline(cluster.processes["shadow"].pid)
        cluster.generate(prompts[0][:8], 4)  # warm-up: first-call allocations in every process
        for count in counts:
            per_count[count], matched = measure_count(cluster, prompts[:count], expected[:count], args)
            exact &= matched
            agg = per_count[count]["aggregate_decode_tok_s"]["median"]
            print(f"  {strategy} × {count}: {agg:.2f} tok/s aggregate", file=sys.stderr)
    add_scaling(per_count)
    return per_count, exact


def measure_all(
    args: argparse.Namespace, counts: list[int], strategies: list[str]
) -> tuple[dict[str, dict[int, dict]], bool, Emulation]:
    """Every strategy's figures by stream count (``measure_strategy``), whether every output was
    Transformers' own, and the emulation the clusters ran."""
    results: dict[str, dict[int, dict]] = {}
    exact = True
    with tempfile.TemporaryDirectory(prefix="odmoe-concurrency-") as tmp:
        model_dir, config, _, emulation = bench_model(args.model, Path(tmp), args.profile)
        prompts = [prompt_of(args.prompt_len, config["vocab_size"], seed=i) for i in range(max(counts))]
        expected = [reference_generate(model_dir, prompt, args.new_tokens) for prompt in prompts]
        for strategy in strategies:
            results[strategy], matched = measure_strategy(
                strategy, model_dir, emulation, prompts, expected, counts, args, Path(tmp) / strategy
            )
            exact &= matched
    return results, exact, emulation


def write(
    args: argparse.Namespace, emulation: Emulation, results: dict[str, dict[int, dict]], exact: bool, begun: dict
) -> None:
    """The run's settings and every strategy's figures at ``--json``, when it was given (``roles.write_emulated``)."""
    roles.write_emulated(
        args,
        emulation,
        {
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "batch_arithmetic": args.batch_arithmetic,
            "max_resident_experts": args.max_resident_experts,  # 0: each worker's group's depth
            "exact": exact,
            "strategies": {name: {str(c): f for c, f in pc.items()} for name, pc in results.items()},
        },
        begun,
        DEPENDS_ON,
    )


def plot(args: argparse.Namespace, counts: list[int], results: dict[str, dict[int, dict]]) -> None:
    """``concurrency.png`` in ``--plots``, when it was given: each strategy's aggregate decode rate by stream count."""
    if not args.plots:
        return
    line_plot(
        args.plots / "concurrency.png",
        {name: (counts, [pc[c]["aggregate_decode_tok_s"]["median"] for c in counts]) for name, pc in results.items()},
        title=f"Aggregate decode rate by concurrent streams, emulated {args.profile}",
        xlabel="concurrent streams",
        ylabel="aggregate decode tok/s",
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    begun = provenance.begin()
    counts, strategies = checked(parser, args)
    results, exact, emulation = measure_all(args, counts, strategies)
    print_table(results, args, exact)
    write(args, emulation, results, exact, begun)
    plot(args, counts, results)
    return 0 if exact or args.batch_arithmetic == "fused" else 1


if __name__ == "__main__":
    raise SystemExit(main())
