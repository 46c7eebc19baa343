"""Quality beside speed: what an approximate strategy costs in perplexity and tokens, and what it buys.

    python -m benchmarks.quality [--model platform/demo-model] [--strategies odmoe,lru-offload,importance,prerouter]
        [--thresholds 0.3] [--cache-experts 2] [--workers 8] [--profile 3090-pcie4-1gbe]
        [--ppl-tokens 512] [--held-out FILE] [--prompts 4] [--new-tokens 32] [--repeats 3]
        [--json OUT] [--plots DIR]

For each strategy (``importance`` once per ``--thresholds`` value, named ``importance@T``),
on one deployment shape (``--workers`` workers, ``--cache-experts`` experts per layer per
worker for the caching strategies, so every caching strategy has the same device budget):

- ``ppl``: perplexity on held-out text the model never trained on — the last share of the
  demo's corpus that ``train-demo`` holds out (``--ppl-tokens`` tokens, in windows of 256).
  The runtime serves generation, not scoring, so this is computed in one process with
  Transformers' model teacher-forced one token at a time, and for ``importance`` with its
  own rule applied to every decode step's routing (``inference.runtime.importance.substitute`` with
  main's view of the caches, ``ResidentExperts``, kept as main keeps it), for ``prerouter``
  with its heads routing every token and its recovery adapter on (``inference.runtime.prerouter``);
  exact strategies compute exactly the routed experts, so theirs is the model's own.
- ``token_agreement``: the share of greedy tokens, position by position, equal to exact
  odmoe's (Transformers' own) over ``--prompts`` prompts × ``--new-tokens`` tokens, served
  by the runtime: a local cluster with the profile's emulated copies and network.
- ``cache_hit_rate``: the share of decode expert slots (token × top-k) main counted as held by
  a worker when it served them (``importance``; ``None`` where main keeps no such view).
- ``late_experts_per_token``: decode experts computed that no prediction had named when main
  dispatched their layer (``prerouter``: none by construction); ``router_agreement``: the
  share of routed expert slots the model's own router would have chosen too (``prerouter``);
  ``disk_reads_per_token``: experts the workers read from disk (a ``hot`` store: prerouter).
- ``decode_tok_s``: the runtime's decode rate on the same runs (the median over the prompts,
  then over ``--repeats`` fresh clusters, with its spread). The repeats are interleaved (round
  r serves every strategy once before round r + 1 starts), so a drift in the machine's speed
  falls on every strategy alike, and ``decode_vs_BASELINE`` is each strategy's rate over
  ``--baseline``'s (lru-offload) round by round: the median with its spread.

Strategies that are not exact are marked ``approximate``. Printed: a Markdown table; written:
``--json`` as ``{"strategies": {NAME: {"ppl", "token_agreement", "cache_hit_rate",
"decode_tok_s", ...}}}`` and, with ``--plots``, ``quality_vs_speed.png``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import provenance, roles, substance
from benchmarks.plots import scatter_plot
from benchmarks.recall import choose_prompts
from benchmarks.strategies import DEFAULT_PROFILE, bench_model
from inference.modelio.model import expert_dims, experts_modules
from inference.policies.placement import placement
from inference.policies.strategies import (
    RUNTIME_STRATEGIES,
    dispatch_plan,
    expert_store_for,
    get_strategy,
    needed_files,
)
from inference.runtime.importance import ResidentExperts, load_similarity, substitute
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.prerouter import PreroutedModel, attach_lora, load_prerouter, prerouted_generate
from inference.runtime.spec import DeploymentSettings
from inference.sim.hardware import PROFILES
from inference.tools.reference import reference_generate

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

REPO = Path(__file__).resolve().parents[1]
WINDOW = 256


def parse_strategies(text: str, thresholds: list[float]) -> list[tuple[str, str, float]]:
    """(label, strategy, threshold) for each run: ``importance`` once per threshold."""
    runs = []
    for name in (part for part in text.split(",") if part):
        if name not in RUNTIME_STRATEGIES:
            raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(RUNTIME_STRATEGIES)}")
        if name == "importance":
            runs.extend((f"importance@{t:g}", name, t) for t in thresholds)
        elif name == "prerouter":
            runs.append((name, name, 0.0))
        else:
            runs.append((name, name, 0.0))
    if not runs:
        raise ValueError("name at least one strategy")
    return runs


def held_out_ids(model_dir: Path, tokens: int, text: Path | None = None) -> list[int]:
    """The first ``tokens`` of the demo corpus's held-out tail (what ``train-demo`` never trains
    on), or of ``text`` when one is given."""
    from inference.runtime.textstream import load_tokenizer
    from inference.tools.train_demo import DEFAULT_CORPUS, Recipe, _token_stream, corpus_texts

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer to read the held-out text with")
    if text is not None:
        held = tokenizer(text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    else:
        stream = _token_stream(tokenizer, corpus_texts(DEFAULT_CORPUS))
        held = stream[int(len(stream) * (1 - Recipe().validation_share)) :]
    if len(held) < tokens:
        raise ValueError(f"the held-out text has {len(held)} tokens, fewer than {tokens}")
    return [int(t) for t in held[:tokens]]


def perplexity(model_dir: Path, ids: list[int], strategy: str, threshold: float, args: argparse.Namespace) -> float:
    """Teacher-forced perplexity, one token at a time, with ``importance``'s rule where it applies."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto").eval()
    if get_strategy(strategy).routes_by_prediction:
        return _prerouted_perplexity(model, model_dir, ids)
    config = model.config
    plan = placement(config.num_hidden_layers, expert_dims(config)[0], config.num_experts_per_tok, args.workers)
    approximate = get_strategy(strategy).substitutes
    similarity = load_similarity(model_dir) if approximate else None
    held = ResidentExperts(args.cache_experts)
    step = {"n": 0}

    def rule(layer: int):
        def hook(_module, hook_args):
            hidden, index, weights = hook_args
            if step["n"] > 0:  # decode: the rule; step 0 of a window is its prefill, exact
                index, _ = substitute(index, weights, held.resident(layer), similarity[layer], threshold)
            real = sorted(set(index.reshape(-1).tolist()))
            assignment, _ = dispatch_plan(get_strategy(strategy), plan, step["n"], layer, real, None)
            for worker, experts in assignment.items():
                held.used(worker, layer, experts)
            return hidden, index, weights

        return hook

    handles = []
    if approximate:
        handles = [experts.register_forward_pre_hook(rule(i)) for i, experts in enumerate(experts_modules(model))]
    try:
        return _teacher_forced_perplexity(model, ids, lambda i: step.__setitem__("n", i))
    finally:
        for handle in handles:
            handle.remove()


