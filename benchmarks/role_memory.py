"""Each role's peak memory on a checkpoint with Mixtral-8x7B's dimensions (issue 41, item 3).

    python -m benchmarks.role_memory [--layers 2] [--workers 4] [--new-tokens 8]
        [--model DIR] [--interval 0.01] [--json OUT] [--timeline OUT]

A bf16 checkpoint of ``--layers`` layers at Mixtral-8x7B's sizes (``inference.tools.tiny.mixtral_dims``:
hidden 4096, 8 experts of width 14336, 32 query and 8 key-value heads, vocabulary 32000; 6.3 GB
for 2 layers, 690 MB of it outside the experts) is made under a temporary directory (or
``--model`` is used), its shards built as ``LocalCluster`` builds them (4 workers and the shadow
pre-converted to nf4), and a cluster of processes (main, the nf4 shadow, the workers) started;
it serves one greedy generation of ``--new-tokens`` tokens. Workers keep their experts on disk
by default (``--expert-store disk``: only the experts in flight in RAM): four workers holding
5.6 GB of experts in RAM beside the other roles do not fit a shared 23 GB box (the first try was
killed for memory), and where a worker keeps its experts changes neither main nor the shadow.

Every ``--interval`` seconds, from each role's spawn to the end, each process's anonymous
memory (``RssAnon`` of ``/proc/PID/status``: what the role allocated, not the pages of shared
libraries or files it maps) is sampled; its largest sample is the role's peak, said with the
phase it fell in (``startup`` until every role is ready, ``serving`` after). The kernel's own
peak of the whole resident set (``VmHWM``, libraries included) is read at the end beside it.
The bounds are issue 41's: main ≤ its non-expert bytes + 600 MB, the nf4 shadow ≤ 0.45 × the
checkpoint + 600 MB, each worker ≤ the experts it owns + 600 MB (600 MB: the Python, torch and
transformers runtime of a role).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import provenance, substance
from inference.modelio.checkpoint import Checkpoint, expert_key_name, is_expert_key
from inference.policies.placement import placement
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.tools.tiny import make_tiny, mixtral_dims

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

RUNTIME_BYTES = 600e6
SHADOW_SHARE = 0.45
PROMPT = [1, 415, 2936, 9060, 285, 1142, 28705, 754, 272, 17898, 3914, 28723]


def status_fields(pid: int) -> dict[str, int]:
    """``/proc/PID/status``'s memory fields (``RssAnon``, ``VmRSS``, ``VmHWM``...) in bytes; {} once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if rest.endswith("kB"):
            fields[name] = int(rest.split()[0]) * 1024
    return fields


