"""Where a recorded result came from: the commit it was measured at, whether the tree was that
commit, and for a benchmark that asks, the whole record (command, commit, dirty, start and end,
machine, versions: ``record``)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def commit() -> str:
    """The checkout's commit (short hash), or "" outside a git checkout."""
    try:
        run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    except OSError:  # no git on this machine
        return ""
    return run.stdout.strip() if run.returncode == 0 else ""


def dirty() -> bool | None:
    """Whether the checkout's tracked files differ from its commit (None outside a git checkout): a
    result measured on uncommitted changes names their parent as its commit."""
    try:
        run = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return None
    return bool(run.stdout.strip()) if run.returncode == 0 else None


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def machine() -> dict:
    """What ran it: the CPU's model, the cores this process may use, the memory, the load then."""
    model = platform.processor() or platform.machine()
    memory = 0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        memory = int(Path("/proc/meminfo").read_text().split()[1]) * 1024  # MemTotal, in kB
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(memory / 2**30, 1),
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def versions(*packages: str) -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def record(started: str, *packages: str) -> dict:
    """The provenance of a run that began at ``started`` (``now()``) and ends now."""
    return {
        "command": " ".join(["python", "-m", *sys.orig_argv[2:]] if sys.orig_argv[1:2] == ["-m"] else sys.orig_argv),
        "commit": commit(),
        "dirty": dirty(),
        "date": started[:10],
        "started": started,
        "ended": now(),
        "machine": machine(),
        "versions": versions(*packages),
    }
