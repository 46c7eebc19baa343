"""odmoe's predictors side by side: recall, lead, the memory they cost and the decode rate they give.

    python -m benchmarks.predictors [--model platform/demo-model] [--profile 3090-pcie4-1gbe]
        [--workers 8] [--predictors shadow:fp32,shadow:int8,shadow:nf4,next-gate,prerouter] [--prompts 4]
        [--new-tokens 32] [--json OUT]

Each predictor names the experts odmoe's workers load ahead (``DeploymentSettings.predictor``):

- ``shadow:DTYPE``: the shadow model in that precision, on a node of its own, running ahead of
  main (aligned to main's token and KV cache every step, the defaults);
- ``next-gate``: main applies the next layer's router to the current layer's input, the free
  baseline of Mixtral-Offloading's speculative prefetch: no node, no weights beyond main's;
- ``prerouter``: main's trained heads (``inference.runtime.prerouter``, ``train-prerouter``), used here
  only as a prediction: no node, the heads' weights on main.

For each, one odmoe cluster (``--workers`` workers, the emulated profile's copy and network
speeds as in ``benchmarks.strategies``) greedily generates ``--new-tokens`` tokens from each of
``--prompts`` prompts (Python-documentation sentences through the model's tokenizer, as
``benchmarks.recall``). Measured: recall (the share of really-routed experts the prediction
named), the share of decode layers whose prediction reached main before it served the layer,
the lead (how many layers ahead of the sequence a prediction arrived: median), and the decode
rate (median over the prompts). The predictor's memory is what it adds to the cluster: the
shadow node's GPU need from ``inference.building.memory`` (its model and KV cache), nothing for
``next-gate`` (the routers are main's), the heads' bytes for ``prerouter``. Every output is
checked against Transformers: a predictor only decides what is loaded ahead, never what is computed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import provenance, roles, substance
from benchmarks.recall import choose_prompts
from benchmarks.strategies import DEFAULT_PROFILE, bench_model, yield_cpu_to_the_pipeline
from inference.building.memory import memory_from_checkpoint
from inference.constants import SHADOW_DTYPES
from inference.policies.strategies import PREDICTORS
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.prerouter import load_prerouter
from inference.runtime.spec import DeploymentSettings
from inference.sim.hardware import PROFILES
from inference.tools.reference import reference_generate

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PREDICTORS = "shadow:fp32,shadow:int8,shadow:nf4,next-gate,prerouter"


def parse_predictors(text: str) -> list[tuple[str, str | None]]:
    """``shadow:int8,next-gate`` -> [("shadow", "int8"), ("next-gate", None)]."""
    chosen: list[tuple[str, str | None]] = []
    for item in (part for part in text.split(",") if part):
        name, _, dtype = item.partition(":")
        if name not in PREDICTORS:
            raise ValueError(f"unknown predictor {name!r}; choose from {', '.join(PREDICTORS)}")
        if name == "shadow" and dtype not in SHADOW_DTYPES:
            raise ValueError(f"a shadow predictor names its precision, one of {', '.join(SHADOW_DTYPES)}: {item!r}")
        if name != "shadow" and dtype:
            raise ValueError(f"only the shadow takes a precision: {item!r}")
        chosen.append((name, dtype or None))
    if not chosen:
        raise ValueError("name at least one predictor")
    return chosen


def label(name: str, dtype: str | None) -> str:
    return f"{name}:{dtype}" if dtype else name


def measure(
    model_dir: Path, name: str, dtype: str | None, prompts: list[list[int]], args: argparse.Namespace, emulation, tmp
) -> tuple[dict, bool]:
    base = DeploymentSettings(strategy="odmoe", predictor=name, shadow_dtype=dtype or "fp32")
    options = ClusterOptions(
        workers=args.workers, settings=emulation.settings(base, networked=True), in_process=args.in_process
    )
    with LocalCluster(model_dir, options, work_dir=Path(tmp) / label(name, dtype).replace(":", "-")) as cluster:
        if "shadow" in cluster.processes:
            yield_cpu_to_the_pipeline(cluster.processes["shadow"].pid)
        cluster.generate(prompts[0][:8], 4)  # warm-up: first-call allocations in every process
        results = [cluster.generate(prompt, args.new_tokens) for prompt in prompts]
    exact = all(
        r.token_ids == reference_generate(model_dir, p, args.new_tokens) for r, p in zip(results, prompts, strict=True)
    )
    metrics = [r.metrics for r in results]
    leads = [m["prediction_lead_layers"] for m in metrics if m["prediction_lead_layers"] is not None]
    memory = 0
    if name == "shadow":
        settings = DeploymentSettings(shadow_dtype=dtype or "fp32", max_batch=1)
        plan = memory_from_checkpoint(model_dir, workers=args.workers, settings=settings)
        memory = plan.shadow.gpu_bytes
    elif name == "prerouter":
        heads = load_prerouter(model_dir).prerouter
        memory = sum(p.numel() * p.element_size() for p in heads.parameters())
    return {
        "recall": statistics.fmean(m["recall"] for m in metrics),
        "prediction_in_time": statistics.fmean(m["prediction_in_time"] for m in metrics),
        "lead_layers": statistics.median(leads) if leads else None,
        "decode_tok_s": statistics.median(m["decode_tok_s"] for m in metrics),
        "decode_tok_s_runs": [m["decode_tok_s"] for m in metrics],
        "predictor_gpu_bytes": memory,
        "nodes": 2 + args.workers if name == "shadow" else 1 + args.workers,
    }, exact


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "platform" / "demo-model")
    parser.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--predictors", default=DEFAULT_PREDICTORS)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    roles.add_argument(parser)
    args = parser.parse_args(argv)
    begun = provenance.begin()
    try:
        chosen = parse_predictors(args.predictors)
        if any(name == "prerouter" for name, _ in chosen):
            load_prerouter(args.model)  # before any cluster starts: a clear error if it was never trained
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    if args.workers < 1 or args.prompts < 1 or args.new_tokens < 2:
        parser.error("--workers >= 1, --prompts >= 1 and --new-tokens >= 2 are required")
    results: dict[str, dict] = {}
    exact = True
    with tempfile.TemporaryDirectory(prefix="odmoe-predictors-") as tmp:
        model_dir, _, _, emulation = bench_model(args.model, Path(tmp), args.profile)
        prompts, _ = choose_prompts(model_dir, args.prompts)
        for name, dtype in chosen:
            figures, same = measure(model_dir, name, dtype, prompts, args, emulation, tmp)
            results[label(name, dtype)] = figures
            exact &= same
            print(f"  {label(name, dtype)}: recall {figures['recall']:.3f}", file=sys.stderr)
    print(
        f"odmoe on {model_dir.name}, {args.workers} workers, emulated {args.profile}; {args.prompts} prompts × "
        f"{args.new_tokens} tokens, greedy\n"
    )
    print("| predictor | recall | in time | lead (layers) | decode tok/s | predictor GPU memory | nodes |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, f in results.items():
        lead = "–" if f["lead_layers"] is None else f"{f['lead_layers']:g}"
        print(
            f"| {name} | {f['recall']:.3f} | {f['prediction_in_time']:.0%} | {lead} | {f['decode_tok_s']:.2f} "
            f"| {f['predictor_gpu_bytes'] / 1e9:.2f} GB | {f['nodes']} |"
        )
    print(f"\nevery output token-identical to Transformers: {exact}")
    roles.write_emulated(
        args,
        emulation,
        {
            "model": str(args.model),
            "prompts": args.prompts,
            "new_tokens": args.new_tokens,
            "exact": exact,
            "predictors": results,
        },
        begun,
        DEPENDS_ON,
    )
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
