r"""What a user waits when a role dies mid-answer: the stall, measured side by side with normal steps.

    python -m benchmarks.faults [--model DIR] [--workers 4] [--trials 5] [--tokens 32] [--json OUT]

One local cluster (main, shadow, ``--workers`` workers on 127.0.0.1, the demo model unless
``--model``). Each trial streams a greedy answer and SIGKILLs a role once a third of its tokens
came: worker-1, then (separately) the shadow. Per trial it records the *stall* (the longest
gap between two tokens after the kill), the median gap between tokens before the kill in the
same answer (a normal step), and whether the answer was token-identical to the same prompt's
answer with every role up. Between trials the killed role is started again and the next
trial waits until main has taken it back. Prints the median and the range over the trials.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

from benchmarks import provenance, substance
from benchmarks.spread import spread
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.wire.generation import Done, Token

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

DEMO_MODEL = Path(__file__).resolve().parent.parent / "platform" / "demo-model"
PROMPT = [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


def trial(cluster: LocalCluster, victim: str, tokens: int) -> dict:
    """One answer with ``victim`` killed a third of the way in."""
    assert cluster.client is not None
    kill_at = max(2, tokens // 3)
    got: list[int] = []
    stamps: list[float] = []
    done = None
    for event in cluster.client.stream(PROMPT, tokens, timeout_s=120):
        if isinstance(event, Token):
            got.append(event.token_id)
            stamps.append(time.monotonic())
            if len(got) == kill_at:
                cluster.processes[victim].kill()
        elif isinstance(event, Done):
            done = event
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {
        "tokens": got,
        "stall_ms": max(gaps[kill_at - 1 :]) * 1000,
        "normal_step_ms": statistics.median(gaps[: kill_at - 1]) * 1000,
        "roles_lost": done.metrics.get("roles_lost") if done else None,
    }


def wait_back(cluster: LocalCluster, victim: str, timeout_s: float = 120) -> None:
    """Start ``victim`` again and generate until main says it took it back."""
    cluster.restart_role(victim)
    log = cluster.work_dir / "main.log"
    needle = "the shadow is back" if victim == "shadow" else f"back in the cluster: {victim}"
    seen = log.read_text().count(needle)
    deadline = time.monotonic() + timeout_s
    while log.read_text().count(needle) == seen:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{victim} did not rejoin within {timeout_s:.0f} s")
        cluster.generate(PROMPT[:3], 2)
        time.sleep(0.3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    begun = provenance.begin()
    options = ClusterOptions(workers=args.workers, settings=DeploymentSettings(device="cpu"))
    results: dict = {"model": str(args.model), "workers": args.workers, "tokens": args.tokens, "roles": {}}
    with LocalCluster(args.model, options, progress=print) as cluster:
        reference = cluster.generate(PROMPT, args.tokens).token_ids
        for victim in ("worker-1", "shadow"):
            runs = []
            for i in range(args.trials):
                run = trial(cluster, victim, args.tokens)
                run["exact"] = run.pop("tokens") == reference
                runs.append(run)
                print(
                    f"{victim} trial {i + 1}: stall {run['stall_ms']:.0f} ms "
                    f"(normal step {run['normal_step_ms']:.0f} ms), exact {run['exact']}"
                )
                wait_back(cluster, victim)
            results["roles"][victim] = {
                "stall_ms": spread([r["stall_ms"] for r in runs]),
                "normal_step_ms": spread([r["normal_step_ms"] for r in runs]),
                "all_exact": all(r["exact"] for r in runs),
                "runs": runs,
            }
    for victim, found in results["roles"].items():
        stall, step = found["stall_ms"], found["normal_step_ms"]
        span = f"{stall['min']:.0f}-{stall['max']:.0f}"
        print(
            f"{victim} killed mid-answer: stall {stall['median']:.0f} ms median ({span}) "
            f"vs a normal step of {step['median']:.0f} ms; every answer exact: {found['all_exact']}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        provenance.write(args.json, results, begun, "torch", "transformers", depends_on=DEPENDS_ON)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
