"""Where a recorded result came from: the commit it was measured at, whether the tree was that
commit, and the whole record (command, commit, dirty, date, start and end, machine with its load
before and after, versions: ``record``). Every benchmark writes its result through ``write``:
``begin`` as it starts, ``write`` at the end, into a new file (a re-run is a new file).

``write`` records the substance of the code the result depends on (``code``, see
``benchmarks.substance``) and seals what it writes (``sealed``: a SHA-256 of the record's canonical JSON, ``seal``), so
a field added or a figure changed by hand afterwards shows: ``tests/benchmarks/test_result_provenance.py``
recomputes every seal."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from benchmarks import substance

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


def begin() -> dict:
    """What a run notes as it starts, for ``write``: the time, and the machine's load then."""
    return {"started": now(), "loadavg_before": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def seal(data: dict) -> str:
    """The SHA-256 of ``data``'s canonical JSON, its own ``sealed`` field left out: what ``write``
    records, and what a reader recomputes to see that nothing was added or changed since."""
    canonical = json.loads(json.dumps({k: v for k, v in data.items() if k != "sealed"}, default=str))
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def sealed(data: dict) -> dict:
    """``data`` with its ``seal``, as it is written."""
    return data | {"sealed": seal(data)}


def write(path: Path, result: dict, begun: dict, *packages: str, depends_on: tuple[str, ...]) -> None:
    """``result`` with the provenance of the run ``begun`` (``begin``), sealed, as JSON at ``path``,
    a file that must not exist yet; ``packages``: the versions that matter beside Python's;
    ``depends_on``: the benchmark's ``DEPENDS_ON``, recorded with the substance of that code
    (``code``: ``benchmarks.substance.code_record``), from which the pages judge it stale."""
    provenance = record(begun["started"], *packages)
    provenance["code"] = substance.code_record(depends_on)
    provenance["machine"] = {"loadavg_before": begun["loadavg_before"], **provenance["machine"]}
    clash = sorted(set(result) & (set(provenance) | {"sealed"}))
    if clash:
        raise ValueError(f"the result names provenance's own fields {clash}")
    if path.exists():
        raise FileExistsError(f"{path} exists: a recorded result is never rewritten; give the new run a new file")
    path.write_text(json.dumps(sealed(result | provenance), indent=2, default=str) + "\n")
