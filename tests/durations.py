"""The seconds each test file took in one whole run: under pytest-xdist, ``conftest`` deals the files
out longest first (``order``), so a run ends on short files instead of one worker running a long
file dealt last while the other waits. Written from a whole run's JUnit XML, never by hand:

    python -m pytest -q -n 2 --dist loadfile --junitxml=/tmp/junit.xml
    python -m tests.durations /tmp/junit.xml

A file the list does not have yet (a new one) counts as ``UNKNOWN_S``; a stale list only deals the
files in a worse order, it changes no result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from tests.paths import REPO

ROOT = REPO
DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_S = 10.0


def load(path: Path = DURATIONS) -> dict[str, float]:
    """Each test file's seconds (its path from the repository root), or none without the list."""
    try:
        return {name: float(seconds) for name, seconds in json.loads(path.read_text())["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def order(paths: list[Path], durations: dict[str, float]) -> dict[Path, int]:
    """Each of ``paths`` (test files) ranked longest first; ties by path, so every worker ranks alike."""

    def seconds(path: Path) -> float:
        return durations.get(_relative(path), UNKNOWN_S)

    ranked = sorted(set(paths), key=lambda path: (-seconds(path), _relative(path)))
    return {path: rank for rank, path in enumerate(ranked)}


def _relative(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def from_junit(xml: Path) -> dict[str, float]:
    """Seconds per test file in a JUnit report (each test's setup, call and teardown)."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(xml).getroot().iter("testcase"):
        seconds[_file_of(case.get("classname", ""))] += float(case.get("time") or 0)
    return {name: round(total, 1) for name, total in sorted(seconds.items())}


def _file_of(classname: str) -> str:
    """``tests.controlplane.test_x`` (or ``...test_x.TestCase``) as ``tests/controlplane/test_x.py``."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end]) + ".py"
        if (ROOT / candidate).is_file():
            return candidate
    return classname


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", type=Path, help="a whole run's JUnit XML (pytest --junitxml)")
    parser.add_argument("--commit", help="the commit the run tested (default: this checkout's)")
    parser.add_argument("--out", type=Path, default=DURATIONS)
    args = parser.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    written = {
        "what": "seconds per test file in one whole run, the order pytest-xdist deals them out in (tests/conftest.py)",
        "command": f"python -m tests.durations {args.junit}" + (f" --commit {args.commit}" if args.commit else ""),
        "commit": args.commit or head.stdout.strip(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "files": from_junit(args.junit),
    }
    args.out.write_text(json.dumps(written, indent=1) + "\n")
    print(f"{len(written['files'])} files, {sum(written['files'].values()):.0f} s in all -> {args.out}")


if __name__ == "__main__":
    main()
