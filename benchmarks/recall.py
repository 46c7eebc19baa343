"""Routing recall of the shadow by precision, token period and KV period, and by output position.

    python -m benchmarks.recall [--model DIR] [--dtypes fp32,bf16,fp16,int8,nf4]
        [--token-periods 1,2,4,8] [--kv-periods 1,4,16,0] [--new-tokens 32]
        [--position-tokens 256] [--prompts 3] [--position-prompts 6] [--window 16] [--workers 2]
        [--json OUT] [--plots DIR]

Recall is the share of main's really-routed experts that the shadow named for that decode
step and layer. For each shadow precision one local cluster (main, shadow and workers as
processes on 127.0.0.1) is started and serves every measurement of that precision: the
alignment periods are changed between generations with ``set_alignment``, no restart.

1. The period sweep: every (token period, KV period) pair generates ``--new-tokens`` tokens
   from each prompt; recall is pooled over all decode steps and layers. A period of p
   re-aligns the shadow to main's token (resp. KV cache) at steps p, 2p, ...; 0 = never.
2. Recall by position: never aligned (periods 0, 0), ``--position-tokens`` tokens from each
   prompt; the per-step recall is averaged over prompts at each output position and, for
   the plot, smoothed with a centred moving window of ``--window`` tokens.

Printed: Markdown tables (recall per period pair with one column per precision, and the
never-aligned recall by quarter of the output). Written: ``--json`` (all figures, also the
unsmoothed per-position means) and, under ``--plots`` (default ``benchmarks/results``),
``recall_vs_position.png`` and ``recall_periods.png``. A progress line per cluster and per
combination goes to stderr.

Prompts: with a ``--model`` that ships a tokenizer, Python-documentation-like sentences
tokenized with it (the demo model was trained on Python's docs); without ``--model`` the
tiny random model of the tests is made in a temporary folder and fixed id prompts are used
(its routers are random, so its figures say little about a trained model's). Greedy decoding;
a generation may stop early at the end-of-text token, so later positions can average fewer
prompts. Without alignment a quantized shadow is exact until its own greedy token first
differs from main's (``first_miss_step`` in the JSON), then it routes a different text, so
the by-position curve is a mean of such divergences: more prompts make it smoother.

Run time: cluster start-up and ~0.85 s fixed cost per generation dominate short runs, so the
defaults are kept small to fit under 15 minutes on the 2-core development machine with the
demo model (13 min 47 s measured while other jobs shared the cores): 3 prompts x 32 tokens
per sweep point (16 points), 6 prompts x 256 tokens by position, five precisions, 2 workers.
Raise ``--prompts`` / ``--new-tokens`` for tighter sweep figures at a proportional cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks import provenance, substance
from benchmarks.plots import heatmaps, line_plot
from inference.constants import SHADOW_DTYPES
from inference.runtime.launcher import ClusterError, ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.runtime.textstream import load_tokenizer
from inference.tools.tiny import make_tiny

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

PROMPT_IDS = [
    [1, 5, 6, 7, 8],
    [1, 100, 200, 300],
    [1, 42, 43, 44],
    [1, 450, 3, 77, 9, 250, 18],
    [1, 7, 300, 12],
    [1, 64],
]
PROMPT_TEXTS = [
    "Dictionaries are indexed by keys, which can be any immutable type; strings and numbers can always be keys.",
    "This module provides access to the mathematical functions defined by the C standard.",
    "Return a new sorted list from the items in iterable. Has two optional arguments which must be",
    "The with statement is used to wrap the execution of a block with methods defined by a context manager.",
    "Raised when an operation or function is applied to an object of inappropriate type. The associated value",
    "This module provides a portable way of using operating system dependent functionality.",
]
DEFAULT_TOKEN_PERIODS = "1,2,4,8"
DEFAULT_KV_PERIODS = "1,4,16,0"
DEFAULT_PLOTS = Path(__file__).resolve().parent / "results"

StepRecalls = dict[int, float]  # decode step -> recall of that step (mean over layers)


# --- pure logic -----------------------------------------------------------------------------------


def parse_ints(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; blanks are skipped."""
    return [int(part) for part in text.split(",") if part.strip()]


def step_recalls(per_step: Iterable[Mapping]) -> StepRecalls:
    """The decode steps' recalls of one generation (``metrics["per_step"]``); prefill has none."""
    return {int(s["step"]): float(s["recall"]) for s in per_step if s["step"] > 0 and s["recall"] is not None}


