"""The four strategies side by side on one emulated hardware profile, in one run.

    python -m benchmarks.strategies [--profile 3090-pcie4-1gbe] [--model DIR] [--workers 8]
        [--pairs 16:32,16:64,64:32,64:64] [--strategies odmoe,full-cache,reactive,lru-offload]
        [--hybrid odmoe,reactive,lru-offload] [--drafts 4,auto8] [--repeats 1] [--max-resident-experts N]
        [--expert-compute-ms MS | --calibration PREVIOUS.json] [--json OUT] [--plots DIR]

Every strategy runs the same greedy generations on the same checkpoint through the real
runtime (main, workers and, for odmoe, the shadow as processes on 127.0.0.1) with the
profile's expert-copy and network proportions emulated (``inference.tools.emulation``): full
cache, reactive and odmoe as a cluster of ``--workers`` boxes over the emulated network;
lru-offload as Mixtral-Offloading runs, on one box (main and one worker, no network hop,
``--cache-experts`` per layer). All roles share this machine's cores, which separate boxes
would not: the shadow runs at the lowest CPU priority so that it takes only idle time.
For each (input, output) length pair it measures decode tok/s, end-to-end tok/s, TTFT,
recall and the peak expert bytes a worker held, averages over the pairs as the paper
does, and divides by full cache's figure from the same run.
``--repeats N`` runs every strategy N times, interleaved (round 1: each strategy once, in
order; then round 2; ...), each time on a fresh cluster, so that drift of this machine's speed
falls on all strategies alike; each figure is then the median over the rounds with its
min–max and its spread, (max − min) / median, and each ratio is taken within a round (against
that round's full cache) before its median is. Every round's own figures are in the JSON.
The emulation's time scale rests on one expert's decode compute time here, measured at the
start of each run; it moves between runs (a few %), so two runs' emulated copies and links
differ by as much. ``--expert-compute-ms MS`` scales the emulation by MS instead, and
``--calibration FILE`` by the time a previous run's ``--json`` FILE was scaled by, so that
runs compare at the same scale (the time measured now is printed beside it and recorded).
Output: a Markdown table, JSON (``--json``), and a PNG bar chart (``--plots``). Without
``--model`` a random Mixtral with 8 layers of 8 experts (hidden 512) is made in a temporary
folder; every exact strategy's output is checked token for token against Transformers.
``--strategies`` may also name an approximate one (``importance``, ``prerouter``): it is marked
so in the table and its token agreement with Transformers is reported, not required; on the
random model importance's similarity table is calibrated on random ids first (its experts are
random too), while the prerouter needs a ``--model`` whose heads were trained (``train-prerouter``).
``--hybrid`` names strategies to run a second time with hybrid CPU/GPU execution on the workers
(``inference.policies.hybrid``; rows ``NAME+hybrid``), the CPU path emulated from the profile's host DRAM.
``--drafts K[,K...]`` runs odmoe again with the shadow drafting K tokens a pass (``draft_tokens``; rows
``odmoe+draftsK``), or ``autoK`` up to K as ``draft_policy="auto"`` picks (rows ``odmoe+drafts-autoK``),
the copy charges unchanged: each row's decode beside odmoe's without drafts, its
shadow's agreement, tokens per pass and distinct experts per layer per pass, and the bound those set,
min(full cache / odmoe, tokens per pass x top-k / distinct experts per layer per pass). The simulator
does not model drafts: those rows have no prediction.
Each worker holds as many experts at once as the link's term of the prefetch depth
(``inference.policies.depth``: 1 + ceil(compute / copy) of an expert at the profile's proportions, 2 on
every profile here, what every recorded run held), lru-offload's one worker too, where the
runtime's default would add the layer's term (its layer's two experts + 1: 3);
``--max-resident-experts N`` sets it instead.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import provenance, roles, substance
from benchmarks.draft_agreement import measure as measure_drafts
from benchmarks.plots import bar_plot
from benchmarks.sim_prediction import measure_decode, measure_machine, predict_for_run
from benchmarks.workload import BENCH_MODEL, parse_pairs, prompt_of
from inference.modelio.checkpoint import Checkpoint, expert_key_name
from inference.policies.hybrid import expert_flops, predicted_share
from inference.policies.placement import placement
from inference.policies.strategies import RUNTIME_STRATEGIES, STRATEGIES, get_strategy, needed_files
from inference.runtime.importance import SIMILARITY_FILE, write_similarity
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.metrics import BREAKDOWN, HOPS_SPLIT
from inference.runtime.spec import DeploymentSettings
from inference.sim import hardware as sim_hardware
from inference.sim.cluster import MachineCosts
from inference.sim.hardware import PROFILES
from inference.tools.calibration import calibrate
from inference.tools.emulation import Emulation, emulation_for, measure_expert_compute
from inference.tools.reference import reference_generate
from inference.tools.tiny import make_tiny

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

DEFAULT_PROFILE = sim_hardware.DEFAULT_PROFILE
DEFAULT_PAIRS = "16:32,16:64,64:32,64:64"


HYBRID = "+hybrid"  # the suffix of a strategy's row run with hybrid execution
CODEC = "+codec"  # the suffix of a strategy's row run on coded experts (expert_codec="exponent-plane")
DRAFTS = "+drafts"  # the suffix (then k) of odmoe's row run with the shadow drafting k tokens a pass
# The figures reported with their min–max and spread over rounds: the measured rates and the ratios.
SPREAD_FIGURES = (
    "decode_tok_s",
    "e2e_tok_s",
    "ttft_ms",
    "decode_tok_s_vs_full_cache",
    "e2e_tok_s_vs_full_cache",
    "decode_vs_lru_offload",
    "decode_vs_without_hybrid",
    "decode_vs_without_codec",
    "decode_vs_without_drafts",
    "drafts_bound",
    "drafts_of_bound",
)


@dataclass(frozen=True)
class Deployment:
    """How one strategy is deployed for the benchmark."""

    strategy: str
    workers: int
    networked: bool  # roles on separate boxes, so the emulated network applies
    hybrid: bool = False  # workers compute late experts on their CPUs (inference.policies.hybrid)
    codec: bool = False  # the shard build codes the experts; workers keep, copy and decode coded bytes
    drafts: int = 0  # the shadow drafts this many tokens a pass (``draft_tokens``)
    draft_auto: bool = False  # ... or up to that many, as draft_policy="auto" picks

    @property
    def label(self) -> str:
        drafts = f"{DRAFTS}{'-auto' if self.draft_auto else ''}{self.drafts}" if self.drafts else ""
        return self.strategy + (HYBRID if self.hybrid else "") + (CODEC if self.codec else "") + drafts


def deployment_for(
    strategy: str, workers: int, *, hybrid: bool = False, codec: bool = False, drafts: int = 0, draft_auto: bool = False
) -> Deployment:
    if strategy == "lru-offload":
        return Deployment(
            strategy, 1, networked=False, hybrid=hybrid, codec=codec
        )  # one GPU box, as Mixtral-Offloading
    return Deployment(
        strategy, workers, networked=True, hybrid=hybrid, codec=codec, drafts=drafts, draft_auto=draft_auto
    )


def agreement(outputs: list[list[int]], expected: list[list[int]]) -> float:
    """The share of tokens equal to Transformers' at the same position."""
    same = sum(a == b for out, want in zip(outputs, expected, strict=True) for a, b in zip(out, want, strict=False))
    return same / sum(max(len(out), len(want)) for out, want in zip(outputs, expected, strict=True))


