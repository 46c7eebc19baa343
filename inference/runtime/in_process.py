"""Roles as threads of this process: the same role code, sockets and keys, torch imported once.

``LocalCluster(in_process=True)`` starts each role here instead of as ``python -m inference
serve-role``: every role still binds its own authenticated loopback inbox (CURVE keys, ZAP per
inbox) and talks to its peers over TCP exactly as the processes do, so what a generation
computes and sends is the same; what is saved is a Python, torch and Transformers start per
role. A role's thread cannot be killed or measured on its own, so what needs a process of its
own (SIGKILL, a frozen peer, resident memory per role, a hostile process) uses processes.
"""

from __future__ import annotations

import faulthandler
import logging
import threading
import traceback
from pathlib import Path

import torch

from inference.runtime.roles.dispatch import role_class
from inference.runtime.spec import RoleSpec

log = logging.getLogger(__name__)

# One role at a time builds itself: Transformers sets torch's process-wide default dtype while it
# builds a model and puts the old one back after, so two roles of different dtypes building at
# once would leave one's dtype as the process's default (seen: bf16, failing later fp32 tests).
_BUILDING = threading.Lock()


class RoleThread(threading.Thread):
    """One role running in a daemon thread; ``failure`` holds its traceback if it raised."""

    def __init__(self, name: str, spec: RoleSpec) -> None:
        super().__init__(name=f"role-{name}", daemon=True)
        self.role_name = name
        self.spec = spec
        self.failure: str | None = None

    def run(self) -> None:
        try:
            with _BUILDING:
                default_dtype = torch.get_default_dtype()
                try:
                    role = role_class(self.spec.role)(self.spec)
                finally:
                    torch.set_default_dtype(default_dtype)
            role.run()
        except BaseException:  # reported through ``failure``, as a process's exit code would be
            self.failure = traceback.format_exc()
            log.error("%s failed:\n%s", self.role_name, self.failure)

    def exited(self) -> str | None:
        """None while running, else how it ended (its traceback if it raised)."""
        if self.is_alive():
            return None
        return self.failure or "its role returned"


class ClusterLog:
    """Every role thread's log records, while the cluster runs, in one file of its work dir."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handler = logging.FileHandler(path, encoding="utf-8")
        self.handler.setLevel(logging.INFO)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s"))
        logging.getLogger().addHandler(self.handler)

    def dump_stacks(self) -> None:
        """Every thread's stack into the file (where a role that does not answer is stuck)."""
        self.handler.flush()
        with self.path.open("a", encoding="utf-8") as out:
            faulthandler.dump_traceback(out, all_threads=True)

    def close(self) -> None:
        logging.getLogger().removeHandler(self.handler)
        self.handler.close()