def mean_by_position(runs: Sequence[StepRecalls]) -> tuple[list[int], list[float], list[int]]:
    """Per decode step, the mean recall over the runs that reached it.

    Returns (steps, means, counts), steps ascending; a run that stopped early (end of text)
    simply does not count at the steps it did not reach.
    """
    pooled: dict[int, list[float]] = {}
    for run in runs:
        for step, value in run.items():
            pooled.setdefault(step, []).append(value)
    steps = sorted(pooled)
    return steps, [statistics.fmean(pooled[s]) for s in steps], [len(pooled[s]) for s in steps]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Centred moving mean over ``window`` values, the window shrinking at both ends (same length out)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    before, after = (window - 1) // 2, window // 2
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - before) : i + after + 1]
        out.append(statistics.fmean(chunk))
    return out


def quarters(values: Sequence[float]) -> list[float]:
    """Mean of each quarter of ``values`` (in order; the last quarter takes any remainder)."""
    if not values:
        return []
    size = max(1, len(values) // 4)
    bounds = [(i * size, min(len(values), (i + 1) * size if i < 3 else len(values))) for i in range(4)]
    return [statistics.fmean(values[a:b]) for a, b in bounds if a < b]  # fewer than 4 values: one each


def summarize(runs: Sequence[StepRecalls]) -> dict:
    """Pooled recall of some generations, and its mean over the first and the last quarter of the steps."""
    _, means, counts = mean_by_position(runs)
    if not means:
        return {"recall": None, "first_quarter": None, "last_quarter": None, "generations": len(runs)}
    values = [v for run in runs for v in run.values()]
    parts = quarters(means)
    return {
        "recall": statistics.fmean(values),
        "first_quarter": parts[0],
        "last_quarter": parts[-1],
        "generations": len(runs),
        "decode_steps": sum(counts),
    }


def first_miss(run: StepRecalls) -> int | None:
    """The first decode step whose recall fell below 1 (typically where the shadow's own greedy
    token first differed from main's), None if every step was exact."""
    return next((step for step in sorted(run) if run[step] < 1.0), None)


def period_label(period: int) -> str:
    return "never" if period == 0 else str(period)


def percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.2%}"