def summarize(runs: list[dict]) -> dict:
    """Average one strategy's per-pair figures, as the paper averages its four pairs."""
    recalls = [r["recall"] for r in runs if r["recall"] is not None]
    drafted = [r["drafts"] for r in runs if r.get("drafts")]
    return {
        "decode_tok_s": statistics.fmean(r["decode_tok_s"] for r in runs),
        "e2e_tok_s": statistics.fmean(r["e2e_tok_s"] for r in runs),
        "ttft_ms": statistics.fmean(r["ttft_ms"] for r in runs),
        "recall": statistics.fmean(recalls) if recalls else None,
        "peak_expert_bytes_per_worker": max(r["peak_expert_bytes_per_worker"] for r in runs),
        "cpu_experts_per_token": sum(r.get("cpu_experts", 0) for r in runs)
        / max(1, sum(r.get("output", 0) for r in runs)),
        # Where a decode layer's time went in the cluster (medians over the pairs of each pair's medians).
        "main_between_layers_ms": _median_of(r.get("main_between_layers_ms") for r in runs),
        "layer_parts_ms": {
            name: _median_of((r.get("layer_parts_ms") or {}).get(name) for r in runs) for name in BREAKDOWN
        },
        "hops_split_ms": {
            name: _median_of((r.get("hops_split_ms") or {}).get(name) for r in runs) for name in HOPS_SPLIT
        },
        # The same parts' means (averaged over the pairs, as the rates are): they add up to a token.
        "main_between_layers_mean_ms": _mean_of(r.get("main_between_layers_mean_ms") for r in runs),
        "layer_parts_mean_ms": {
            name: _mean_of((r.get("layer_parts_mean_ms") or {}).get(name) for r in runs) for name in BREAKDOWN
        },
        # Drafting (rows +draftsK): the shadow's agreement, tokens per decode pass, and distinct
        # experts per layer per pass (means over the pairs); None without drafts.
        "draft_agreement": _mean_of(d["agreement"] for d in drafted),
        "tokens_per_pass": _mean_of(d["tokens_per_pass"] for d in drafted),
        "distinct_experts_per_pass": _mean_of(d["distinct_experts"] for d in drafted),
        "pairs": runs,
    }


