"""Run a Python module as ``python -m`` would, and write the names of every module it imported
to a file when it exits: ``python modules_probe.py OUT MODULE [ARGS...]``.

The web process's imports are its own business until it exits, so a test that must know them
(tests/controlplane/test_torch_free.py: no torch in the web process) starts the real server
through this instead of asking the server to tell: nothing in the control plane exists for it.
"""

from __future__ import annotations

import atexit
import runpy
import signal
import sys
from pathlib import Path


def main() -> None:
    out, module, *args = sys.argv[1:]

    def write_modules() -> None:
        Path(out).write_text("\n".join(sorted(sys.modules)) + "\n")

    atexit.register(write_modules)
    # uvicorn shuts down on SIGTERM, restores the handler it found and raises the signal again:
    # this handler, so the process exits through atexit instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