def _prerouted_perplexity(model, model_dir: Path, ids: list[int]) -> float:
    """Teacher-forced perplexity with the prerouter's heads as the routing and its recovery adapter
    on (what the runtime's ``prerouter`` strategy computes)."""
    trained = load_prerouter(model_dir)
    attach_lora(model, trained.lora, trained.shape, like_base=True)
    run = PreroutedModel(model, trained.prerouter)
    try:
        return _teacher_forced_perplexity(model, ids, lambda i: run.reset() if i == 0 else None)
    finally:
        run.remove()


def _teacher_forced_perplexity(model, ids: list[int], before_token: Callable[[int], object]) -> float:
    """Perplexity of ``ids`` fed one token at a time in windows of ``WINDOW`` (each with a fresh
    cache); ``before_token(i)`` is told each token's position in its window first."""
    from transformers import DynamicCache

    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, WINDOW):
            window = ids[start : start + WINDOW + 1]
            cache = DynamicCache(config=model.config)
            for i in range(len(window) - 1):
                before_token(i)
                logits = model(input_ids=torch.tensor([[window[i]]]), cache=cache, use_cache=True).logits[0, -1]
                nll -= float(F.log_softmax(logits.float(), dim=-1)[window[i + 1]])
                count += 1
    return math.exp(nll / count)