class Sampler(threading.Thread):
    """Samples every role process's anonymous memory until stopped; keeps each one's largest sample."""

    def __init__(self, cluster: LocalCluster, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.cluster, self.interval_s = cluster, interval_s
        self.began = time.monotonic()
        self.phase = "startup"
        self.peaks: dict[str, dict] = {}  # role -> {"bytes", "at_s", "phase"}
        self.timeline: dict[str, list[tuple[float, int]]] = {}  # role -> (s, bytes), each 0.5 s
        self.stopping = threading.Event()

    def run(self) -> None:
        last_kept: dict[str, float] = {}
        while not self.stopping.is_set():
            now = time.monotonic() - self.began
            for name, proc in list(self.cluster.processes.items()):
                anon = status_fields(proc.pid).get("RssAnon")
                if anon is None:
                    continue
                peak = self.peaks.get(name)
                if peak is None or anon > peak["bytes"]:
                    self.peaks[name] = {"bytes": anon, "at_s": round(now, 2), "phase": self.phase}
                if now - last_kept.get(name, -1.0) >= 0.5:
                    self.timeline.setdefault(name, []).append((round(now, 2), anon))
                    last_kept[name] = now
            self.stopping.wait(self.interval_s)

    def stop(self) -> None:
        self.stopping.set()
        self.join()


def checkpoint_facts(model: Path, workers: int) -> dict:
    """The checkpoint's bytes, the part outside the experts, and the expert bytes each worker owns."""
    ckpt = Checkpoint(model)
    total = sum(ckpt.nbytes(key) for key in ckpt)
    non_expert = sum(ckpt.nbytes(key) for key in ckpt if not is_expert_key(key))
    plan = placement(ckpt.n_layers, ckpt.n_experts, ckpt.top_k, workers)
    owned = [
        sum(
            ckpt.nbytes(expert_key_name(layer, expert, proj))
            for layer, expert in plan.owned(worker)
            for proj in ("w1", "w2", "w3")
        )
        for worker in range(workers)
    ]
    return {"checkpoint_bytes": total, "non_expert_bytes": non_expert, "worker_owned_bytes": owned}


def bounds(facts: dict, workers: int) -> dict[str, float]:
    out = {
        "main": facts["non_expert_bytes"] + RUNTIME_BYTES,
        "shadow": SHADOW_SHARE * facts["checkpoint_bytes"] + RUNTIME_BYTES,
    }
    out |= {f"worker-{w}": facts["worker_owned_bytes"][w] + RUNTIME_BYTES for w in range(workers)}
    return out


def measure(model: Path, work: Path, args: argparse.Namespace) -> dict:
    settings = DeploymentSettings(shadow_dtype="nf4", expert_store=args.expert_store)
    # Fresh processes: a role forked from a zygote would count the zygote's imported pages as its own.
    options = ClusterOptions(
        workers=args.workers, settings=settings, startup_timeout_s=args.startup_timeout, spawn="exec"
    )
    cluster = LocalCluster(model, options, work_dir=work, progress=lambda line: print(line, flush=True))
    sampler = Sampler(cluster, args.interval)
    sampler.start()
    try:
        with cluster:
            ready_s = time.monotonic() - sampler.began
            ready = {name: status_fields(p.pid) for name, p in cluster.processes.items()}
            sampler.phase = "serving"
            began = time.perf_counter()
            done = cluster.generate(PROMPT, args.new_tokens, timeout_s=1800)
            seconds = time.perf_counter() - began
            time.sleep(3 * args.interval)
            end = {name: status_fields(p.pid) for name, p in cluster.processes.items()}
            sampler.stop()
            names = list(cluster.processes)  # closing the cluster forgets its processes
    finally:
        if sampler.is_alive():
            sampler.stop()
            # A failed run still says what it saw (a role killed for memory is one way to fail).
            for name, peak in sampler.peaks.items():
                print(f"{name}: largest sample {peak['bytes'] / 1e6:.0f} MB ({peak['phase']}, {peak['at_s']} s)")
    roles = {}
    for name in names:
        roles[name] = {
            "peak_anon_bytes": sampler.peaks[name]["bytes"],
            "peak_at_s": sampler.peaks[name]["at_s"],
            "peak_phase": sampler.peaks[name]["phase"],
            "ready_anon_bytes": ready[name].get("RssAnon"),
            "end_anon_bytes": end[name].get("RssAnon"),
            "vm_hwm_bytes": end[name].get("VmHWM"),
        }
    return {
        "ready_s": round(ready_s, 1),
        "generate_s": round(seconds, 1),
        "token_ids": list(done.token_ids),
        "roles": roles,
        "timeline": {name: points for name, points in sampler.timeline.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--model", type=Path, help="a checkpoint to use instead of the generated one")
    parser.add_argument("--work", type=Path, help="the cluster's work directory (its shards are kept and reused)")
    parser.add_argument(
        "--expert-store",
        default="disk",
        choices=("ram", "disk"),
        help="where workers keep their experts (disk: only those in flight, so the cluster fits a small box)",
    )
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between samples")
    parser.add_argument("--startup-timeout", type=float, default=1800)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--timeline", type=Path, help="write each role's samples, one each 0.5 s, here")
    args = parser.parse_args(argv)
    begun = provenance.begin()

    with tempfile.TemporaryDirectory(prefix="odmoe-role-memory-") as tmp:
        if args.model is None:
            print(f"writing a {args.layers}-layer checkpoint at Mixtral-8x7B's sizes", flush=True)
        model = args.model or make_tiny(Path(tmp) / "model", seed=0, **mixtral_dims(args.layers))
        facts = checkpoint_facts(model, args.workers)
        limits = bounds(facts, args.workers)
        run = measure(model, args.work or Path(tmp) / "cluster", args)
    print(
        f"checkpoint {facts['checkpoint_bytes'] / 1e6:.0f} MB, non-expert {facts['non_expert_bytes'] / 1e6:.0f} MB; "
        f"ready in {run['ready_s']:.0f} s, {args.new_tokens} tokens in {run['generate_s']:.1f} s"
    )
    for name, role in run["roles"].items():
        role["bound_bytes"] = limits[name]
        role["within_bound"] = role["peak_anon_bytes"] <= limits[name]
        print(
            f"{name:>9}: peak anon {role['peak_anon_bytes'] / 1e6:6.0f} MB ({role['peak_phase']}, "
            f"{role['peak_at_s']:.0f} s), ready {role['ready_anon_bytes'] / 1e6:6.0f} MB, "
            f"VmHWM {role['vm_hwm_bytes'] / 1e6:6.0f} MB; bound {limits[name] / 1e6:6.0f} MB "
            f"{'ok' if role['within_bound'] else 'EXCEEDED'}"
        )
    results = {
        "benchmark": "role_memory",
        "shape": mixtral_dims(args.layers) if args.model is None else None,
        "workers": args.workers,
        "expert_store": args.expert_store,
        "shadow_dtype": "nf4",
        "new_tokens": args.new_tokens,
        "interval_s": args.interval,
        "runtime_bytes": RUNTIME_BYTES,
        "shadow_share": SHADOW_SHARE,
        **facts,
        "shadow_ratio": run["roles"]["shadow"]["peak_anon_bytes"] / facts["checkpoint_bytes"],
        **{key: value for key, value in run.items() if key != "timeline"},
    }
    if args.timeline:
        args.timeline.write_text(json.dumps(run["timeline"]) + "\n")
    if args.json:
        provenance.write(args.json, results, begun, "torch", "transformers", depends_on=DEPENDS_ON)
    return 0


if __name__ == "__main__":
    sys.exit(main())
