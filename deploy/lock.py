r"""Write the hash-locked requirement files from ``constraints.txt``: every wheel pip may install, by sha256.

    python deploy/lock.py [--index-url URL] [--only agent|controlplane]

Two files, both for Linux (x86_64 and aarch64) and CPython 3.11 to 3.13:

- ``deploy/requirements.lock``: the control plane's install (``agent/requirements.txt`` and
  ``platform/requirements.txt``, what ``pyproject.toml`` declares): ``pip install
  --require-hashes --only-binary :all: -r deploy/requirements.lock``.
- ``agent/requirements.lock``: the agent's dependencies, which the control plane serves beside
  the agent's wheel and the install script installs the same way.

How: pip itself resolves each requirement list against the index, with ``constraints.txt``
pinning the versions tested, once per Python version and machine (``pip install --dry-run
--report``: metadata only, no wheel is downloaded), so the closure is pip's own, markers and
all. A package needed by only some of those targets gets an environment marker saying which.
Then each pinned version gets the sha256 of every wheel the index holds for it (the index's
JSON API, PEP 691), so one file serves every platform those wheels cover. Packages that
``constraints.txt`` does not pin (PyTorch's CUDA libraries, setuptools) are pinned here at what
pip resolved. No source distribution is listed: ``--only-binary :all:`` keeps pip from running
a build, whose own dependencies no hash would check.

Run it again after changing ``constraints.txt`` or a requirements file;
``tests/deploy/test_deploy.py`` fails while a lock disagrees with ``constraints.txt``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parent.parent
PYTHONS = ("3.11", "3.12", "3.13")
MACHINES = ("x86_64", "aarch64")
# The manylinux tags a current Linux box accepts (glibc 2.17 to 2.28, as pip lists them).
MANYLINUX = [f"manylinux_2_{minor}" for minor in range(28, 16, -1)] + ["manylinux2014", "linux"]
TARGETS = {
    "controlplane": (["agent/requirements.txt", "platform/requirements.txt"], "deploy/requirements.lock"),
    "agent": (["agent/requirements.txt"], "agent/requirements.lock"),
}


def resolve(requirements: list[str], python: str, machine: str, index_url: str) -> dict[str, str]:
    """{canonical name: version} that pip installs for ``requirements`` on that Python and machine."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        argv = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet"]
        argv += ["--report", str(report), "--index-url", index_url, "--only-binary", ":all:"]
        argv += ["--python-version", python, "--implementation", "cp", "--target", str(Path(scratch) / "t")]
        for tag in MANYLINUX:
            argv += ["--platform", f"{tag}_{machine}"]
        argv += ["-c", str(REPO / "constraints.txt")]
        for path in requirements:
            argv += ["-r", str(REPO / path)]
        run = subprocess.run(argv, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"pip could not resolve {requirements} for Python {python} on {machine}:\n{run.stderr}")
        items = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def wheel_hashes(name: str, version: str, index_url: str) -> list[str]:
    """The sha256 of every wheel of ``name`` ``version`` on the index, sorted."""
    request = urllib.request.Request(
        f"{index_url.rstrip('/')}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        files = json.load(response)["files"]
    found = set()
    for entry in files:
        if not entry["filename"].endswith(".whl") or entry.get("yanked"):
            continue
        try:
            wheel_name, wheel_version, _, _ = parse_wheel_filename(entry["filename"])
        except InvalidWheelFilename:
            continue  # an old upload whose name no installer reads (pydantic 0.18's "py36+")
        if canonicalize_name(wheel_name) == name and str(wheel_version) == version:
            found.add(entry["hashes"]["sha256"])
    if not found:
        raise SystemExit(f"the index has no wheel of {name} {version}")
    return sorted(found)


def marker(needed: set[tuple[str, str]]) -> str:
    """The environment marker for a package needed on only some (python, machine) targets; '' for all."""
    everywhere = {(p, m) for p in PYTHONS for m in MACHINES}
    if needed == everywhere:
        return ""
    pythons = sorted({p for p, _ in needed})
    machines = sorted({m for _, m in needed})
    if needed == {(p, m) for p in pythons for m in machines}:  # a product: one clause each
        parts = []
        if len(pythons) < len(PYTHONS):
            parts.append("(" + " or ".join(f'python_version == "{p}"' for p in pythons) + ")")
        if len(machines) < len(MACHINES):
            parts.append("(" + " or ".join(f'platform_machine == "{m}"' for m in machines) + ")")
        return " and ".join(parts)
    pairs = sorted(needed)
    return " or ".join(f'(python_version == "{p}" and platform_machine == "{m}")' for p, m in pairs)


def lock(target: str, index_url: str) -> str:
    requirements, _ = TARGETS[target]
    versions: dict[str, set[str]] = defaultdict(set)
    needed: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for python in PYTHONS:
        for machine in MACHINES:
            print(f"· {target}: resolving for CPython {python} on {machine}", file=sys.stderr, flush=True)
            for name, version in resolve(requirements, python, machine, index_url).items():
                versions[name].add(version)
                needed[name].add((python, machine))
    split = {name: sorted(v) for name, v in versions.items() if len(v) > 1}
    if split:
        raise SystemExit(f"pip resolved different versions on different targets: {split}; pin them in constraints.txt")
    lines = [
        f"# The {target}'s dependencies, hash-locked: written by deploy/lock.py from constraints.txt and",
        f"# {' and '.join(requirements)} ({datetime.now(UTC):%Y-%m-%d}); do not edit, run it again.",
        "# Linux x86_64 and aarch64, CPython 3.11-3.13. Install with:",
        "#   pip install --require-hashes --only-binary :all: -r THIS_FILE",
    ]
    for name in sorted(versions):
        (version,) = versions[name]
        condition = marker(needed[name])
        hashes = wheel_hashes(name, version, index_url)
        head = f"{name}=={version}" + (f" ; {condition}" if condition else "")
        lines.append(head + " \\")
        lines += [f"    --hash=sha256:{h}" + (" \\" if i < len(hashes) - 1 else "") for i, h in enumerate(hashes)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index-url", default="https://pypi.org/simple", help="the package index (PEP 691 JSON)")
    parser.add_argument("--only", choices=sorted(TARGETS), help="write one of the two files")
    args = parser.parse_args(argv)
    for target in [args.only] if args.only else list(TARGETS):
        text = lock(target, args.index_url)
        path = REPO / TARGETS[target][1]
        path.write_text(text)
        print(f"· wrote {path.relative_to(REPO)} ({text.count('==')} packages)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