def serve_once(model_dir: Path, strategy: str, threshold: float, prompts, emulation, args, work_dir: Path) -> list:
    """One fresh cluster of ``strategy``: the same warm-up, then every prompt once (its ``Done``s).

    The warm-up is the same every time, so an approximate strategy's caches start alike and it
    gives the same tokens in every repeat.
    """
    base = DeploymentSettings(
        strategy=strategy,
        cache_experts=args.cache_experts,
        importance_threshold=threshold,
        hot_experts=args.hot_experts,
    )
    options = ClusterOptions(
        workers=args.workers, settings=emulation.settings(base, networked=True), in_process=args.in_process
    )
    with LocalCluster(model_dir, options, work_dir=work_dir) as cluster:
        cluster.generate(prompts[0][:8], 4)  # first-call allocations in every process
        return [cluster.generate(prompt, args.new_tokens) for prompt in prompts]


def served(model_dir: Path, strategy: str, rounds: list[list], prompts, expected, args) -> dict:
    """Token agreement, cache hit rate, late experts and decode rate from ``rounds`` (one list of
    answers per repeat); the decode rate is the median over repeats of each repeat's median."""
    rates = [statistics.median(r.metrics["decode_tok_s"] for r in results) for results in rounds]
    answers = [[r.token_ids for r in results] for results in rounds]
    results = rounds[-1]
    same = total = 0
    for result, want in zip(results, expected, strict=True):
        same += sum(a == b for a, b in zip(result.token_ids, want, strict=False))
        total += max(len(result.token_ids), len(want))
    hits = [r.metrics["cache_hit_rate"] for r in results if r.metrics.get("cache_hit_rate") is not None]
    agreement = [r.metrics["router_agreement"] for r in results if r.metrics.get("router_agreement") is not None]
    tokens = sum(max(1, len(r.token_ids) - 1) for r in results)
    own_rule = None
    if get_strategy(strategy).routes_by_prediction:  # the runtime computes the strategy's own one-process rule
        own_rule = all(
            r.token_ids == prerouted_generate(model_dir, p, args.new_tokens)
            for r, p in zip(results, prompts, strict=True)
        )
    return {
        "token_agreement": same / total,
        "cache_hit_rate": statistics.fmean(hits) if hits else None,
        "substitutions_per_token": statistics.fmean(r.metrics["substitutions_per_token"] for r in results),
        "late_experts_per_token": sum(r.metrics["late_experts"] for r in results) / tokens,
        "router_agreement": statistics.fmean(agreement) if agreement else None,
        "disk_reads_per_token": sum(r.metrics["disk_reads"] for r in results) / tokens,
        "expert_store": expert_store_for(strategy),
        "tokens_of_its_own_rule": own_rule,
        "decode_tok_s": statistics.median(rates),
        "decode_tok_s_min": min(rates),
        "decode_tok_s_max": max(rates),
        "decode_tok_s_runs": rates,
        "same_tokens_every_repeat": all(a == answers[0] for a in answers),
    }


def add_ratios(results: dict[str, dict], baseline: str) -> None:
    """Each strategy's decode rate over ``baseline``'s, round by round (both measured in the same
    round, minutes apart): the median and spread of those ratios."""
    if baseline not in results:
        return
    base = results[baseline]["decode_tok_s_runs"]
    for figures in results.values():
        ratios = [rate / b for rate, b in zip(figures["decode_tok_s_runs"], base, strict=True)]
        figures[f"decode_vs_{baseline}"] = statistics.median(ratios)
        figures[f"decode_vs_{baseline}_min"] = min(ratios)
        figures[f"decode_vs_{baseline}_max"] = max(ratios)


