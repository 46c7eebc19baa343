"""Where a recorded result came from: the commit it was measured at."""

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
