"""An empty virtual environment holding the agent's wheel and only the distributions it depends on.

The test machine has no network, so the wheel's dependencies cannot be downloaded: each one
(and what it depends on, transitively, by its own metadata) is linked in from this test run's
environment instead, file by file as its RECORD lists them. Nothing else is there: what the
agent imports beyond its declared dependencies fails to import, as it would on a GPU box.
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import pwd
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Who installs an agent as an ordinary user when the tests run as root: as root, the install
# script makes a system user of its own, which is another path (tests/controlplane/test_install.py).
NOBODY = pwd.getpwnam("nobody")
# The control plane's distributions: none may come with the agent.
CONTROL_PLANE = {
    "django",
    "celery",
    "djangorestframework",
    "channels",
    "channels-redis",
    "drf-spectacular",
    "drf-spectacular-sidecar",
    "django-axes",
    "dj-database-url",
    "psycopg",
    "psycopg-binary",
    "uvicorn",
    "prometheus-client",
    "matplotlib",
    "kombu",
    "redis",
    "odmoe",
}


def closure(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """Every distribution of this environment that ``requirements`` pull in, transitively."""
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = [(Requirement(r), "") for r in requirements]
    seen: set[tuple[str, str]] = set()
    while pending:
        requirement, extra = pending.pop()
        if (str(requirement), extra) in seen:
            continue
        seen.add((str(requirement), extra))
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dependency this environment does not have either
        first = name not in found
        found[name] = dist
        wanted_extras = requirement.extras or set()
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None:
                if first:
                    pending.append((sub, ""))
            else:
                for wanted in wanted_extras | {""}:
                    if sub.marker.evaluate({"extra": wanted}):
                        pending.append((sub, wanted))
                        break
    return list(found.values())


def make_venv(target: Path) -> Path:
    """A new, empty virtual environment (no pip, no system packages); its site-packages."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(target)], check=True, capture_output=True)
    (site,) = (target / "lib").glob("python3*/site-packages")
    return site


def link_dependencies(site: Path, requirements: list[str]) -> list[str]:
    """Link each distribution of ``requirements``' closure into ``site``; their names."""
    names = []
    for dist in closure(requirements):
        names.append(canonicalize_name(dist.metadata["Name"]))
        root = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            source, dest = root / top, site / top
            if source.exists() and not dest.exists() and top != "__pycache__":
                os.symlink(source, dest)
    return names


def install_isolated(wheel: bytes, target: Path) -> Path:
    """An empty venv at ``target / "venv"`` with the wheel unpacked (a pure wheel installs so) and its
    dependencies linked; its Python."""
    site = make_venv(target / "venv")
    with zipfile.ZipFile(io.BytesIO(wheel)) as archive:
        archive.extractall(site)
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [
            line.removeprefix("Requires-Dist: ")
            for line in archive.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist: ")
        ]
    link_dependencies(site, requires)
    return target / "venv" / "bin" / "python"


def as_ordinary_user(home: Path) -> dict:
    """``subprocess.run`` arguments that run an install as an ordinary user: nothing when the tests
    do not run as root, else as nobody, who is given ``home``."""
    if os.geteuid() != 0:
        return {}
    os.chown(home, NOBODY.pw_uid, NOBODY.pw_gid)
    return {"user": NOBODY.pw_uid, "group": NOBODY.pw_gid, "extra_groups": []}