def _ratio(figures: dict, baseline: str) -> str:
    key = f"decode_vs_{baseline}"
    if key not in figures:
        return "–"
    return f"{figures[key]:.2f} ({figures[key + '_min']:.2f}–{figures[key + '_max']:.2f})"


def build_parser() -> argparse.ArgumentParser:
    """The command line: the strategies and the deployment, what is scored and served, where it is written."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "platform" / "demo-model")
    parser.add_argument("--strategies", default="odmoe,lru-offload,importance")
    parser.add_argument("--thresholds", default="0.3", help="importance thresholds, comma-separated")
    parser.add_argument("--cache-experts", type=int, default=2)
    parser.add_argument(
        "--hot-experts", type=int, default=DeploymentSettings.hot_experts, help="prerouter: experts in RAM per worker"
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE)
    parser.add_argument("--ppl-tokens", type=int, default=512)
    parser.add_argument("--held-out", type=Path, help="a UTF-8 text file to score (default: the demo's held-out tail)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="fresh clusters per strategy for the decode rate")
    parser.add_argument("--baseline", default="lru-offload", help="decode rates are also given as ratios to this run")
    parser.add_argument("--json", type=Path)
    roles.add_argument(parser)
    parser.add_argument("--plots", type=Path, help="write quality_vs_speed.png here")
    return parser


def checked(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[tuple[str, str, float]], list[int]]:
    """The runs ``args`` name (``parse_strategies``) and the held-out ids to score; a bad value, a
    file a strategy needs and the model lacks, or a held-out text too short is the parser's error."""
    try:
        thresholds = [float(t) for t in args.thresholds.split(",") if t]
        runs = parse_strategies(args.strategies, thresholds)
        for needed, command in {n for _, strategy, _ in runs for n in needed_files(strategy)}:
            if not (args.model / needed).is_file():
                raise ValueError(f"{args.model / needed} is missing: run `{command} {args.model}`")
    except ValueError as exc:
        parser.error(str(exc))
    if args.ppl_tokens < 2 or args.prompts < 1 or args.new_tokens < 2 or args.workers < 1 or args.repeats < 1:
        parser.error(
            "--ppl-tokens >= 2, --prompts >= 1, --new-tokens >= 2, --workers >= 1, --repeats >= 1 are required"
        )
    try:
        ids = held_out_ids(args.model, args.ppl_tokens, args.held_out)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    return runs, ids


def scored(
    model_dir: Path, ids: list[int], runs: list[tuple[str, str, float]], args: argparse.Namespace
) -> dict[str, dict]:
    """Each run's kind and its perplexity on ``ids``, by label, each reported as it is scored."""
    results: dict[str, dict] = {}
    for label, strategy, threshold in runs:
        results[label] = {
            "strategy": strategy,
            "approximate": not get_strategy(strategy).exact,
            "importance_threshold": threshold if strategy == "importance" else None,
            "ppl": perplexity(model_dir, ids, strategy, threshold, args),
        }
        print(f"  {label}: ppl {results[label]['ppl']:.3f}", file=sys.stderr)
    return results


def interleaved_rounds(
    model_dir: Path, runs: list[tuple[str, str, float]], prompts, emulation, args: argparse.Namespace, tmp: Path
) -> dict[str, list[list]]:
    """Each run's answers, one list per repeat (``serve_once``), by label."""
    # Repeats are interleaved: each round serves every strategy once, so a drift in this
    # machine's speed over the minutes of a run falls on all of them alike.
    rounds: dict[str, list[list]] = {label: [] for label, _, _ in runs}
    for repeat in range(args.repeats):
        for label, strategy, threshold in runs:
            work_dir = tmp / label / f"run-{repeat}"
            rounds[label].append(serve_once(model_dir, strategy, threshold, prompts, emulation, args, work_dir))
        print(f"  round {repeat + 1} of {args.repeats} served", file=sys.stderr)
    return rounds


