"""Decode speed of the distributed runtime next to single-process Transformers, in one run.

    python -m benchmarks.decode [--model DIR] [--workers 8] [--new-tokens 64] [--json OUT]

Both run greedy decoding of the same prompts on the same checkpoint on this machine:
Transformers in one process with every expert resident (the *full cache* ceiling), and
odmoe with main, shadow and N workers as separate processes on 127.0.0.1, experts loaded
on demand — once with the shadow speculating one step ahead on its own guess of main's
token, once with the shadow waiting for main's token every step (the paper's scheme).
Printed: TTFT, decode tok/s, their ratio, and per decode layer the median of
main's expert round trip, of the busiest worker's load wait + compute, and of what is left:
the coordination overhead (message hops + scheduling). Without ``--model`` a small random
Mixtral is made in a temporary folder (``--size``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import provenance, substance
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.tools.reference import reference_generate
from inference.tools.tiny import make_tiny

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

SIZES = {
    # name: make_tiny shape. "small" keeps expert compute visible next to message hops.
    "tiny": dict(layers=4, hidden=64, intermediate=128),
    "small": dict(layers=8, hidden=512, intermediate=1792, heads=8, kv_heads=4),
}
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 100, 200, 300, 17, 23], [1, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


class _Clock:
    """A streamer that timestamps every token ``generate`` emits."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def run_transformers(model_dir: Path, new_tokens: int) -> dict:
    torch.set_num_threads(1)  # as each odmoe role: one compute stream per box
    reference_generate(model_dir, PROMPTS[0], 4)  # warm-up, as for odmoe
    ttfts, rates, outputs = [], [], []
    for prompt in PROMPTS:
        clock = _Clock()
        started = time.perf_counter()
        outputs.append(reference_generate(model_dir, prompt, new_tokens, streamer=clock))
        ttfts.append((clock.times[0] - started) * 1000)
        rates.append((len(clock.times) - 1) / (clock.times[-1] - clock.times[0]))
    return {"ttft_ms": statistics.median(ttfts), "decode_tok_s": statistics.median(rates), "outputs": outputs}


def run_odmoe(model_dir: Path, new_tokens: int, workers: int, shadow_dtype: str, speculate: bool = True) -> dict:
    options = ClusterOptions(
        workers=workers, settings=DeploymentSettings(shadow_dtype=shadow_dtype, speculate=speculate)
    )
    with LocalCluster(model_dir, options) as cluster:
        cluster.generate(PROMPTS[0], 4)  # warm-up: first-call allocations in every process
        results = [cluster.generate(prompt, new_tokens) for prompt in PROMPTS]
    metrics = [r.metrics for r in results]

    def median(key: str) -> float:
        return statistics.median(m[key] for m in metrics if m[key] is not None)

    return {
        "ttft_ms": median("ttft_ms"),
        "decode_tok_s": median("decode_tok_s"),
        "recall": median("recall"),
        "prediction_in_time": median("prediction_in_time"),
        "layer_round_trip_ms": median("decode_layer_dispatch_ms_median"),
        "layer_worker_ms": median("decode_layer_worker_ms_median"),
        "layer_coordination_ms": median("decode_layer_coordination_ms_median"),
        "peak_expert_bytes_per_worker": max(max(m["worker_peak_expert_bytes"].values()) for m in metrics),
        "expert_bytes": metrics[0]["expert_bytes"],
        "outputs": [r.token_ids for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Mixtral checkpoint directory (default: make one)")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--shadow-dtype", default="fp32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    begun = provenance.begin()
    with tempfile.TemporaryDirectory(prefix="odmoe-bench-") as tmp:
        model_dir = args.model or make_tiny(Path(tmp) / "model", seed=0, **SIZES[args.size])
        reference = run_transformers(model_dir, args.new_tokens)
        runs = {
            "speculating shadow": run_odmoe(model_dir, args.new_tokens, args.workers, args.shadow_dtype, True),
            "shadow waits for main (paper)": run_odmoe(
                model_dir, args.new_tokens, args.workers, args.shadow_dtype, False
            ),
        }
    expected = reference.pop("outputs")
    exact = all(run.pop("outputs") == expected for run in runs.values())
    print(
        f"model: {args.model or args.size + ' random Mixtral'}; {len(PROMPTS)} prompts x {args.new_tokens} "
        f"new tokens, greedy; {torch.get_num_threads()} CPU threads per process; {args.workers} workers; "
        f"{args.shadow_dtype} shadow aligned every step"
    )
    print()
    print("| runtime | TTFT (ms) | decode tok/s | ratio to full cache | predictions in time |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| Transformers, 1 process, all experts resident | {reference['ttft_ms']:.1f} | "
        f"{reference['decode_tok_s']:.1f} | 1.00 | |"
    )
    for name, run in runs.items():
        run["ratio"] = run["decode_tok_s"] / reference["decode_tok_s"]
        print(
            f"| odmoe, {name}: main + shadow + {args.workers} workers (loopback) | {run['ttft_ms']:.1f} | "
            f"{run['decode_tok_s']:.1f} | {run['ratio']:.2f} | {run['prediction_in_time']:.0%} |"
        )
    print()
    for name, run in runs.items():
        print(
            f"{name}, per decode layer (median): expert round trip {run['layer_round_trip_ms']:.3f} ms = busiest "
            f"worker (load wait + compute) {run['layer_worker_ms']:.3f} ms + coordination (hops + scheduling) "
            f"{run['layer_coordination_ms']:.3f} ms; recall {run['recall']:.1%}; peak expert bytes per worker "
            f"{run['peak_expert_bytes_per_worker']:,} (one expert = {run['expert_bytes']:,})"
        )
    print(f"output token-identical to Transformers: {exact}")
    if args.json:
        figures = {"transformers": reference, "odmoe": runs, "exact": exact, "workers": args.workers}
        provenance.write(args.json, figures, begun, "torch", "transformers", depends_on=DEPENDS_ON)
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