def _median_of(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _mean_of(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def add_ratios(results: dict[str, dict]) -> None:
    base = results.get("full-cache")
    for figures in results.values():
        for key in ("decode_tok_s", "e2e_tok_s"):
            figures[f"{key}_vs_full_cache"] = figures[key] / base[key] if base else None
    if "odmoe" in results and "lru-offload" in results:
        results["odmoe"]["decode_vs_lru_offload"] = (
            results["odmoe"]["decode_tok_s"] / results["lru-offload"]["decode_tok_s"]
        )
    for name, figures in results.items():  # what hybrid execution changed, strategy by strategy
        plain = results.get(name.removesuffix(HYBRID)) if name.endswith(HYBRID) else None
        if plain is not None:
            figures["decode_vs_without_hybrid"] = figures["decode_tok_s"] / plain["decode_tok_s"]
        plain = results.get(name.removesuffix(CODEC)) if name.endswith(CODEC) else None
        if plain is not None:  # what coded experts changed
            figures["decode_vs_without_codec"] = figures["decode_tok_s"] / plain["decode_tok_s"]
        plain = results.get(name.split(DRAFTS)[0]) if DRAFTS in name else None
        if plain is not None:  # what drafts changed, and the most they could have (drafts_bound)
            figures["decode_vs_without_drafts"] = figures["decode_tok_s"] / plain["decode_tok_s"]
            figures["drafts_bound"] = drafts_bound(figures, plain, base)
            bound = figures["drafts_bound"]
            figures["drafts_of_bound"] = figures["decode_vs_without_drafts"] / bound if bound else None


def drafts_bound(drafted: dict, plain: dict, full_cache: dict | None) -> float | None:
    """The most drafts can give a row over its plain one (pure): fewer expert bytes per token, at most
    tokens per pass x top-k / distinct experts per layer per pass, and never past full cache's speed."""
    tokens, distinct, top_k = (
        drafted.get("tokens_per_pass"),
        drafted.get("distinct_experts_per_pass"),
        drafted.get("top_k"),
    )
    if not (tokens and distinct and top_k):
        return None
    copies = tokens * top_k / distinct
    if full_cache is None:
        return copies
    return min(full_cache["decode_tok_s"] / plain["decode_tok_s"], copies)


def aggregate_rounds(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Each strategy's figures over interleaved rounds of ``{strategy: figures}`` (pure).

    The ratios (``add_ratios``) are taken within each round, against that round's full cache,
    and then, like every other figure, reported as the median over the rounds; each pair's
    figures likewise. The figures of ``SPREAD_FIGURES`` also get ``KEY_range`` ([min, max] over
    the rounds) and ``KEY_spread`` ((max - min) / median); each round's own figures, ratios
    included, are kept under ``rounds``.
    """
    with_ratios = [copy.deepcopy(figures) for figures in rounds]
    for figures in with_ratios:
        add_ratios(figures)
    results = {}
    for name in with_ratios[0]:
        rows = [figures[name] for figures in with_ratios]
        result = {key: _over_rounds(key, [row[key] for row in rows]) for key in rows[0] if key != "pairs"}
        result["pairs"] = [
            {key: _over_rounds(key, [run[key] for run in runs]) for key in runs[0]}
            for runs in zip(*(row["pairs"] for row in rows), strict=True)
        ]
        for key in SPREAD_FIGURES:
            if result.get(key) is not None:
                values = [row[key] for row in rows]
                result[f"{key}_range"] = [min(values), max(values)]
                result[f"{key}_spread"] = (max(values) - min(values)) / result[key]
        result["rounds"] = rows
        results[name] = result
    return results


def _over_rounds(key: str, values: list) -> object:
    """One figure over the rounds: the largest of a peak, the value itself where every round
    gives the same (lengths, flags, None), the median otherwise."""
    if key.startswith("peak_"):
        return max(values)
    if all(value == values[0] for value in values):
        return values[0]
    if all(isinstance(value, dict) for value in values):  # figure by figure
        return {k: _over_rounds(k, [value[k] for value in values]) for k in values[0]}
    if any(value is None for value in values):
        return _median_of(values)
    return statistics.median(values)


def copy_bound(layers: int, top_k: int, workers: int, expert_bytes: int, copy_bytes_per_s: float) -> dict:
    """The fastest a cacheless cluster can decode: every worker copies its share of each token's experts.

    Each token needs ``layers x top_k`` expert loads spread over ``workers`` copy links, so
    no overlap of loads with compute can beat ``workers / (layers x top_k x load time)``.
    """
    load_s = expert_bytes / copy_bytes_per_s
    loads_per_worker = layers * top_k / workers
    return {
        "loads_per_worker_per_token": loads_per_worker,
        "load_ms": load_s * 1000,
        "tok_s": 1 / (loads_per_worker * load_s),
    }


def split_bound(
    layers: int,
    top_k: int,
    workers: int,
    expert_bytes: int,
    copy_bytes_per_s: float,
    host_memory_bytes_per_s: float,
) -> dict:
    """The fastest a cacheless cluster can decode if it also computes experts on the workers' CPUs.

    Of a token's ``E = layers x top_k`` experts, ``x`` run on the workers' CPUs straight from
    host memory (``h`` each) and the rest are copied (``c`` each). The copies can run ahead on
    predictions, over ``workers`` links at once: ``T >= (E - x) c / workers``. A CPU expert
    cannot start before its layer's hidden state arrives, and a layer's ``top_k`` experts can
    at best run on that many CPUs at once, so the CPU experts add ``T >= (x / top_k) h`` to the
    critical path. The best split makes the two equal: ``T = E c h / (workers h + top_k c)``,
    ``1 + top_k c / (workers h)`` times the copy bound's rate. An upper bound: main's own layers
    and the device's compute are left out.
    """
    copy_s = expert_bytes / copy_bytes_per_s
    cpu_s = expert_bytes / host_memory_bytes_per_s
    experts = layers * top_k
    on_cpus = experts * copy_s * top_k / (workers * cpu_s + top_k * copy_s)
    token_s = on_cpus * cpu_s / top_k
    return {
        "cpu_experts_per_token": on_cpus,
        "cpu_ms": cpu_s * 1000,
        "copy_ms": copy_s * 1000,
        "tok_s": 1 / token_s,
    }


def yield_cpu_to_the_pipeline(pid: int) -> None:
    """Run the shadow at the lowest CPU priority: in a real cluster it has a box of its own.

    Here every role shares this machine's cores; without this the shadow, which runs ahead
    on its own, takes CPU time from main and the workers that separate boxes would not.
    """
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, 19)


def run_strategy(
    model_dir: Path,
    deployment: Deployment,
    emulation: Emulation,
    prompts: list[tuple[list[int], int]],
    args: argparse.Namespace,
    work_dir: Path,
) -> tuple[dict, list[list[int]]]:
    base = DeploymentSettings(
        strategy=deployment.strategy,
        shadow_dtype=args.shadow_dtype,
        cache_experts=args.cache_experts,
        max_resident_experts=prefetch_depth_of(args, emulation),
        token_period=args.token_period,
        kv_period=args.kv_period,
        hybrid=deployment.hybrid,
        expert_codec="exponent-plane" if deployment.codec else "none",
        draft_tokens=deployment.drafts,
        draft_policy="auto" if deployment.draft_auto else "fixed",
    )
    settings = emulation.settings(base, networked=deployment.networked)
    options = ClusterOptions(workers=deployment.workers, settings=settings, in_process=args.in_process)
    runs, outputs = [], []
    shards = f"w{deployment.workers}" + ("-coded" if deployment.codec else "")  # each kept for every round
    with LocalCluster(model_dir, options, work_dir=work_dir / shards) as cluster:
        if "shadow" in cluster.processes:
            yield_cpu_to_the_pipeline(cluster.processes["shadow"].pid)
        cluster.generate(prompts[0][0][:8], 4)  # warm-up: first-call allocations in every process
        for prompt, new_tokens in prompts:
            done = cluster.generate(prompt, new_tokens)
            m = done.metrics
            outputs.append(done.token_ids)
            runs.append(
                {
                    "input": len(prompt),
                    "output": len(done.token_ids),
                    "decode_tok_s": m["decode_tok_s"],
                    "e2e_tok_s": m["e2e_tok_s"],
                    "ttft_ms": m["ttft_ms"],
                    "recall": m["recall"] if deployment.strategy in ("odmoe", "lru-offload") else None,
                    "peak_expert_bytes_per_worker": max(m["worker_peak_expert_bytes"].values()),
                    "expert_bytes": m["expert_bytes"],
                    "cpu_experts": m["cpu_experts"],
                    "main_between_layers_ms": m["decode_main_between_layers_ms_median"],
                    "layer_parts_ms": m["decode_layer_breakdown_ms_median"],
                    "hops_split_ms": m["decode_hops_split_ms_median"],
                    "main_between_layers_mean_ms": m["decode_main_between_layers_ms_mean"],
                    "layer_parts_mean_ms": m["decode_layer_breakdown_ms_mean"],
                    "drafts": m.get("drafts"),
                }
            )
            print(
                f"  {deployment.label} {len(prompt)}:{new_tokens}: decode {m['decode_tok_s']:.1f} tok/s, "
                f"TTFT {m['ttft_ms']:.0f} ms",
                file=sys.stderr,
            )
    figures = summarize(runs)
    figures["top_k"] = json.loads((model_dir / "config.json").read_text())["num_experts_per_tok"]
    return figures, outputs


def print_layer_parts(results: dict[str, dict], machine: MachineCosts, measurement: dict, layers: int) -> None:
    """Where a decode layer's time went in each strategy's cluster, beside what the simulator was
    given for the same parts before the run (from a main + one worker of the runtime) and the same
    pieces timed alone in tight loops."""

    def ms(value: float | None) -> str:
        return "" if value is None else f"{value:.3f}"

    print(
        "\nwhere a decode layer's time went in the cluster (ms, medians; the worker's parts are those of the "
        "worker main waited for last; hops include an emulated link, and of them the receiving processes' time "
        "with the messages before handling them: decoding, other messages first, a held message's late wake-up)\n"
        "| strategy | main between layers | main before send | hops both ways | worker Python | worker load wait "
        "+ compute | main after answers |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for name, r in results.items():
        parts = r.get("layer_parts_ms") or {}
        receiving = (r.get("hops_split_ms") or {}).get("receiving")
        cells = [ms(parts.get(part)) for part in BREAKDOWN]
        if receiving is not None:
            cells[BREAKDOWN.index("hops")] += f" ({receiving:.3f} receiving)"
        print(f"| {name} | {ms(r.get('main_between_layers_ms'))} | " + " | ".join(cells) + " |")
    print_layer_means(results, layers)
    if "in_rhythm" in measurement:
        rows = [
            ("the simulator's costs (main + 1 worker of the runtime)", machine),
            ("the same timed alone in tight loops", MachineCosts(**measurement["tight_loop"])),
        ]
    else:
        rows = [("the simulator's costs", machine)]
    for label, costs in rows:
        wake = f" + {costs.hold_wake_s * 1000:.3f} late per held message" if costs.hold_wake_s else ""
        python = f"{costs.worker_python_s * 1000:.3f}" if costs.worker_python_s else "(in the round trip)"
        print(
            f"| {label} | {(costs.main_layer_s + costs.step_fixed_s / layers) * 1000:.3f} "
            f"| {(costs.main_before_send_s + costs.main_dispatch_s) * 1000:.3f} (before + after) "
            f"| {costs.round_trip_s * 1000:.3f} loopback "
            f"+ the link{wake} | {python} | {costs.expert_compute_s * 1000:.3f} per expert (+ copy waits) | |"
        )


def print_layer_means(results: dict[str, dict], layers: int) -> None:
    """The same parts' means, which add up to a token (``layers`` × their sum, beside the measured
    interval ``1000 / decode_tok_s``): where a mean is well above its median, that part has a tail."""
    rows = [(name, r) for name, r in results.items() if r.get("main_between_layers_mean_ms") is not None]
    if not rows:
        return
    print(
        f"\nthe same, means (ms; × {layers} layers they make a token, beside the measured interval)\n"
        "| strategy | main between layers | main before send | hops both ways | worker Python | worker load wait "
        "+ compute | main after answers | × layers | measured per token |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for name, r in rows:
        parts = r.get("layer_parts_mean_ms") or {}
        means = [r["main_between_layers_mean_ms"]] + [parts.get(part) for part in BREAKDOWN]
        known = [v for v in means if v is not None]
        cells = ["" if v is None else f"{v:.3f}" for v in means]
        measured = f"{1000 / r['decode_tok_s']:.1f}" if r.get("decode_tok_s") else ""
        print(f"| {name} | " + " | ".join(cells) + f" | {layers * sum(known):.1f} | {measured} |")


def print_table(
    results: dict[str, dict], emulation: Emulation, calibration: Calibration, args: argparse.Namespace, exact: bool
) -> None:
    print(f"{emulation.describe()}")
    print(calibration.describe())
    print(
        f"pairs (input:output) {args.pairs}; {args.workers} workers for the cluster strategies, lru-offload on one "
        f"box with {args.cache_experts} experts cached per layer; {args.shadow_dtype} shadow, token aligned every "
        f"{args.token_period} step(s), KV cache every {args.kv_period} step(s) (0 = never); "
        f"{prefetch_depth_of(args, emulation)} experts held per worker at once "
        f"({'--max-resident-experts' if args.max_resident_experts else 'the link term of the profile'})"
    )
    if args.repeats > 1:
        print(f"each figure the median (min–max) of {args.repeats} interleaved rounds, each ratio taken within a round")
    print()
    print(
        "| strategy | | decode tok/s | e2e tok/s | TTFT ms | decode ÷ full cache | recall "
        "| peak expert bytes per worker | token agreement | simulator's prediction (decode tok/s) "
        "| ... with tight-loop costs |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        ratio = "" if r["decode_tok_s_vs_full_cache"] is None else _figure(r, "decode_tok_s_vs_full_cache", ".2f")
        recall = "" if r["recall"] is None else f"{r['recall']:.1%}"
        print(
            f"| {name} | {'approximate' if r['approximate'] else 'exact'} | {_figure(r, 'decode_tok_s', '.2f')} "
            f"| {_figure(r, 'e2e_tok_s', '.2f')} | {_figure(r, 'ttft_ms', '.0f')} | {ratio} | {recall} "
            f"| {r['peak_expert_bytes_per_worker']:,} | {r['token_agreement']:.1%} "
            f"| {_predicted(r.get('sim_predicted_decode_tok_s'), r['decode_tok_s'])} "
            f"| {_predicted(r.get('sim_predicted_decode_tok_s_tight_loop_costs'), r['decode_tok_s'])} |"
        )
    for name, r in results.items():
        if "decode_vs_without_hybrid" in r:
            print(
                f"\n{name}: {r['cpu_experts_per_token']:.2f} experts per token computed on the workers' CPUs; "
                f"decode {_figure(r, 'decode_vs_without_hybrid', '.2f')}x {name.removesuffix(HYBRID)}'s"
            )
    for name, r in results.items():
        if "decode_vs_without_codec" in r:
            print(f"\n{name}: decode {_figure(r, 'decode_vs_without_codec', '.2f')}x {name.removesuffix(CODEC)}'s")
    if "decode_vs_lru_offload" in results.get("odmoe", {}):
        print(f"\nodmoe ÷ lru-offload (decode): {_figure(results['odmoe'], 'decode_vs_lru_offload', '.2f')}")
    if args.repeats > 1:
        print(f"\nspread over the {args.repeats} rounds, (max − min) ÷ median:")
        for name, r in results.items():
            spreads = [
                f"{label} {r[key + '_spread']:.1%}"
                for key, label in (("decode_tok_s", "decode"), ("decode_tok_s_vs_full_cache", "decode ÷ full cache"))
                if key + "_spread" in r
            ]
            print(f"  {name}: {', '.join(spreads)}")
    print(f"every exact strategy's output token-identical to Transformers: {exact}")


def _figure(figures: dict, key: str, spec: str) -> str:
    """``figures[key]`` formatted by ``spec``, as "median (min–max)" where there were several rounds."""
    text = format(figures[key], spec)
    if len(figures["rounds"]) > 1:
        low, high = figures[f"{key}_range"]
        text += f" ({low:{spec}}–{high:{spec}})"
    return text


def _predicted(predicted: float | None, measured: float) -> str:
    """The simulator's figure and its error against the measured one ("" where it has none)."""
    if predicted is None:
        return ""
    return f"{predicted:.2f} ({predicted / measured - 1:+.0%})"


@dataclass(frozen=True)
class Calibration:
    """What the emulation's time scale rests on: one expert's decode compute time here."""

    source: str  # "measured", "--expert-compute-ms" or the --calibration file
    expert_compute_here_s: float  # the time the emulation is scaled by
    measured_here_s: float  # the time this run measured

    def describe(self) -> str:
        if self.source == "measured":
            return f"time scale from this run's measurement, an expert computing in {self.measured_here_s * 1e3:.3f} ms"
        return (
            f"time scale from {self.source}: an expert computes here in {self.expert_compute_here_s * 1e3:.3f} ms; "
            f"this run measured {self.measured_here_s * 1e3:.3f} ms "
            f"({self.measured_here_s / self.expert_compute_here_s - 1:+.1%})"
        )


def expert_compute_of(recorded: Path) -> float:
    """The expert compute seconds a previous run's ``--json`` file scaled its emulation by."""
    try:
        data = json.loads(recorded.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {recorded}: {exc}") from None
    try:
        seconds = data["emulation"]["expert_compute_here_s"]
    except (KeyError, TypeError):
        raise ValueError(
            f"{recorded} has no emulation.expert_compute_here_s: give the --json file of a benchmarks.strategies run"
        ) from None
    if not _positive(seconds):
        raise ValueError(f"{recorded}: emulation.expert_compute_here_s must be a positive number, got {seconds!r}")
    return seconds


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def bench_model(model: Path | None, tmp: Path, profile: str) -> tuple[Path, dict, int, Emulation]:
    """The benchmarks' checkpoint (``model``, or a random one made in ``tmp``), its config, one
    expert's bytes, and ``profile``'s emulation scaled to this machine's expert compute."""
    model_dir, config, expert_bytes, emulation, _ = calibrated_bench_model(model, tmp, profile)
    return model_dir, config, expert_bytes, emulation


def calibrated_bench_model(
    model: Path | None, tmp: Path, profile: str, given: tuple[str, float] | None = None
) -> tuple[Path, dict, int, Emulation, Calibration]:
    """``bench_model``, its emulation scaled to ``given`` (where an expert compute time came from,
    and those seconds) in place of this machine's measurement, and the ``Calibration`` it used;
    the measurement is made and printed either way, to show how far this machine is from it."""
    model_dir = model or make_tiny(tmp / "model", seed=0, **BENCH_MODEL)
    checkpoint = Checkpoint(model_dir)
    config = checkpoint.config
    hidden, intermediate = config["hidden_size"], checkpoint.family.expert_intermediate(config)
    expert_bytes = sum(checkpoint.nbytes(expert_key_name(0, 0, proj)) for proj in ("w1", "w2", "w3"))
    hidden_bytes = hidden * expert_bytes // (3 * hidden * intermediate)  # a hidden row in the weights' dtype
    measured = measure_expert_compute(hidden, intermediate, act=config.get("hidden_act", "silu"))
    source, here = given or ("measured", measured)
    calibration = Calibration(source, expert_compute_here_s=here, measured_here_s=measured)
    flops = expert_flops(hidden, intermediate, 1)
    emulation = emulation_for(profile, here, expert_bytes, hidden_bytes, expert_flops_here=flops)
    print(emulation.describe(), file=sys.stderr)
    print(calibration.describe(), file=sys.stderr)
    return model_dir, config, expert_bytes, emulation, calibration


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE)
    parser.add_argument("--model", type=Path, help="a Mixtral checkpoint directory (default: make one)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--pairs", default=DEFAULT_PAIRS, help="comma-separated INPUT:OUTPUT token counts")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--shadow-dtype", default="fp32")
    parser.add_argument("--token-period", type=int, default=1, help="odmoe: align the shadow's token every N steps")
    parser.add_argument("--kv-period", type=int, default=1, help="odmoe: align the shadow's KV cache every N steps")
    parser.add_argument("--cache-experts", type=int, default=2, help="lru-offload: experts cached per layer")
    parser.add_argument(
        "--max-resident-experts",
        type=int,
        metavar="N",
        help="experts a worker holds at once (default: the profile's prefetch depth, inference.policies.depth)",
    )
    parser.add_argument(
        "--hybrid",
        default="",
        help="comma-separated strategies to run again with hybrid CPU/GPU execution on the workers (rows NAME+hybrid)",
    )
    parser.add_argument(
        "--codec",
        default="",
        help="comma-separated strategies to run again on coded experts (expert_codec=exponent-plane; rows NAME+codec)",
    )
    parser.add_argument(
        "--drafts",
        default="",
        help="comma-separated draft_tokens values to run odmoe again with, the shadow drafting (rows odmoe+draftsK); "
        "autoK: up to K, as draft_policy auto picks (rows odmoe+drafts-autoK)",
    )
    parser.add_argument("--notes", default="", help="a note recorded in the JSON (e.g. what else ran on the machine)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every strategy N times, interleaved, and report the medians (min–max) over the rounds",
    )
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument(
        "--expert-compute-ms",
        type=float,
        metavar="MS",
        help="scale the emulation by this expert compute time here instead of measuring it (still measured, printed)",
    )
    scale.add_argument(
        "--calibration",
        type=Path,
        metavar="FILE",
        help="scale the emulation by the expert compute time of a previous run's --json FILE (same --model)",
    )
    parser.add_argument("--json", type=Path)
    roles.add_argument(parser)
    parser.add_argument("--plots", type=Path, help="write strategies.png here")
    return parser


def prefetch_depth_of(args: argparse.Namespace, emulation: Emulation) -> int:
    """The experts each worker holds at once: ``--max-resident-experts``, else what the profile's
    copy and compute of an expert need (`Emulation.prefetch_depth`, the link's term of the depth)."""
    return args.max_resident_experts or emulation.prefetch_depth


def calibration_given(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, float] | None:
    """Where the expert compute time the emulation is scaled by comes from, and its seconds;
    None to measure it. A bad value is the parser's error."""
    if args.expert_compute_ms is not None:
        if not _positive(args.expert_compute_ms):
            parser.error(f"--expert-compute-ms must be a positive number of milliseconds, got {args.expert_compute_ms}")
        return "--expert-compute-ms", args.expert_compute_ms / 1e3
    if args.calibration is not None:
        try:
            return str(args.calibration), expert_compute_of(args.calibration)
        except ValueError as exc:
            parser.error(f"--calibration: {exc}")
    return None


def run_record(
    args: argparse.Namespace,
    emulation: Emulation,
    calibration: Calibration,
    pairs: list[tuple[int, int]],
    hybrid: list[str],
    exact: bool,
    results: dict[str, dict],
    predictions: dict[str, dict],
    codec: list[str] | None = None,
    decode: dict | None = None,
) -> dict:
    """What ``--json`` writes: the run's settings, its emulation and what scaled it, every strategy's figures."""
    return {
        "roles": roles.kind(args),
        "profile": args.profile,
        "emulation": emulation.as_dict(),
        "calibration": asdict(calibration),
        "pairs": pairs,
        "workers": args.workers,
        "max_resident_experts": prefetch_depth_of(args, emulation),
        "hybrid": hybrid,
        "codec": codec or [],
        "drafts": [f"auto{k}" if auto else str(k) for k, auto in getattr(args, "draft_values", [])],
        "codec_decode": decode,  # an expert's coded bytes and decode time here (sim_prediction.measure_decode)
        "notes": args.notes,
        "repeats": args.repeats,
        "exact": exact,
        "strategies": results,
        "sim_prediction": {
            kind: {k: v for k, v in prediction.items() if k != "inputs"} for kind, prediction in predictions.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    begun = provenance.begin()
    given, pairs = checked_settings(args, parser)
    strategies, hybrid, codec = checked_rows(args, parser)
    check_needed_files(args, parser, strategies)
    with tempfile.TemporaryDirectory(prefix="odmoe-strategies-") as tmp:
        model_dir, config, expert_bytes, emulation, calibration = calibrated_bench_model(
            args.model, Path(tmp), args.profile, given
        )
        prompts, expected = bench_prompts(model_dir, config, pairs, strategies, args.model)
        # The simulator's prediction of this run, made before it starts (nothing of the run goes in).
        # The workers compute their experts at this machine's own speed (only copies, links and the
        # host path are emulated), so the model gets the time measured now, whatever the scale.
        machine, measurement = measure_machine(
            config,
            calibration.measured_here_s,
            model_dir=model_dir,
            link_latency_s=emulation.link_latency_s,
            link_bytes_per_s=emulation.link_bytes_per_s,
        )
        decode = measure_decode(model_dir) if codec else None
        predict = functools.partial(
            predict_for_run,
            emulation.as_dict(),
            config,
            expert_bytes,
            workers=args.workers,
            model_dir=model_dir,
            prompts=[p for p, _ in prompts],
            outputs=expected,
            max_resident=prefetch_depth_of(args, emulation),
            machine=machine,
            measurement=measurement,
        )
        kinds = (("plain", strategies), ("hybrid", hybrid), ("codec", codec))
        predictions = predict_rows(predict, kinds, cache_experts=args.cache_experts, decode=decode)
        predictions.update(predict_drafted_rows(predict, args, model_dir, prompts, expected))
        predicted = predicted_by_row(predictions, "predicted_decode_tok_s")
        print(f"the simulator's prediction (decode tok/s): {predicted}", file=sys.stderr)
        deployments = deployments_of(args, strategies, hybrid, codec)
        rounds, exact = run_rounds(model_dir, deployments, emulation, prompts, expected, args, Path(tmp))
    results = aggregate_rounds(rounds)
    add_predictions(results, predictions)
    print_table(results, emulation, calibration, args, exact)
    print_layer_parts(results, machine, measurement, config["num_hidden_layers"])
    if "odmoe" in results:
        report_bounds(results, config, expert_bytes, emulation, args.workers)
    if args.json:
        record = run_record(args, emulation, calibration, pairs, hybrid, exact, results, predictions, codec, decode)
        provenance.write(
            args.json, record, begun, "torch", "transformers", depends_on=DEPENDS_ON
        )  # command, commit, start and end, machine
    if args.plots:
        plot_rates(args.plots, results, args.profile, len(pairs), args.repeats)
    return 0 if exact else 1


def checked_settings(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[tuple[str, float] | None, list[tuple[int, int]]]:
    """The run's settings checked: ``--repeats``, ``--max-resident-experts``, where the time scale
    comes from (`calibration_given`) and the length pairs. A bad value is the parser's error."""
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.max_resident_experts is not None and args.max_resident_experts < 1:
        parser.error(f"--max-resident-experts must be at least 1, got {args.max_resident_experts}")
    given = calibration_given(args, parser)
    try:
        pairs = parse_pairs(args.pairs)
    except ValueError as exc:
        parser.error(str(exc))
    return given, pairs


def checked_rows(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[str], list[str], list[str]]:
    """The strategies to run, and those to run again with hybrid execution and on coded experts;
    ``--drafts`` parsed into ``args.draft_values`` ((k, auto) each). A bad one is the parser's error."""
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = set(strategies) - set(RUNTIME_STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {', '.join(RUNTIME_STRATEGIES)}")
    hybrid = [s for s in args.hybrid.split(",") if s]
    if set(hybrid) - set(strategies):
        parser.error(f"--hybrid names strategies that are not run: {sorted(set(hybrid) - set(strategies))}")
    if "prerouter" in hybrid:
        parser.error("the prerouter streams experts from disk; hybrid execution needs them in host memory")
    codec = [s for s in args.codec.split(",") if s]
    try:
        args.draft_values = [(int(k.removeprefix("auto")), k.startswith("auto")) for k in args.drafts.split(",") if k]
    except ValueError:
        parser.error(f"--drafts takes comma-separated token counts (autoK: up to K), got {args.drafts!r}")
    if args.draft_values and ("odmoe" not in strategies or min(k for k, _ in args.draft_values) < 1):
        parser.error("--drafts needs odmoe among the strategies (its row is the one without drafts) and k >= 1")
    if set(codec) - set(strategies):
        parser.error(f"--codec names strategies that are not run: {sorted(set(codec) - set(strategies))}")
    return strategies, hybrid, codec


def check_needed_files(args: argparse.Namespace, parser: argparse.ArgumentParser, strategies: list[str]) -> None:
    """Refuse, before anything runs, an approximate strategy whose files the checkpoint lacks (on
    the random model only a similarity table can be made here)."""
    approximate = [s for s in strategies if not get_strategy(s).exact]
    for strategy in approximate:
        for needed, command in needed_files(strategy):
            if args.model is not None and not (args.model / needed).is_file():
                parser.error(f"{strategy} needs {args.model / needed}: run {command} {args.model}")
            if args.model is None and needed != SIMILARITY_FILE:  # only a similarity table is made here
                parser.error(f"{strategy} needs a trained {needed}: pass --model with one (platform/demo-model has it)")


def bench_prompts(
    model_dir: Path, config: dict, pairs: list[tuple[int, int]], strategies: list[str], model: Path | None
) -> tuple[list[tuple[list[int], int]], list[list[int]]]:
    """Each pair's prompt with its number of new tokens, and Transformers' greedy tokens for each
    (``expected``); on the random model (no ``model`` given) a similarity table first where a
    strategy substitutes experts."""
    prompts = [(prompt_of(n_in, config["vocab_size"], seed=i), n_out) for i, (n_in, n_out) in enumerate(pairs)]
    if any(get_strategy(s).substitutes for s in strategies) and model is None:
        # the random benchmark model: calibrated on random ids
        ids = prompt_of(1024, config["vocab_size"], seed=99)
        write_similarity(model_dir, calibrate(model_dir, ids), len(ids))
    expected = [reference_generate(model_dir, prompt, n) for prompt, n in prompts]
    return prompts, expected


def predict_rows(
    predict: Callable[..., dict], kinds: tuple[tuple[str, list[str]], ...], *, cache_experts: int, decode: dict | None
) -> dict[str, dict]:
    """The simulator's prediction of each kind of row that has strategies (``predict``: `predict_for_run`
    for this run): plain, with hybrid execution, on coded experts (``decode``: `measure_decode`)."""
    predictions: dict[str, dict] = {}
    for kind, names in kinds:
        if names:
            predictions[kind] = predict(
                strategies=names,
                cache_experts=cache_experts,
                hybrid=kind == "hybrid",
                codec=decode if kind == "codec" else None,
            )
    return predictions


def predict_drafted_rows(
    predict: Callable[..., dict],
    args: argparse.Namespace,
    model_dir: Path,
    prompts: list[tuple[list[int], int]],
    expected: list[list[int]],
) -> dict[str, dict]:
    """The simulator's prediction of each drafted odmoe row (``predict``: `predict_for_run` for this
    run), at the tokens per pass its shadow's drafts gave when measured first."""
    predictions: dict[str, dict] = {}
    for k, auto in args.draft_values:
        # The shadow's drafts measured first at k (roles in-process, nothing emulated), then predicted;
        # under auto at the agreement that measurement gives, up to k as main's tuner picks.
        before = measure_drafts(model_dir, args.shadow_dtype, k, prompts, expected)
        kind = f"drafts{'-auto' if auto else ''}{k}"
        predictions[kind] = predict(
            strategies=["odmoe"],
            drafts=(k, before["tokens_per_pass"]),
            draft_auto=auto,
            shadow_dtype=args.shadow_dtype,
        )
        predictions[kind]["drafts_before_run"] = {key: value for key, value in before.items() if key != "answers"}
    return predictions


def predicted_by_row(predictions: dict[str, dict], key: str) -> dict[str, float | None]:
    """Each row's figure ``key`` of the predictions of every kind, under the row's own name."""
    suffixes = {"hybrid": HYBRID, "codec": CODEC}
    return {
        name + (suffixes.get(kind) or (f"+{kind}" if kind.startswith("drafts") else "")): tok_s
        for kind, prediction in predictions.items()
        for name, tok_s in (prediction[key] or {}).items()
    }


def deployments_of(
    args: argparse.Namespace, strategies: list[str], hybrid: list[str], codec: list[str]
) -> list[Deployment]:
    """Every row's deployment, in the order each round runs them: the strategies, then hybrid, coded, drafted."""
    deployments = [deployment_for(s, args.workers) for s in strategies]
    deployments += [deployment_for(s, args.workers, hybrid=True) for s in hybrid]
    deployments += [deployment_for(s, args.workers, codec=True) for s in codec]
    deployments += [deployment_for("odmoe", args.workers, drafts=k, draft_auto=auto) for k, auto in args.draft_values]
    return deployments


def run_rounds(
    model_dir: Path,
    deployments: list[Deployment],
    emulation: Emulation,
    prompts: list[tuple[list[int], int]],
    expected: list[list[int]],
    args: argparse.Namespace,
    work_dir: Path,
) -> tuple[list[dict[str, dict]], bool]:
    """``--repeats`` interleaved rounds of every deployment: each round's ``{row: figures}``, and
    whether every exact strategy's tokens were Transformers' (an approximate one's are measured)."""
    rounds: list[dict[str, dict]] = []
    exact = True
    for round_number in range(1, args.repeats + 1):  # interleaved: drift of the machine falls on every strategy
        figures: dict[str, dict] = {}
        for deployment in deployments:
            name, strategy = deployment.label, deployment.strategy
            print(f"round {round_number}/{args.repeats}: {name}: {deployment.workers} worker(s)", file=sys.stderr)
            figures[name], outputs = run_strategy(model_dir, deployment, emulation, prompts, args, work_dir)
            figures[name]["approximate"] = not get_strategy(strategy).exact
            figures[name]["token_agreement"] = agreement(outputs, expected)
            if get_strategy(strategy).exact:  # an approximate strategy's tokens are its own: measured, not required
                exact &= outputs == expected
        rounds.append(figures)
    return rounds, exact


def add_predictions(results: dict[str, dict], predictions: dict[str, dict]) -> None:
    """Each row's figures get the simulator's predictions of it (``predicted_by_row``), with the
    tight-loop costs, and main's engine's where it predicted the row (``engine_driven``)."""
    predicted = predicted_by_row(predictions, "predicted_decode_tok_s")
    predicted_tight = predicted_by_row(predictions, "predicted_decode_tok_s_tight_loop_costs")
    driven = {
        f"odmoe+{kind}": prediction["engine_driven"]["predicted_decode_tok_s"]["odmoe"]
        for kind, prediction in predictions.items()
        if prediction.get("engine_driven")
    }
    for name, figures in results.items():
        figures["sim_predicted_decode_tok_s"] = predicted.get(name)
        figures["sim_predicted_decode_tok_s_tight_loop_costs"] = predicted_tight.get(name)
        figures["sim_engine_predicted_decode_tok_s"] = driven.get(name)


def report_bounds(
    results: dict[str, dict], config: dict, expert_bytes: int, emulation: Emulation, workers: int
) -> None:
    """odmoe's ceilings (``copy_bound``, ``split_bound`` with the share hybrid execution plans),
    printed with how near odmoe's rows came and added to odmoe's figures."""
    layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    bound = copy_bound(layers, top_k, workers, expert_bytes, emulation.copy_bytes_per_s)
    split = split_bound(
        layers, top_k, workers, expert_bytes, emulation.copy_bytes_per_s, emulation.host_memory_bytes_per_s
    )
    results["odmoe"]["copy_bound"] = bound
    results["odmoe"]["split_bound"] = split
    print(
        f"odmoe's copy-bound ceiling: {bound['tok_s']:.2f} tok/s (each worker copies "
        f"{bound['loads_per_worker_per_token']:g} experts per token at {bound['load_ms']:.1f} ms each); "
        f"odmoe reached {results['odmoe']['decode_tok_s'] / bound['tok_s']:.0%} of it"
    )
    reached = [
        f"{name} reached {results[name]['decode_tok_s'] / split['tok_s']:.0%} of it"
        for name in ("odmoe", "odmoe" + HYBRID)
        if name in results
    ]
    groups = placement(layers, config["num_local_experts"], top_k, workers).n_groups
    cpu_ms = split["cpu_ms"]  # the workers' CPU time also counts their arithmetic (hybrid.cpu_seconds)
    if emulation.host_flops:
        flops = expert_flops(config["hidden_size"], config["intermediate_size"], 1)
        cpu_ms = max(cpu_ms, flops / emulation.host_flops * 1000)
    share = predicted_share(split["copy_ms"], cpu_ms, groups)
    split["planned_share_ceiling"] = float(share)
    print(
        f"the copy + host-memory ceiling: {split['tok_s']:.2f} tok/s ({split['cpu_experts_per_token']:.1f} "
        f"of each token's experts on the workers' CPUs at {split['cpu_ms']:.1f} ms each, the rest copied at "
        f"{split['copy_ms']:.1f} ms; odmoe{HYBRID} plans up to {share} of each of its {groups} groups' decode "
        f"layers on the CPUs, as far as the tokens' periods shorten); {', '.join(reached)}"
    )


def plot_rates(plots: Path, results: dict[str, dict], profile: str, pairs: int, repeats: int) -> None:
    """strategies.png in ``plots``: each row's decode and end-to-end tok/s, bars side by side."""
    names = list(results)
    over_rounds = f", median of {repeats} rounds" if repeats > 1 else ""
    bar_plot(
        plots / "strategies.png",
        ["decode tok/s", "end-to-end tok/s"],
        {n: [results[n]["decode_tok_s"], results[n]["e2e_tok_s"]] for n in names},
        title=f"Strategies on the emulated {profile} profile (mean of {pairs} length pairs{over_rounds})",
        xlabel="",
        ylabel="tokens per second",
    )


if __name__ == "__main__":
    raise SystemExit(main())
