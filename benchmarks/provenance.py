"""Where a recorded result came from: the commit it was measured at, and whether the tree was that commit."""

from __future__ import annotations

import subprocess
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
