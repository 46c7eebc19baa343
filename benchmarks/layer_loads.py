"""A worker's decode layer on fine-grained experts: loaded one by one, or as one batch.

    python -m benchmarks.layer_loads [--experts-per-layer 2 8] [--layers 400] [--repeats 3] [--json OUT]

What a worker does for each decode layer, in one process and without messages: the layer's
experts are predicted (prefetched) 1 ms before main's request arrives (main's attention), then
each is acquired, computed on one token's row and released, as ``WorkerRole._compute`` does.
It is timed for each number of experts a worker gets per layer (2: Mixtral's top-2 on one
worker; 8: Qwen3-30B-A3B's or OLMoE's top-8), with the loader's slots at the default 2 and at
the layer's experts + 1, each with the layer's experts loaded as one batch and one by one
(``ExpertLoader(batch_loads=False)``), all in the same run, round-robin over ``--repeats``
rounds so every variant sees the same machine. The experts are a random Qwen3-MoE-shaped
expert (hidden 2048, width 768, bf16: 9.4 MB) scaled down to hidden 64 and width 32 so the
figure is the per-expert handling (locks, thread hand-offs, the compute's launch), not the
copy or GEMV bandwidth, which a CPU copy does not measure anyway. Report: median time per
layer (ms) over every layer of every round, and the spread of the rounds' medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import provenance
from inference.runtime.experts import ExpertWeights, expert_forward
from inference.runtime.loader import ExpertLoader

# What its figures depend on beyond its own imports (benchmarks.substance): nothing, it runs in one process.
DEPENDS_ON: tuple[str, ...] = ()

HIDDEN, WIDTH, EXPERTS = 64, 32, 64
MAIN_BETWEEN_LAYERS_S = 0.001  # a layer's attention on main, while the prefetches run


class _Store:
    def __init__(self, layers: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.weights = {
            (layer, e): ExpertWeights(
                torch.randn(2 * WIDTH, HIDDEN, generator=g), torch.randn(HIDDEN, WIDTH, generator=g)
            )
            for layer in range(layers)
            for e in range(EXPERTS)
        }

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self.weights[(layer, expert)]


def layer_times(store: _Store, per_layer: int, slots: int, batched: bool, layers: int) -> tuple[list[float], float]:
    """Per-layer times (ms) of ``layers`` decode layers, and the experts copied per copy pass."""
    loader = ExpertLoader(store, torch.device("cpu"), max_resident=slots, batch_loads=batched)
    row, weight = torch.randn(1, HIDDEN), torch.ones(1)
    times: list[float] = []
    try:
        for step in range(1, layers + 1):
            layer = step % 4
            first = (step * 7) % (EXPERTS - per_layer)
            keys = [(step, layer, e) for e in range(first, first + per_layer)]
            for key in keys:
                loader.prefetch(key)
            time.sleep(MAIN_BETWEEN_LAYERS_S)
            start = time.perf_counter()
            for key in keys:
                resident, _, _ = loader.acquire(key)
                expert_forward(row, weight, resident.weights, F.silu)
                loader.release(key)
            times.append((time.perf_counter() - start) * 1000)
        per_pass = loader.stats.loads / max(1, loader.stats.batches)
    finally:
        loader.close()
    return times, per_pass


def measure(per_layer_counts: list[int], layers: int, repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    store = _Store(4)
    variants = [
        (k, slots, batched) for k in per_layer_counts for slots in sorted({2, k + 1}) for batched in (True, False)
    ]
    samples: dict[tuple[int, int, bool], list[float]] = {v: [] for v in variants}
    rounds: dict[tuple[int, int, bool], list[float]] = {v: [] for v in variants}
    passes: dict[tuple[int, int, bool], float] = {}
    for _ in range(repeats):
        for variant in variants:  # round-robin: every variant once per round
            times, per_pass = layer_times(store, *variant, layers)
            samples[variant] += times
            rounds[variant].append(statistics.median(times))
            passes[variant] = per_pass
    return [
        {
            "experts_per_layer": k,
            "slots": slots,
            "batched": batched,
            "layer_ms_median": statistics.median(samples[(k, slots, batched)]),
            "round_medians_ms": rounds[(k, slots, batched)],
            "experts_per_copy_pass": passes[(k, slots, batched)],
        }
        for k, slots, batched in variants
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--experts-per-layer", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--layers", type=int, default=400, help="decode layers per variant and round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every variant")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    begun = provenance.begin()
    if min(args.experts_per_layer) < 1 or max(args.experts_per_layer) >= EXPERTS or args.layers < 1:
        parser.error(f"--experts-per-layer must be from 1 to {EXPERTS - 1} and --layers >= 1")
    rows = measure(args.experts_per_layer, args.layers, args.repeats)
    print(
        "| experts a layer | loader slots | loads | per layer, median (ms) | rounds' medians (ms) "
        "| experts per copy pass |"
    )
    print("|---:|---:|---|---:|---|---:|")
    for r in rows:
        spread = " / ".join(f"{m:.3f}" for m in r["round_medians_ms"])
        mode = "one batch" if r["batched"] else "one by one"
        print(
            f"| {r['experts_per_layer']} | {r['slots']} | {mode} | {r['layer_ms_median']:.3f} | {spread} | "
            f"{r['experts_per_copy_pass']:.2f} |"
        )
    if args.json:
        provenance.write(
            args.json,
            {"layers": args.layers, "repeats": args.repeats, "rows": rows},
            begun,
            "torch",
            depends_on=DEPENDS_ON,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
