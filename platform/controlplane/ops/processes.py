"""Child processes of ``manage.py up`` and of the end-to-end tests: Redis, ASGI server, Celery, agents.

``ProcessGroup`` starts each child with its output in its own log file, tells which one
died (with the tail of its log), and stops them all — last started first, a run of agents
at once — on close, also when the parent is interrupted. Its agents may share a zygote of each
role kind (``share_zygotes``), which forks their roles with the runtime's imports done once.
The ``*_argv`` helpers say how each part is run, in one place.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from inference.runtime.launcher import die_with_parent
from inference.runtime.zygote import KINDS as ZYGOTE_KINDS

REPO_DIR = Path(__file__).resolve().parents[3]
STOP_GRACE_S = 10.0
# Agents started one after another are peers: none needs another to stop, and each takes a while
# (it stops its role first: 1 to 3 s here), so ``stop_all`` stops a run of them at once.
AGENT_PREFIX = "agent-"
REDIS_PASSWORD = re.compile(r"[A-Za-z0-9_-]{32,}")  # what redis_password makes: safe in a URL and a config line


class ChildFailed(RuntimeError):
    """A child process exited, or did not come up in time; the message has its log tail."""


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"


class ProcessGroup:
    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env
        self.children: list[Child] = []
        self.zygotes: Path | None = None  # the folder of the zygotes its agents share, once started
        log_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str | None] | None = None,
        cwd: Path | None = None,
        user: str | None = None,
    ) -> Child:
        """Start ``argv`` with the group's environment updated by ``env`` (a None value removes
        the variable), in ``cwd`` (default: the repository); as ``user`` with that user's groups
        (as systemd's ``User=`` does), when given."""
        log_path = self.log_dir / f"{name}.log"
        merged = {**self.env, **(env or {})}
        identity = {}
        if user is not None:
            account = pwd.getpwnam(user)
            groups = os.getgrouplist(user, account.pw_gid)
            identity = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": groups}
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                list(argv),
                cwd=cwd or REPO_DIR,
                env={key: value for key, value in merged.items() if value is not None},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches the parent only, which stops children in order
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
                **identity,
            )
        child = Child(name, process, log_path)
        self.children.append(child)
        return child

    def share_zygotes(self) -> Path:
        """The folder of the zygotes this group's agents share (``agent_argv(zygotes=)``), one of each
        kind (``inference.runtime.shared_zygote``), started on the first call; stopped with the group."""
        if self.zygotes is None:
            # A folder of its own (0700), short: a Unix socket's path holds at most 107 bytes.
            self.zygotes = Path(tempfile.mkdtemp(prefix="odmoe-zygotes-"))
            for kind in ZYGOTE_KINDS:
                self.start(f"zygote-{kind}", zygote_argv(kind, self.zygotes))
        return self.zygotes

    def check(self) -> None:
        """Raise ChildFailed if any child has exited."""
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise ChildFailed(
                    f"{child.name} exited with code {code}; the end of {child.log_path}:\n{child.log_tail()}"
                )

    def stop(self, child: Child, *, kill: bool = False) -> None:
        """Stop a child and whatever it started (each child leads its own process group)."""
        self.stop_together([child], kill=kill)

    def stop_together(self, children: Sequence[Child], *, kill: bool = False) -> None:
        """Stop ``children`` at once: each is signalled before any is waited for, within one grace period."""
        for child in children:
            _signal_group(child.process, signal.SIGKILL if kill else signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in children:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(child.process, signal.SIGKILL)
                child.process.wait()
            _signal_group(child.process, signal.SIGKILL)  # a grandchild left behind (Celery's beat)
            with contextlib.suppress(ValueError):
                self.children.remove(child)

    def stop_all(self) -> None:
        """Stop every child, last started first; a run of agents started one after another at once."""
        pending = list(reversed(self.children))
        while pending:
            wave = [pending.pop(0)]
            while wave[0].name.startswith(AGENT_PREFIX) and pending and pending[0].name.startswith(AGENT_PREFIX):
                wave.append(pending.pop(0))
            self.stop_together(wave)
        if self.zygotes is not None:
            shutil.rmtree(self.zygotes, ignore_errors=True)
            self.zygotes = None


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def wait_until(what: str, ready: Callable[[], bool], *, timeout_s: float, check: Callable[[], None]) -> None:
    """Poll ``ready`` until it is true; ``check`` raises if a child died meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        check()
        if time.monotonic() > deadline:
            raise ChildFailed(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.2)


# --- how each part runs --------------------------------------------------------------------


def python_env(**extra: str) -> dict[str, str]:
    """The environment of a child that imports the control plane, the agent or the runtime."""
    path = os.pathsep.join([str(REPO_DIR), str(REPO_DIR / "platform")])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def private_redis(var: Path, port: int) -> tuple[list[str], str]:
    """How ``manage.py up`` runs its own redis-server on ``port`` (argv), and the URL that reaches it.

    Redis holds the roles' keys on their way to the agents and every prompt and answer on its way
    through the channel layer, so it takes no client without its password, made once (the first
    ``up``) and kept in ``var/redis/password``. redis-server reads the password from a config file
    there, never from its command line, which every account on the machine can read (``ps``); the
    folder, with the snapshot Redis writes in it, is its owner's alone (0700), the files 0600.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise ChildFailed("Redis is needed: install redis-server (Debian: apt install redis-server) or set REDIS_URL")
    data_dir = var / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    data_dir.chmod(0o700)  # an older install's was anyone's to read, snapshot and all
    password = redis_password(data_dir / "password")
    config = data_dir / "redis.conf"
    write_private(config, redis_config(port, data_dir, password))
    return [binary, str(config)], f"redis://:{password}@127.0.0.1:{port}/0"


def redis_password(path: Path) -> str:
    """The private Redis's password: the one in ``path``, or a new one written there (0600) when
    there is none yet."""
    if not path.exists():
        write_private(path, secrets.token_urlsafe(32) + "\n")
    path.chmod(0o600)
    password = path.read_text().strip()
    if not REDIS_PASSWORD.fullmatch(password):
        raise ChildFailed(f"{path} holds no password manage.py up made: remove it, and up makes a new one")
    return password


def redis_config(port: int, data_dir: Path, password: str) -> str:
    """The private Redis's config: loopback only, its password, snapshots of its data in ``data_dir``."""
    folder = str(data_dir).replace("\\", "\\\\").replace('"', '\\"')
    return f'bind 127.0.0.1\nport {port}\ndir "{folder}"\nsave 60 1\nrequirepass {password}\n'


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner alone (made so, not narrowed after)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(fd, 0o600)  # a file that was there before keeps its mode otherwise
        out.write(text)


def redis_up(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


def asgi_argv(port: int, host: str = "127.0.0.1") -> list[str]:
    """uvicorn serving the control plane; it refuses a websocket frame past the edge's cap before
    buffering it (``MAX_REQUEST_BYTES``; the app checks it too, for servers told nothing)."""
    from django.conf import settings

    app = "controlplane.config.asgi:application"
    argv = [sys.executable, "-m", "uvicorn", app, "--host", host, "--port", str(port), "--log-level", "warning"]
    return [*argv, "--ws-max-size", str(settings.MAX_REQUEST_BYTES)]


def celery_argv(
    *, beat_schedule: Path | None, concurrency: int = 4, queues: tuple[str, ...] = ("celery",), name: str = "control"
) -> list[str]:
    """A worker on ``queues`` (threads: shard builds and pushes wait on I/O); with beat given a schedule file."""
    argv = [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "--loglevel=INFO", f"--hostname={name}@%h"]
    argv += [f"--concurrency={concurrency}", "--pool=threads", "--without-gossip", "--without-mingle"]
    argv += ["--queues", ",".join(queues)]
    if beat_schedule:
        beat_schedule.parent.mkdir(parents=True, exist_ok=True)
    return [*argv, "--beat", f"--schedule={beat_schedule}"] if beat_schedule else argv


def agent_argv(
    server: str,
    state_dir: Path,
    *,
    name: str,
    token: str | None = None,
    heartbeat_s: float = 2.0,
    python: str = sys.executable,
    zygotes: Path | None = None,
) -> list[str]:
    """An agent; with ``zygotes`` (``ProcessGroup.share_zygotes``), one whose roles fork from them."""
    argv = [python, "-m", "agent", "--server", server, "--state-dir", str(state_dir), "--name", name]
    argv += ["--heartbeat", str(heartbeat_s)]
    if zygotes is not None:
        argv += ["--role-zygotes", str(zygotes)]
    return [*argv, "--token", token] if token else argv


def zygote_argv(kind: str, folder: Path) -> list[str]:
    """The zygote of role kind ``kind`` that the agents of a group share, listening in ``folder``."""
    return [sys.executable, "-m", "inference.runtime.shared_zygote", kind, str(folder)]


def http_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # it answered
    except (urllib.error.URLError, OSError):
        return False
