"""The process group of ``manage.py up`` and the end-to-end tests: the order its children stop in, and
the private Redis ``up`` starts, which takes no client without its password."""

from __future__ import annotations

import stat
import sys
import time
from pathlib import Path

import pytest
import redis

from controlplane.ops.processes import ChildFailed, ProcessGroup, private_redis, redis_up, wait_until
from inference.runtime.launcher import free_port

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


def test_the_private_redis_takes_no_client_without_the_password_it_made_once(tmp_path: Path) -> None:
    """Before, ``manage.py up`` started redis-server with no password: any account on the machine read
    role keys and prompts from it."""
    var = tmp_path / "var"
    port = free_port()
    argv, url = private_redis(var, port)
    password = (var / "redis" / "password").read_text().strip()
    assert url == f"redis://:{password}@127.0.0.1:{port}/0" and len(password) >= 32
    with ProcessGroup(tmp_path / "logs", {}) as group:
        child = group.start("redis", argv)
        wait_until("Redis answering", lambda: redis_up(url), timeout_s=20, check=group.check)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=5).get("role-keys")
        assert not redis_up(f"redis://127.0.0.1:{port}/0")
        cmdline = Path(f"/proc/{child.process.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline  # what ps shows every account
    assert stat.S_IMODE((var / "redis").stat().st_mode) == 0o700
    for private in ("password", "redis.conf"):
        assert stat.S_IMODE((var / "redis" / private).stat().st_mode) == 0o600
    assert private_redis(var, free_port())[1].startswith(f"redis://:{password}@")  # made once, kept


def test_a_password_file_up_did_not_write_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "var" / "redis").mkdir(parents=True)
    (tmp_path / "var" / "redis" / "password").write_text("short pass\n")
    with pytest.raises(ChildFailed, match="remove it, and up makes a new one"):
        private_redis(tmp_path / "var", free_port())
