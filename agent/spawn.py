"""How the agent starts a role process: fresh, or forked from the machine's shared zygote.

A box that runs one agent starts each role as ``python -m inference serve-role``, a fresh process
that dies with the agent. Several agents on one machine (``manage.py up``'s, the end-to-end tests')
can share a zygote of each kind instead (``--role-zygotes``, ``inference.runtime.shared_zygote``):
a role forked from one skips the seconds of imports each fresh role spends, and dies with its
agent as well. Where the zygote cannot fork it (gone, busy with threads), the role starts fresh.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

from inference.runtime.launcher import die_with_parent
from inference.runtime.shared_zygote import ForkedProcess, start_forked
from inference.runtime.zygote import ZygoteError, kind_of

log = logging.getLogger("agent")

RoleProcess = asyncio.subprocess.Process | ForkedProcess  # what the agent holds of a running role


class RoleSpawner:
    """Starts this agent's role processes; with ``zygotes``, forked from the zygotes in that folder."""

    def __init__(self, zygotes: Path | None = None) -> None:
        self.zygotes = zygotes

    async def start(self, role: str, spec_path: Path, log_path: Path) -> RoleProcess:
        """Role ``role`` (main, shadow or worker) from ``spec_path``, its output appended to ``log_path``."""
        argv = ["serve-role", "--role", role, "--spec", str(spec_path)]
        if self.zygotes is not None:
            try:
                return await start_forked(
                    self.zygotes, kind_of(role), argv, log_path.absolute(), dict(os.environ), Path.cwd()
                )
            except ZygoteError as exc:
                log.warning("%s; starting the %s as a fresh process", exc, role)
        with log_path.open("ab") as log_file:
            return await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "inference",
                *argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
            )
