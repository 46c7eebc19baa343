"""The process group of ``manage.py up`` and the end-to-end tests: the order its children stop in."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from controlplane.ops.processes import ProcessGroup

# A child that notes when SIGTERM reaches it and when it has finished stopping (a while later, as
# an agent stopping its role does), each note one appended line of the shared ``events`` file.
STOPS_SLOWLY = """
import os, signal, sys, time
name, events, ready = sys.argv[1:]
def note(what):
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, f"{what} {name}\\n".encode())
    os.close(fd)
def stop(*_):
    note("term")
    time.sleep(0.5)
    note("exit")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(ready, "w").close()
while True:
    time.sleep(1)
"""


def test_a_run_of_agents_stops_at_once_and_what_came_before_them_after_them(tmp_path: Path) -> None:
    events = tmp_path / "events"
    names = ["asgi", "celery", "agent-s0", "agent-s1", "agent-s2"]
    with ProcessGroup(tmp_path / "logs", {}) as group:
        for name in names:
            group.start(name, [sys.executable, "-c", STOPS_SLOWLY, name, str(events), str(tmp_path / name)])
        deadline = time.monotonic() + 60
        while not all((tmp_path / name).exists() for name in names):
            group.check()
            assert time.monotonic() < deadline, "the children did not start"
            time.sleep(0.05)
    lines = events.read_text().splitlines()
    assert sorted(lines) == sorted(f"{what} {name}" for name in names for what in ("term", "exit"))
    agents = [line for line in lines[:6] if line.endswith(tuple(names[2:]))]
    # Every agent was told before any of them had finished stopping...
    assert [line.split()[0] for line in agents] == ["term"] * 3 + ["exit"] * 3, lines
    # ...and the rest, last started first, each once the one after it had stopped.
    assert lines[6:] == ["term celery", "exit celery", "term asgi", "exit asgi"]
