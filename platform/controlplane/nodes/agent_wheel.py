"""The agent's own package: a wheel of ``agent/`` and the runtime (``inference/``), nothing else.

A GPU box needs the agent and the runtime only: this wheel carries exactly those two packages
and declares exactly their dependencies (``agent/requirements.txt``: torch, transformers,
pyzmq, ...), so installing it brings no part of the control plane (Django, Celery, DRF,
Channels, matplotlib). It is built from this checkout the first time it is asked for, in
memory, and byte for byte the same every time (sorted entries, fixed timestamps and modes),
so every process of one checkout serves the same bytes under the same sha256, which the install
script pins. In a git checkout it holds the files git tracks only: a stray file left in
``agent/`` or ``inference/`` (a scratch script, a key, a notebook) never ships to every box, and
a checkout git cannot list is an error rather than a walk of its folders; a tree without git (a
release tarball) ships what its folders hold. The format is the wheel
specification's (PEP 427 / PEP 491): the files, then a ``.dist-info`` with METADATA, WHEEL,
entry_points.txt and a RECORD of every file's sha256.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import subprocess
import zipfile
from pathlib import Path

DISTRIBUTION = "odmoe-agent"
PACKAGES = ("agent", "inference")
SKIPPED = ("__pycache__", ".pytest_cache")
SERVED_BESIDE = ("install.sh", "requirements.txt", "requirements.lock")  # agent/ files that are not code
# A zip entry's timestamp: the earliest a zip can hold, so the bytes do not depend on when they were built.
EPOCH = (1980, 1, 1, 0, 0, 0)


def requirements(repo: Path) -> list[str]:
    """The agent's dependencies as ``agent/requirements.txt`` declares them (comments dropped)."""
    lines = (line.split("#", 1)[0].strip() for line in (repo / "agent" / "requirements.txt").read_text().splitlines())
    return [line for line in lines if line]


def version(repo: Path) -> str:
    """The runtime's version (``inference.__version__``), read from the source, not imported."""
    for line in (repo / "inference" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise RuntimeError("inference/__init__.py declares no __version__")


def wheel_name(repo: Path) -> str:
    return f"{DISTRIBUTION.replace('-', '_')}-{version(repo)}-py3-none-any.whl"


def _files(repo: Path) -> list[tuple[str, bytes]]:
    found = []
    for relative in _package_paths(repo):
        path = repo / relative
        if any(part in SKIPPED for part in relative.parts) or path.suffix == ".pyc":
            continue
        if relative.parts[:1] == ("agent",) and path.name in SERVED_BESIDE:
            continue  # served or read by the control plane, not run on the box from the package
        found.append((relative.as_posix(), path.read_bytes()))
    return found


def _package_paths(repo: Path) -> list[Path]:
    """The files of ``PACKAGES`` relative to ``repo``, sorted: the tracked ones when ``repo`` is
    the top of a git checkout (as they are in the working tree, local edits included), else
    (a release unpacked without git) every file under the packages' folders."""
    if not (repo / ".git").exists():
        walked = (path for package in PACKAGES for path in (repo / package).rglob("*"))
        return sorted(path.relative_to(repo) for path in walked if path.is_file())
    # A tracked file deleted from the working tree is not there to ship.
    return sorted(path for path in _tracked_files(repo) if (repo / path).is_file())


def _tracked_files(repo: Path) -> list[Path]:
    """What git tracks under ``PACKAGES`` in the checkout at ``repo``. A checkout git cannot list
    is an error, never a walk of the folders: in production the checkout is root's and the
    services run as another user, which git refuses to read ("dubious ownership") unless told the
    folder is safe, as it is here, where the checkout is what this server runs."""
    argv = ["git", "-c", f"safe.directory={repo.resolve()}", "-C", str(repo), "ls-files", "-z", "--", *PACKAGES]
    try:
        listed = subprocess.run(argv, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"{repo} is a git checkout, but git cannot list its files ({exc}): install git") from None
    if listed.returncode != 0:
        reason = listed.stderr.decode(errors="replace").strip()
        raise RuntimeError(f"git cannot list the files of the checkout {repo}: {reason}")
    return [Path(name) for name in listed.stdout.decode().split("\0") if name]


def _metadata(repo: Path) -> bytes:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {DISTRIBUTION}",
        f"Version: {version(repo)}",
        "Summary: The odmoe agent and runtime for one GPU box of an odmoe cluster",
        "Requires-Python: >=3.11",
        *(f"Requires-Dist: {requirement}" for requirement in requirements(repo)),
    ]
    return ("\n".join(lines) + "\n").encode()


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def build_wheel(repo: Path) -> bytes:
    """The agent's wheel, built from the checkout at ``repo``."""
    dist_info = f"{DISTRIBUTION.replace('-', '_')}-{version(repo)}.dist-info"
    entries = _files(repo)
    entries += [
        (f"{dist_info}/METADATA", _metadata(repo)),
        (f"{dist_info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: odmoe\nRoot-Is-Purelib: true\nTag: py3-none-any\n"),
        (f"{dist_info}/entry_points.txt", b"[console_scripts]\nodmoe-agent = agent.__main__:main\n"),
    ]
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in entries)
    record += f"{dist_info}/RECORD,,\n"
    entries.append((f"{dist_info}/RECORD", record.encode()))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, data)
    return buffer.getvalue()


@functools.cache
def served_wheel(repo: Path) -> tuple[str, bytes, str]:
    """(file name, bytes, sha256) of the wheel this control plane serves, built once per process."""
    data = build_wheel(repo)
    return wheel_name(repo), data, hashlib.sha256(data).hexdigest()