def sweep_table(
    figures: Mapping[str, Mapping], token_periods: Sequence[int], kv_periods: Sequence[int], never_tokens: int
) -> str:
    """Markdown: one row per (token period, KV period), one column per shadow precision; the last row
    is the never-aligned run of ``never_tokens`` tokens (the by-position measurement)."""
    dtypes = list(figures)
    lines = [
        "| token period | KV period | " + " | ".join(dtypes) + " |",
        "|---:|---:|" + "---:|" * len(dtypes),
    ]
    for tp in token_periods:
        for kp in kv_periods:
            cells = [percent(sweep_entry(figures[d], tp, kp)["recall"]) for d in dtypes]
            lines.append(f"| {period_label(tp)} | {period_label(kp)} | " + " | ".join(cells) + " |")
    cells = [percent(figures[d]["position"]["recall"]) for d in dtypes]
    lines.append(f"| never | never ({never_tokens} tokens) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def position_table(figures: Mapping[str, Mapping]) -> str:
    """Markdown: never-aligned recall per precision, overall and by quarter of the output."""
    lines = [
        "| shadow | never aligned | 1st quarter | 2nd quarter | 3rd quarter | 4th quarter |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for dtype, by in figures.items():
        position = by["position"]
        parts = [percent(v) for v in position["quarters"]] + ["–"] * (4 - len(position["quarters"]))
        lines.append(f"| {dtype} | {percent(position['recall'])} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def sweep_entry(figure: Mapping, token_period: int, kv_period: int) -> Mapping:
    """The sweep figures of one (token period, KV period) pair of one precision."""
    for entry in figure["sweep"]:
        if entry["token_period"] == token_period and entry["kv_period"] == kv_period:
            return entry
    raise KeyError((token_period, kv_period))


# --- measuring ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    prompts: list[list[int]]  # the period sweep's
    position_prompts: list[list[int]]  # the never-aligned by-position runs'
    token_periods: list[int]
    kv_periods: list[int]
    new_tokens: int
    position_tokens: int
    workers: int


def generate_all(
    cluster: LocalCluster, prompts: Sequence[list[int]], new_tokens: int, periods: tuple[int, int]
) -> list[dict]:
    """Each prompt once at the given periods; the metrics of each generation."""
    cluster.set_alignment(*periods)
    metrics = []
    for prompt in prompts:
        done = cluster.generate(prompt, new_tokens)
        got = (done.metrics["token_period"], done.metrics["kv_period"])
        if got != periods:
            raise ClusterError(f"asked for alignment periods {periods}, the generation ran with {got}")
        metrics.append(done.metrics)
    return metrics


def measured(metrics: Sequence[Mapping]) -> dict:
    """Recall summary of some generations, with how often the shadow was re-aligned in them."""
    shadows = [m["shadow"] or {} for m in metrics]
    return {
        **summarize([step_recalls(m["per_step"]) for m in metrics]),
        "token_aligns": sum(s.get("token_aligns", 0) for s in shadows),
        "kv_aligns": sum(s.get("kv_aligns", 0) for s in shadows),
    }


def measure_dtype(model_dir: Path, dtype: str, plan: Plan, progress: Callable[[str], None]) -> dict:
    """The sweep and the by-position runs of one shadow precision, on one cluster."""
    grid = [(tp, kp) for tp in plan.token_periods for kp in plan.kv_periods]
    settings = DeploymentSettings(shadow_dtype=dtype)
    started = time.monotonic()
    progress(f"[{dtype}] starting a cluster: main, {dtype} shadow, {plan.workers} workers")
    sweep = []
    with LocalCluster(model_dir, ClusterOptions(workers=plan.workers, settings=settings)) as cluster:
        progress(f"[{dtype}] ready in {time.monotonic() - started:.0f} s")
        for i, (tp, kp) in enumerate(grid, 1):
            t0 = time.monotonic()
            summary = measured(generate_all(cluster, plan.prompts, plan.new_tokens, (tp, kp)))
            sweep.append({"token_period": tp, "kv_period": kp, **summary})
            progress(
                f"[{dtype}] {i}/{len(grid)} token period {period_label(tp)}, KV period {period_label(kp)}: "
                f"recall {percent(summary['recall'])} ({time.monotonic() - t0:.1f} s)"
            )
        t0 = time.monotonic()
        metrics = generate_all(cluster, plan.position_prompts, plan.position_tokens, (0, 0))
    runs = [step_recalls(m["per_step"]) for m in metrics]
    steps, means, counts = mean_by_position(runs)
    position = {
        **measured(metrics),
        "quarters": quarters(means),
        "steps": steps,
        "mean_recall": means,
        "generations_at_step": counts,
        "first_miss_step": [first_miss(run) for run in runs],
    }
    progress(
        f"[{dtype}] never aligned, {plan.position_tokens} tokens: recall {percent(position['recall'])} "
        f"({time.monotonic() - t0:.1f} s); {dtype} done in {time.monotonic() - started:.0f} s"
    )
    return {"sweep": sweep, "position": position}


# --- plots ----------------------------------------------------------------------------------------


def plot_position(figures: Mapping[str, Mapping], window: int, n_prompts: int, path: Path) -> Path:
    series = {}
    for dtype, by in figures.items():
        position = by["position"]
        # Step s produces output token s + 1: the first comes from prefill, which has no prediction.
        xs = [s + 1 for s in position["steps"]]
        series[dtype] = (xs, [100 * v for v in moving_average(position["mean_recall"], window)])
    return line_plot(
        path,
        series,
        title=f"Shadow recall by output position, never aligned\n"
        f"(mean over {n_prompts} prompts, moving average over {window} tokens)",
        xlabel="output token position",
        ylabel="recall (%)",
        ylim=(0, 102),
        legend_title=f"shadow ({window}-token average)",
    )


def plot_periods(
    figures: Mapping[str, Mapping], token_periods: Sequence[int], kv_periods: Sequence[int], path: Path
) -> Path:
    panels = {
        dtype: [[100 * (sweep_entry(by, tp, kp)["recall"] or 0.0) for kp in kv_periods] for tp in token_periods]
        for dtype, by in figures.items()
    }
    lowest = min((v for matrix in panels.values() for row in matrix for v in row), default=0.0)
    return heatmaps(
        path,
        panels,
        row_labels=[period_label(p) for p in token_periods],
        col_labels=[period_label(p) for p in kv_periods],
        title="Shadow recall (%) by alignment periods, per shadow precision",
        row_title="token period",
        col_title="KV period",
        vmin=min(90.0, 10 * (lowest // 10)),
        vmax=100.0,
        fmt="{:.1f}",
        colorbar_label="recall (%)",
    )


# --- command line ---------------------------------------------------------------------------------


def choose_prompts(model: Path | None, count: int) -> tuple[list[list[int]], list[str] | None]:
    """Token ids of the prompts, and their texts when they were tokenized (see the module docstring)."""
    tokenizer = load_tokenizer(model) if model is not None else None
    if tokenizer is None:
        return [list(p) for p in PROMPT_IDS[:count]], None
    texts = PROMPT_TEXTS[:count]
    return [tokenizer(text)["input_ids"] for text in texts], texts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: a tiny random Mixtral)")
    parser.add_argument("--dtypes", default=",".join(SHADOW_DTYPES), help="shadow precisions, comma-separated")
    parser.add_argument("--token-periods", default=DEFAULT_TOKEN_PERIODS, help="0 = never align the token")
    parser.add_argument("--kv-periods", default=DEFAULT_KV_PERIODS, help="0 = never align the KV cache")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per generation in the period sweep")
    parser.add_argument("--position-tokens", type=int, default=256, help="tokens per never-aligned generation")
    parser.add_argument("--prompts", type=int, default=3, help="how many built-in prompts the period sweep uses")
    parser.add_argument(
        "--position-prompts", type=int, default=6, help="how many built-in prompts the by-position runs use"
    )
    parser.add_argument("--window", type=int, default=16, help="moving-average window of the position plot")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--plots", type=Path, default=DEFAULT_PLOTS, help="folder for the PNGs")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    begun = provenance.begin()
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = set(dtypes) - set(SHADOW_DTYPES)
    if unknown:
        parser.error(f"unknown shadow dtypes {sorted(unknown)}; choose from {', '.join(SHADOW_DTYPES)}")
    try:
        token_periods, kv_periods = parse_ints(args.token_periods), parse_ints(args.kv_periods)
    except ValueError as exc:
        parser.error(f"periods are comma-separated integers: {exc}")
    if min(token_periods + kv_periods, default=0) < 0 or not token_periods or not kv_periods:
        parser.error("give at least one token and one KV period, each >= 0 (0 = never)")
    if min(args.new_tokens, args.position_tokens) < 2:
        parser.error("--new-tokens and --position-tokens must be >= 2 (the first token has no prediction)")
    if args.window < 1:
        parser.error("--window must be >= 1")
    for name, value in (("--prompts", args.prompts), ("--position-prompts", args.position_prompts)):
        if not 1 <= value <= len(PROMPT_TEXTS):
            parser.error(f"{name} must be between 1 and {len(PROMPT_TEXTS)}")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    all_prompts, texts = choose_prompts(args.model, max(args.prompts, args.position_prompts))
    prompts, position_prompts = all_prompts[: args.prompts], all_prompts[: args.position_prompts]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="odmoe-recall-") as tmp:
        model_dir = args.model or make_tiny(Path(tmp) / "model", seed=0)
        plan = Plan(
            prompts, position_prompts, token_periods, kv_periods, args.new_tokens, args.position_tokens, args.workers
        )
        figures = {dtype: measure_dtype(model_dir, dtype, plan, progress) for dtype in dtypes}
    seconds = time.monotonic() - started

    model_name = str(args.model) if args.model else "tiny random Mixtral (make-tiny, seed 0)"
    print(
        f"model: {model_name}; greedy, {args.workers} workers; period sweep: {len(prompts)} prompts x "
        f"{args.new_tokens} new tokens; never aligned: {len(position_prompts)} prompts x {args.position_tokens}"
    )
    print()
    print(sweep_table(figures, token_periods, kv_periods, args.position_tokens))
    print()
    print(position_table(figures))
    print()
    print(f"measured in {seconds:.0f} s")
    written = [
        plot_position(figures, args.window, len(position_prompts), args.plots / "recall_vs_position.png"),
        plot_periods(figures, token_periods, kv_periods, args.plots / "recall_periods.png"),
    ]
    plots = [path.name for path in written]
    progress("plots: " + ", ".join(str(path) for path in written))
    if args.json:
        record = {
            "model": model_name,
            "prompts": texts if texts is not None else all_prompts,
            "prompt_ids": all_prompts,
            "sweep_prompts": args.prompts,
            "position_prompts": args.position_prompts,
            "workers": args.workers,
            "new_tokens": args.new_tokens,
            "position_tokens": args.position_tokens,
            "window": args.window,
            "token_periods": token_periods,
            "kv_periods": kv_periods,
            "seconds": round(seconds, 1),
            "plots": plots,
            "dtypes": figures,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        provenance.write(args.json, record, begun, "torch", "transformers", depends_on=DEPENDS_ON)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