def measure(args: argparse.Namespace, runs: list[tuple[str, str, float]], ids: list[int]) -> dict[str, dict]:
    """Every run's figures, by label: its perplexity (``scored``), then what it served (``served``)."""
    with tempfile.TemporaryDirectory(prefix="odmoe-quality-") as tmp:
        model_dir, _, _, emulation = bench_model(args.model, Path(tmp), args.profile)
        prompts, _ = choose_prompts(model_dir, args.prompts)
        expected = [reference_generate(model_dir, p, args.new_tokens) for p in prompts]
        results = scored(model_dir, ids, runs, args)
        rounds = interleaved_rounds(model_dir, runs, prompts, emulation, args, Path(tmp))
        for label, strategy, _ in runs:
            results[label] |= served(model_dir, strategy, rounds[label], prompts, expected, args)
    return results


def print_table(results: dict[str, dict], args: argparse.Namespace) -> None:
    """The run's settings, then a Markdown row per run, perplexity against the first exact run's."""
    exact_ppl = next((f["ppl"] for f in results.values() if not f["approximate"]), None)
    print(
        f"{args.model.name}: {args.workers} workers, {args.cache_experts} cached experts per layer per worker, "
        f"emulated {args.profile}; perplexity on {args.ppl_tokens} held-out tokens; {args.prompts} prompts × "
        f"{args.new_tokens} greedy tokens; decode rate: median of {args.repeats} fresh clusters (min–max)\n"
    )
    print(
        "| strategy | | perplexity | vs exact | token agreement | cache hit rate | substitutions / token "
        f"| late experts / token | decode tok/s | ÷ {args.baseline} |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, f in results.items():
        versus = f"{f['ppl'] / exact_ppl - 1:+.1%}" if exact_ppl else "–"
        hit = "–" if f["cache_hit_rate"] is None else f"{f['cache_hit_rate']:.0%}"
        print(
            f"| {label} | {'approximate' if f['approximate'] else 'exact'} | {f['ppl']:.3f} | {versus} "
            f"| {f['token_agreement']:.1%} | {hit} | {f['substitutions_per_token']:.2f} "
            f"| {f['late_experts_per_token']:.2f} | {f['decode_tok_s']:.2f} "
            f"({f['decode_tok_s_min']:.2f}–{f['decode_tok_s_max']:.2f}) | {_ratio(f, args.baseline)} |"
        )


def write(args: argparse.Namespace, results: dict[str, dict], begun: dict) -> None:
    """The run's settings and every run's figures at ``--json``, when it was given, with their provenance."""
    if not args.json:
        return
    provenance.write(
        args.json,
        {
            "roles": roles.kind(args),
            "model": str(args.model),
            "profile": args.profile,
            "workers": args.workers,
            "cache_experts": args.cache_experts,
            "ppl_tokens": args.ppl_tokens,
            "prompts": args.prompts,
            "new_tokens": args.new_tokens,
            "strategies": results,
        },
        begun,
        "torch",
        "transformers",
        depends_on=DEPENDS_ON,
    )


def plot(args: argparse.Namespace, results: dict[str, dict]) -> None:
    """``quality_vs_speed.png`` in ``--plots``, when it was given: each run's perplexity against its decode rate."""
    if not args.plots:
        return
    scatter_plot(
        args.plots / "quality_vs_speed.png",
        {label: (f["decode_tok_s"], f["ppl"]) for label, f in results.items()},
        title=f"Perplexity against decode rate, emulated {args.profile}",
        xlabel="decode tok/s",
        ylabel="held-out perplexity (log scale)",
        log_y=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    begun = provenance.begin()
    runs, ids = checked(parser, args)
    results = measure(args, runs, ids)
    add_ratios(results, args.baseline)
    print_table(results, args)
    write(args, results, begun)
    plot(args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
