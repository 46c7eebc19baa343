"""A control plane running for real, for end-to-end tests: ASGI server, Celery worker with beat,
agents, all as separate processes on 127.0.0.1 against the test database and Redis."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from controlplane.ops.processes import Child, ProcessGroup, agent_argv, asgi_argv, celery_argv, http_up, wait_until
from inference.runtime.launcher import SPAWN_ENV
from tests.controlplane.link_cut import LinkCut
from tests.paths import REPO


def database_url() -> str:
    """``DATABASE_URL`` of this run's test database, for the processes a test starts (ASGI server,
    Celery, ``manage.py``): with it, the test settings use that very database, SQLite or PostgreSQL."""
    from django.db import connection

    db = connection.settings_dict
    if db["ENGINE"] == "django.db.backends.sqlite3":
        return f"sqlite:///{db['NAME']}"
    if db["ENGINE"] == "django.db.backends.postgresql":
        user = urllib.parse.quote(db["USER"] or "", safe="")
        if db["PASSWORD"]:
            user += ":" + urllib.parse.quote(db["PASSWORD"], safe="")
        host = db["HOST"] or ""  # empty: libpq's default Unix socket
        host = f"[{host}]" if ":" in host else urllib.parse.quote(host, safe="")  # an IPv6 address, or a socket folder
        port = f":{db['PORT']}" if db["PORT"] else ""
        options = f"?{urllib.parse.urlencode(db['OPTIONS'])}" if db.get("OPTIONS") else ""
        return f"postgres://{user}@{host}{port}/{urllib.parse.quote(db['NAME'], safe='')}{options}"
    raise ValueError(f"the processes of these tests run on SQLite or PostgreSQL, not {db['ENGINE']}")


def purge_stale_tasks() -> None:
    """Drop tasks earlier tests enqueued with no worker running: the ids they name are reused."""
    from controlplane import celery_app

    celery_app.control.purge()


class Api:
    """JSON over HTTP with an API key, as any client of the REST API would call it."""

    def __init__(self, base: str, key: str) -> None:
        self.base, self.key = base, key

    def call(self, method: str, path: str, body: Any = None, *, expect: int | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.key}")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                code, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            code, raw = exc.code, exc.read()
        answer = json.loads(raw) if raw else None
        if expect is not None:
            assert code == expect, f"{method} {path}: {code} {answer}"
        return code, answer

    def get(self, path: str) -> Any:
        return self.call("GET", path, expect=200)[1]

    def post(self, path: str, body: Any = None, *, expect: int = 200) -> Any:
        return self.call("POST", path, body, expect=expect)[1]


@dataclass
class LiveControlPlane:
    group: ProcessGroup
    port: int
    api: Api
    state_root: Path
    link_cut: LinkCut | None = None  # where the agents reach the server through, if not straight

    @property
    def server(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def agents_server(self) -> str:
        return self.link_cut.url if self.link_cut is not None else self.server

    def start_server(self) -> Child:
        child = self.group.start("asgi", asgi_argv(self.port))
        self.wait_for_server()
        return child

    def wait_for_server(self) -> None:
        wait_until(
            "the ASGI server answering",
            lambda: http_up(self.server + "/api/schema/"),
            timeout_s=60,
            check=self.group.check,
        )

    def start_celery(self, *, wait: bool = True) -> Child:
        """The Celery worker; ``wait=False`` returns as it starts (``wait_for_celery`` waits), so the
        server and the agents can start meanwhile."""
        # One worker on both queues: the tests kill "the" worker mid-job and expect the job to survive.
        child = self.group.start(
            "celery", celery_argv(beat_schedule=self.state_root / "beat-schedule", queues=("celery", "jobs"))
        )
        if wait:
            self.wait_for_celery(child)
        return child

    def wait_for_celery(self, child: Child) -> None:
        wait_until(
            "the Celery worker", lambda: b"ready." in child.log_path.read_bytes(), timeout_s=90, check=self.group.check
        )

    def start_agent(self, name: str, token: str | None = None, *, python: Path | None = None) -> Child:
        """An agent on this machine; with ``python``, that interpreter's own installation of the agent
        (its package, not this checkout: run outside the repository, with no PYTHONPATH)."""
        if python is None:
            # Forked from the zygotes the group's agents share where the run forks roles (tests/conftest.py).
            zygotes = self.group.share_zygotes() if os.environ.get(SPAWN_ENV) == "fork" else None
            argv = agent_argv(
                self.agents_server, self.state_root / name, name=name, token=token, heartbeat_s=1.0, zygotes=zygotes
            )
            return self.group.start(f"agent-{name}", argv)
        argv = agent_argv(
            self.agents_server, self.state_root / name, name=name, token=token, heartbeat_s=1.0, python=str(python)
        )
        return self.group.start(f"agent-{name}", argv, env={"PYTHONPATH": None}, cwd=self.state_root)

    def wait_for(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        wait_until(what, ready, timeout_s=timeout_s, check=self.group.check)


def role_pids(state_root: Path) -> dict[str, int]:
    """{spec file: pid} of every role process run by the agents whose state lies under ``state_root``,
    found by its command line: a fresh role's arguments, or a forked role's title, which holds them
    in one string (``inference.runtime.zygote``)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").split()
        except OSError:
            continue
        if b"serve-role" in argv and b"--spec" in argv[:-1]:
            spec = argv[argv.index(b"--spec") + 1].decode()
            if spec.startswith(str(state_root)):
                found[spec] = int(proc.name)
    return found


SERVED_MODEL = "tiny-cluster"
# A live platform's ODMOE_TASK_REDELIVERY_S: a task whose Celery worker died runs again after it.
TASK_REDELIVERY_S = 5


@dataclass
class Served:
    plane: LiveControlPlane
    staff_key: str
    user_key: str
    other_key: str
    model_dir: Path

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.plane.server}/v1", api_key=key or self.user_key, max_retries=0)

    def api(self, key: str) -> Api:
        return Api(self.plane.server, key)


# --- ``manage.py up``, the command itself ---------------------------------------------------------


def on_postgres() -> bool:
    from django.db import connection

    return connection.vendor == "postgresql"


def up_env(var: Path) -> dict[str, str]:
    """``manage.py up``'s environment (and that of ``manage.py`` commands on its database)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    # Its own Redis under ``var``, as ``make run`` does, and its own SQLite there unless the suite is on PostgreSQL.
    env |= {"DATABASE_URL": database_url()} if on_postgres() else {}
    return {**env, "DJANGO_SETTINGS_MODULE": "controlplane.config.settings.local", "ODMOE_VAR_DIR": str(var)}


@contextlib.contextmanager
def manage_py_up(
    var: Path, port: int, model: Path, log: Path, *, agents: int, timeout_s: float = 300
) -> Iterator[None]:
    """``manage.py up`` with ``agents`` local agents serving ``model``, from ``odmoe ready`` to the end of
    the block; then stopped with SIGTERM, as Ctrl-C stops it. Its output goes to ``log``."""
    argv = [sys.executable, "manage.py", "up", "--port", str(port), "--agents", str(agents), "--model", str(model)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=up_env(var), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        deadline = time.monotonic() + timeout_s
        while f"odmoe ready: http://127.0.0.1:{port}/" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"manage.py up --port {port} did not get ready:\n{log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.5)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
