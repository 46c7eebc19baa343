"""A control plane running for real, for end-to-end tests: ASGI server, Celery worker with beat,
agents, all as separate processes on 127.0.0.1 against the test database and Redis."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from controlplane.ops.processes import Child, ProcessGroup, agent_argv, asgi_argv, celery_argv, http_up, wait_until


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

    @property
    def server(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_server(self) -> Child:
        child = self.group.start("asgi", asgi_argv(self.port))
        wait_until(
            "the ASGI server answering",
            lambda: http_up(self.server + "/api/schema/"),
            timeout_s=60,
            check=self.group.check,
        )
        return child

    def start_celery(self) -> Child:
        # One worker on both queues: the tests kill "the" worker mid-job and expect the job to survive.
        child = self.group.start(
            "celery", celery_argv(beat_schedule=self.state_root / "beat-schedule", queues=("celery", "jobs"))
        )
        wait_until(
            "the Celery worker", lambda: b"ready." in child.log_path.read_bytes(), timeout_s=90, check=self.group.check
        )
        return child

    def start_agent(self, name: str, token: str | None = None, *, python: Path | None = None) -> Child:
        """An agent on this machine; with ``python``, that interpreter's own installation of the agent
        (its package, not this checkout: run outside the repository, with no PYTHONPATH)."""
        if python is None:
            argv = agent_argv(self.server, self.state_root / name, name=name, token=token, heartbeat_s=1.0)
            return self.group.start(f"agent-{name}", argv)
        argv = agent_argv(
            self.server, self.state_root / name, name=name, token=token, heartbeat_s=1.0, python=str(python)
        )
        return self.group.start(f"agent-{name}", argv, env={"PYTHONPATH": None}, cwd=self.state_root)

    def wait_for(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        wait_until(what, ready, timeout_s=timeout_s, check=self.group.check)


SERVED_MODEL = "tiny-cluster"


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
