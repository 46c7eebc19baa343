"""Redis or PostgreSQL restarted under load, on the production stack (``deploy.prodcheck.production_stack``).

``python -m benchmarks.load --production --restart redis:40 --restart postgres:80`` restarts each
that many seconds into the measured window, as an operator's ``systemctl restart`` would: a clean
stop (Redis writes its append-only file, PostgreSQL ends every session with a fast shutdown) and a
start on the same port with the same data, then a wait until it answers. What the load lost
meanwhile is judged as any run's (``benchmarks.load``); each restart's moment and the seconds the
server was down are recorded beside it.

The stack's Redis is its own (a child of the run, appendonly as ``deploy/redis/odmoe.conf`` has it);
its PostgreSQL is this machine's cluster (``pg_ctlcluster``) when the stack uses the one at
127.0.0.1:5432, else the run's own (a child too).
"""

from __future__ import annotations

import argparse
import os
import pwd
import subprocess
import time
from collections.abc import Callable
from urllib.parse import urlsplit

# deploy.prodcheck puts platform/ on the path, and has the control plane's process helpers.
from deploy.prodcheck import Stack, postgres_answers, redis_up, wait_until

RESTARTABLE = ("redis", "postgres")
UP_TIMEOUT_S = 60.0


def restart_at(text: str) -> tuple[str, float]:
    """``WHAT:S`` (``redis:40``): what to restart, and the seconds into the measured window."""
    what, _, at = text.partition(":")
    if what not in RESTARTABLE:
        raise argparse.ArgumentTypeError(f"{what!r} is not one of {', '.join(RESTARTABLE)}")
    try:
        at_s = float(at)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{at!r} is not a number of seconds (WHAT:S, e.g. redis:40)") from None
    if not at_s >= 0:
        raise argparse.ArgumentTypeError(f"{at_s} s is before the window starts")
    return what, at_s


def restarter(stack: Stack) -> Callable[[str], None]:
    """Restarts ``what`` (one of ``RESTARTABLE``) in ``stack``, returning once it answers again."""

    def restart(what: str) -> None:
        if what == "redis":
            _restart_child(stack, "redis", lambda: redis_up(stack.env["REDIS_URL"]))
        elif any(child.name == "postgres" for child in stack.group.children):
            _restart_child(stack, "postgres", lambda: postgres_answers(stack.env["DATABASE_URL"]))
        else:
            _restart_cluster(stack.env["DATABASE_URL"], stack.group.check)

    return restart


def _restart_child(stack: Stack, name: str, answers: Callable[[], bool]) -> None:
    """Stop the stack's child ``name`` (SIGTERM: a clean shutdown) and start it again as it was, in its
    place among the children (the stack stops them last started first)."""
    group = stack.group
    (child,) = [c for c in group.children if c.name == name]
    place, argv = group.children.index(child), list(child.process.args)
    user = _owner(child.process.pid)
    group.stop(child)
    again = group.start(name, argv, user=user, cwd=stack.work)
    group.children.remove(again)
    group.children.insert(place, again)
    wait_until(f"{name} answering again", answers, timeout_s=UP_TIMEOUT_S, check=group.check)


def _owner(pid: int) -> str | None:
    """The account process ``pid`` runs as, when it is not this one's (a private PostgreSQL as root)."""
    uid = os.stat(f"/proc/{pid}").st_uid
    return pwd.getpwuid(uid).pw_name if uid != os.geteuid() else None


def _restart_cluster(url: str, check: Callable[[], None]) -> None:
    """This machine's PostgreSQL cluster on ``url``'s port, restarted with a fast shutdown."""
    port = urlsplit(url).port or 5432
    listed = subprocess.run(["pg_lsclusters", "--no-header"], capture_output=True, text=True, check=True).stdout
    found = [line.split() for line in listed.splitlines() if len(line.split()) > 2 and line.split()[2] == str(port)]
    if not found:
        raise RuntimeError(f"no PostgreSQL cluster of this machine listens on port {port} (pg_lsclusters)")
    version, cluster = found[0][:2]
    started = time.monotonic()
    subprocess.run(["pg_ctlcluster", version, cluster, "restart", "-m", "fast"], check=True, timeout=UP_TIMEOUT_S)
    wait_until(
        "PostgreSQL answering again",
        lambda: postgres_answers(url),
        timeout_s=max(1.0, UP_TIMEOUT_S - (time.monotonic() - started)),
        check=check,
    )
