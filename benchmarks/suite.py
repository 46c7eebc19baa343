"""How long the test suite takes on a fresh clone: ``make test`` (what CI runs) or ``make check``.

    python -m benchmarks.suite [--target test|check] --json benchmarks/results/suite-test-N.json

Clones this checkout's HEAD into a temporary directory (so nothing of this working tree, its
venv or its caches is reused), runs ``CI=true make TARGET`` there with no stdin, as CI does, and
records the wall time of the whole command, pytest's own time and its counts (parsed from its
summary line; the whole output goes beside the JSON, as ``.log``), the commit, the date and the
machine (cores, load average before and after: a run beside other work is slower, and the
record says so). A failed run is recorded too, with
its return code and the tail of its output: every run counts.

``--from-log LOG`` records a run made by hand instead (``time CI=true .ci/run > LOG 2>&1`` on a
fresh clone, ``--commit`` naming what it ran): its wall time from ``time``'s ``real`` line, and the
load average before it from the line ``make test`` and ``make check`` print first (``make
loadavg``); a log without that line records ``"not in its log"``, never the load at recording time.

The targets (``benchmarks/targets.py``) judge ``make test`` on every ``suite-test-*.json`` and
``make check`` on the fresh-clone runs only: name those ``suite-check-fresh-N.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import provenance
from benchmarks.provenance import REPO

# What its figures depend on (benchmarks.substance): a run records the whole suite at its commit, which
# names it; no later change makes that record stale, so nothing beyond its own imports is declared.
DEPENDS_ON: tuple[str, ...] = ()

SUMMARY = re.compile(r"^=*\s*(?P<counts>\d+ (?:passed|failed).*?) in (?P<seconds>[\d.]+)s", re.M)
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")
REAL = re.compile(r"^real\s+(?:(\d+)m)?([\d.]+)s", re.M)
LOAD_BEFORE = re.compile(r"^load average before: (?P<loads>[\d.]+ [\d.]+ [\d.]+)$", re.M)


def pytest_figures(output: str) -> dict:
    """pytest's time and counts from the last summary line of ``output`` (None where it has none)."""
    found = list(SUMMARY.finditer(output))
    if not found:
        return {"pytest_s": None, "counts": {}}
    last = found[-1]
    counts = {
        kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in COUNT.findall(last["counts"])
    }
    return {"pytest_s": float(last["seconds"]), "counts": counts}


def real_seconds(output: str) -> float | None:
    """The ``real`` time that bash's ``time`` printed last in ``output``."""
    found = list(REAL.finditer(output))
    if not found:
        return None
    minutes, seconds = found[-1].groups()
    return int(minutes or 0) * 60 + float(seconds)


def load_before(output: str) -> str:
    """The load average that ``make loadavg`` printed first in ``output``, as ``provenance.begin``
    writes one (``"0.26 0.10 0.03"``), or ``"not in its log"``."""
    found = LOAD_BEFORE.search(output)
    return found["loads"] if found else "not in its log"


def run_fresh(target: str, log: Path) -> dict:
    """Clone HEAD, run ``make TARGET`` as CI does (its whole output into ``log``), and time it."""
    with tempfile.TemporaryDirectory(prefix="odmoe-suite-") as tmp:
        # As a CI checkout is: readable by all (the install tests run the one-liner as nobody,
        # reading this clone's venv; a private temporary directory would refuse them).
        Path(tmp).chmod(0o755)
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
        began = time.monotonic()
        done = subprocess.run(
            ["make", target],
            cwd=clone,
            env={**os.environ, "CI": "true"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wall = time.monotonic() - began
    log.write_text(done.stdout)
    return {
        "measured": f"CI=true make {target}",
        "how": "python -m benchmarks.suite: a fresh clone of HEAD (the record's commit), its own venv",
        "target": target,
        "returncode": done.returncode,
        "wall_s": round(wall, 1),
        **pytest_figures(done.stdout),
        "log": str(log),
        "tail": done.stdout[-2000:] if done.returncode else "",
    }


def from_log(log: Path, target: str, head: str, date: str) -> dict:
    output = log.read_text(errors="replace")
    figures = pytest_figures(output)
    failed = figures["counts"].get("failed", 0) + figures["counts"].get("error", 0)
    return {
        "measured": "CI=true .ci/run" if target == "test" else f"CI=true make {target}",
        "how": "by hand on a fresh clone, recorded from its log with --from-log (ran_commit, ran_date)",
        "target": target,
        "ran_commit": head,
        "ran_date": date,
        "returncode": 1 if failed or figures["pytest_s"] is None else 0,
        "wall_s": real_seconds(output),
        **figures,
        "tail": "",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("test", "check"), default="test")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--from-log", type=Path, help="record a run made by hand from its log")
    parser.add_argument("--commit", help="with --from-log: the commit it ran")
    parser.add_argument("--date", help="with --from-log: when it started (ISO 8601)")
    args = parser.parse_args(argv)
    begun = provenance.begin()
    if args.from_log and not (args.commit and args.date):
        parser.error("--from-log needs --commit and --date: what ran, and when")
    if args.from_log:
        record = from_log(args.from_log, args.target, args.commit, args.date)
        # The run began before its log was written, not now: its load then is the log's own line.
        begun["loadavg_before"] = load_before(args.from_log.read_text(errors="replace"))
    else:
        record = run_fresh(args.target, args.json.with_suffix(".log"))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    provenance.write(args.json, record, begun, depends_on=DEPENDS_ON)
    minutes = (record["wall_s"] or 0) / 60
    pytest_s, counts, code = record["pytest_s"], record["counts"], record["returncode"]
    print(f"make {args.target}: {minutes:.1f} min, pytest {pytest_s} s, {counts}, return code {code}")
    return 0 if record["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
