"""Main's peak memory per added sequence, on a bf16 checkpoint of 1.1 GB.

    python -m benchmarks.main_memory [--sequences 1,2,4,8] [--prompt-len 256] [--new-tokens 32]
        [--workers 4] [--repeats 1] [--model DIR] [--json OUT]

For each sequence count N, a fresh cluster (main and ``--workers`` workers, no shadow, so the
machine's two cores go to the roles measured) serves N different prompts sent at the same
moment, each of ``--prompt-len`` tokens generating ``--new-tokens``. Main's peak resident set
(``VmHWM``) is read once the answers are in, beside its resident set when it reported ready:
the growth is what serving N sequences at once costs main (their KV caches, the activations of
their steps, what the engine keeps per sequence). The cost per added sequence is the
least-squares slope of the peak over N; the KV cache a sequence fills is printed beside it.
A fresh cluster per N, because a process's peak never comes down.

The checkpoint (6 layers, hidden 1024, 8 experts of width 3584, 8 query and 4 key-value
heads, bf16) is the one ``tests/inference/runtime/test_role_memory.py`` checks each role's bound on; it is made
in a temporary directory unless ``--model`` names one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import provenance, substance
from inference.runtime.client import RuntimeClient
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.tools.tiny import make_tiny

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

SHAPE = dict(layers=6, hidden=1024, intermediate=3584, experts=8, heads=8, kv_heads=4, shards=4)
MAX_POSITION = 2048


def status_bytes(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` memory field (``VmHWM``, ``VmRSS``) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for process {pid}")


def prompts_for(count: int, length: int, vocab: int) -> list[list[int]]:
    """``count`` different prompts of ``length`` token ids (ids 3 and up: past the special ones)."""
    return [[3 + (i * 7 + j * 13 + i * j) % (vocab - 3) for j in range(length)] for i in range(count)]


def serve_at_once(cluster: LocalCluster, prompts: list[list[int]], new_tokens: int) -> float:
    """Send every prompt at the same moment, one client each; the seconds until the last answer."""
    start = threading.Barrier(len(prompts))
    errors: list[str] = []

    def one(prompt: list[int]) -> None:
        client = RuntimeClient(cluster.addresses.main, cluster.deployment, curve=cluster.client_keys())
        try:
            start.wait()
            done = client.generate(prompt, new_tokens, timeout_s=1200)
            if len(done.token_ids) < 1:
                errors.append("an answer without tokens")
        except Exception as exc:  # reported below: the run counts as failed
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(prompts)} generations failed: {errors[0]}")
    return time.perf_counter() - began


def measure(model: Path, sequences: int, args: argparse.Namespace, work: Path) -> dict:
    """One fresh cluster serving ``sequences`` prompts at once: main's memory before and at its peak."""
    config = json.loads((model / "config.json").read_text())
    # A fresh process: main forked from a zygote would count the zygote's imported pages as its own.
    options = ClusterOptions(workers=args.workers, shadow=False, startup_timeout_s=900, spawn="exec")
    settings = options.settings
    if sequences > settings.max_batch:
        raise SystemExit(f"--sequences {sequences} is above main's batch ({settings.max_batch})")
    with LocalCluster(model, options, work_dir=work) as cluster:
        pid = cluster.processes["main"].pid
        ready_rss, ready_peak = status_bytes(pid, "VmRSS"), status_bytes(pid, "VmHWM")
        prompts = prompts_for(sequences, args.prompt_len, config["vocab_size"])
        seconds = serve_at_once(cluster, prompts, args.new_tokens)
        peak = status_bytes(pid, "VmHWM")
    return {
        "sequences": sequences,
        "main_ready_rss_bytes": ready_rss,
        "main_ready_peak_bytes": ready_peak,
        "main_peak_bytes": peak,
        "main_growth_bytes": peak - ready_rss,
        "seconds": seconds,
    }


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def kv_bytes_per_sequence(config: dict, tokens: int) -> int:
    """Bytes of main's KV cache for one sequence of ``tokens`` positions (keys and values, every layer)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    element = 2 if config.get("torch_dtype", config.get("dtype")) in ("bfloat16", "float16") else 4
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * element * tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", default="1,2,4,8", help="sequence counts, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="runs per sequence count (a fresh cluster each)")
    parser.add_argument("--model", type=Path, help="a bf16 checkpoint to use instead of the generated one")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    begun = provenance.begin()
    counts = [int(n) for n in args.sequences.split(",")]
    if len(counts) < 2 or min(counts) < 1:
        parser.error("--sequences needs at least two counts of 1 or more")
    if args.prompt_len + args.new_tokens > MAX_POSITION:
        parser.error(f"--prompt-len + --new-tokens must fit the checkpoint's context of {MAX_POSITION}")

    with tempfile.TemporaryDirectory(prefix="odmoe-main-memory-") as tmp:
        model = args.model or make_tiny(
            Path(tmp) / "model", seed=0, dtype="bfloat16", max_position=MAX_POSITION, **SHAPE
        )
        config = json.loads((model / "config.json").read_text())
        checkpoint_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        runs = []
        for repeat in range(args.repeats):
            for n in counts:
                run = measure(model, n, args, Path(tmp) / f"cluster-{repeat}-{n}")
                run["repeat"] = repeat
                runs.append(run)
                print(
                    f"{n} sequence(s): main ready {run['main_ready_rss_bytes'] / 1e6:.0f} MB, "
                    f"peak {run['main_peak_bytes'] / 1e6:.0f} MB (+{run['main_growth_bytes'] / 1e6:.0f} MB), "
                    f"{run['seconds']:.1f} s",
                    flush=True,
                )
    per_sequence = slope([(r["sequences"], r["main_peak_bytes"]) for r in runs])
    kv = kv_bytes_per_sequence(config, args.prompt_len + args.new_tokens)
    print(
        f"main's peak per added sequence: {per_sequence / 1e6:.1f} MB "
        f"(its KV cache of {args.prompt_len + args.new_tokens} positions: {kv / 1e6:.1f} MB)"
    )
    results = {
        "benchmark": "main_memory",
        "checkpoint_bytes": checkpoint_bytes,
        "shape": SHAPE if args.model is None else None,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "workers": args.workers,
        "runs": runs,
        "main_peak_bytes_per_sequence": per_sequence,
        "kv_bytes_per_sequence": kv,
    }
    if args.json:
        provenance.write(args.json, results, begun, "torch", "transformers", depends_on=DEPENDS_ON)
    return 0


if __name__ == "__main__":
    sys.exit(main())
