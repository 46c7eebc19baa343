r"""``make prod-check``: the production stack of ``deploy/`` on this machine, driven as its users drive it.

    python -m deploy.prodcheck [--keep] [--agents 3] [--model DIR]

Brings up, without systemd, what ``docs/production.md`` installs on a host:

- PostgreSQL: a fresh database and role on the server at ``ODMOE_PRODCHECK_POSTGRES`` (default
  ``postgres://postgres@127.0.0.1:5432/postgres``), dropped after; where none answers there, a
  private server of Debian's PostgreSQL in the work directory (``private`` forces it), so a
  machine without one runs the check too;
- a private Redis from ``deploy/redis/odmoe.conf`` with a password, which ``REDIS_URL`` carries;
- a self-signed certificate, made with the command the docs give;
- the environment file, from ``deploy/odmoe.env.example`` with this host's values;
- ``manage.py migrate``, an admin and an API key, as an operator makes them;
- every unit of ``deploy/systemd/``, each run from its own ``ExecStart=``, ``User=`` and
  ``EnvironmentFile=`` (``deploy/units.py`` reads them): the web server's 2 workers, Celery on the
  ``celery`` and ``jobs`` queues, beat;
- Debian's nginx with ``deploy/nginx/odmoe.conf`` (only addresses, ports and paths replaced);
- ``--agents`` agents, each installed by the console's one-liner for a fresh join token over
  https, pinned to the certificate's key (``ODMOE_TLS_CERT_FILE``), then run from the unit the
  install script wrote, as the user it names (as root the script makes a system user: this
  check's own, removed after).

Then it checks the edge (plain HTTP redirected, HSTS, the body cap answered by the proxy),
deploys a small model through the REST API, checks every role runs as the agents' user, and
has a chat answer over wss (and one across a restart of every web worker: killed mid-answer, the
socket connects again and gets the rest; then the same in Debian's Chromium, on the chat page, which
trusts the proxy's certificate by its key alone), a batch job run on the jobs worker, and the
official ``openai`` client stream an answer through the proxy. Everything is torn down after, on failure too; on
failure the tail of every log is printed.

What differs from a host, on purpose: the paths (``/opt/odmoe`` is this checkout, ``/var/lib/odmoe``
and ``/etc/odmoe`` a scratch directory), the ports (free ones, on 127.0.0.1), no systemd (so
the units' sandboxing is checked by ``systemd-analyze verify`` in the tests, not applied here),
the control plane running as this user, and the agents' dependencies, linked in from this
checkout's environment rather than downloaded (``--no-deps``: no PyTorch download). Nothing
trusts the certificate but by its pin: the installer and the agents run without a CA bundle
that holds it.
"""

from __future__ import annotations

import argparse
import contextlib
import http.cookiejar
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO / "platform"))

from controlplane.ops.processes import (  # noqa: E402
    ChildFailed,
    ProcessGroup,
    python_env,
    redis_up,
    wait_until,
)
from deploy.units import Unit, control_plane_units, read_environment_file, read_unit  # noqa: E402
from inference.runtime.launcher import free_port  # noqa: E402

DEPLOY = REPO / "deploy"
DEMO_MODEL = REPO / "platform" / "demo-model"
LOCAL_POSTGRES = "postgres://postgres@127.0.0.1:5432/postgres"
# The server to make the check's database on; "private" (or none answering at the default): one of
# this run's own (``private_postgres``).
POSTGRES = os.environ.get("ODMOE_PRODCHECK_POSTGRES", "")
PRIVATE = "private"
AGENT_USER = "odmoe-prodcheck"  # made by the install script when this runs as root, removed after
ADMIN = "admin"
DEPLOYMENT = "prodcheck"
PROMPT = "In Python, a dictionary"
LOG_TAIL_LINES = 25
# The box's own Python, as a box has it (not a Python under this user's home, which the agents' user cannot read).
SYSTEM_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3"


class CheckFailed(RuntimeError):
    """A check of the running stack failed; the message says what was expected and what came."""


def write_private(path: Path, text: str) -> None:
    """Write ``text`` readable by this user only from the start (a password or key in it is never
    another user's to read, not even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def step(text: str) -> None:
    print(f"· {text}", flush=True)


# --- the pieces a host has ---------------------------------------------------------------------


@dataclass
class Database:
    """A database and role of their own on the PostgreSQL server, as docs/production.md makes them."""

    admin_url: str
    name: str = field(default_factory=lambda: f"odmoe_prodcheck_{secrets.token_hex(4)}")
    password: str = field(default_factory=lambda: secrets.token_urlsafe(16))

    @property
    def url(self) -> str:
        server = urllib.parse.urlsplit(self.admin_url)
        return f"postgres://{self.name}:{self.password}@{server.hostname}:{server.port or 5432}/{self.name}"

    def _admin(self):
        import psycopg

        try:
            return psycopg.connect(self.admin_url, autocommit=True, connect_timeout=10)
        except psycopg.OperationalError as exc:
            raise CheckFailed(
                f"PostgreSQL does not answer at {self.admin_url} (set ODMOE_PRODCHECK_POSTGRES): {exc}"
            ) from None

    def create(self) -> None:
        from psycopg import sql

        with self._admin() as conn:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(self.name), self.password))
            conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(*(sql.Identifier(self.name),) * 2))

    def drop(self) -> None:
        from psycopg import sql

        with self._admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name)))
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(self.name)))


def postgres_answers(url: str) -> bool:
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=3).close()
    except psycopg.OperationalError:
        return False
    return True


def postgres_binaries() -> Path:
    """The newest ``bin/`` of Debian's PostgreSQL server packages (``/usr/lib/postgresql/N/bin``)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if not found:
        raise CheckFailed(
            "no PostgreSQL answers at 127.0.0.1:5432 and none is installed to start one: "
            "make prod-check installs Debian's postgresql (apt-get install postgresql), "
            "or set ODMOE_PRODCHECK_POSTGRES to a server's admin URL"
        )
    return found[-1].parent


def private_postgres(group: ProcessGroup, work: Path) -> str:
    """A PostgreSQL server of this run's own (initdb in ``work``, on a free port of 127.0.0.1, trust
    for its own admin only on loopback); its admin URL. It stops with the group. As root it runs as
    Debian's ``postgres`` user (the server refuses to run as root), else as this user."""
    binaries = postgres_binaries()
    user = "postgres" if os.geteuid() == 0 else None
    data, sockets = work / "postgres", work / "postgres-sockets"
    for path in (data, sockets):
        path.mkdir(mode=0o700)
        if user is not None:
            account = pwd.getpwnam(user)
            os.chown(path, account.pw_uid, account.pw_gid)
    identity = {}
    if user is not None:
        account = pwd.getpwnam(user)
        identity = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    init = subprocess.run(
        [str(binaries / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
        capture_output=True,
        text=True,
        cwd=work,
        **identity,
    )
    if init.returncode != 0:
        raise CheckFailed(f"initdb could not make a private PostgreSQL: {init.stderr[-2000:]}")
    port = free_port()
    argv = [str(binaries / "postgres"), "-D", str(data), "-p", str(port), "-k", str(sockets)]
    argv += ["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]
    group.start("postgres", argv, user=user, cwd=work)
    url = f"postgres://postgres@127.0.0.1:{port}/postgres"
    wait_until("the private PostgreSQL answering", lambda: postgres_answers(url), timeout_s=60, check=group.check)
    return url


def postgres_server(group: ProcessGroup, work: Path) -> str:
    """The admin URL of the server the check's database goes on (see ``POSTGRES``)."""
    if POSTGRES and POSTGRES != PRIVATE:
        return POSTGRES
    if not POSTGRES and postgres_answers(LOCAL_POSTGRES):
        return LOCAL_POSTGRES
    return private_postgres(group, work)


def start_redis(group: ProcessGroup, work: Path) -> str:
    """redis-server from deploy/redis/odmoe.conf, on a free port, with a password; its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise CheckFailed("redis-server is needed (Debian: apt install redis-server)")
    port, password = free_port(), secrets.token_urlsafe(24)
    data = work / "redis"
    data.mkdir()
    conf = work / "redis.conf"
    write_private(
        conf,
        f"include {DEPLOY / 'redis' / 'odmoe.conf'}\n"
        f'port {port}\ndir {data}\nrequirepass {password}\nbind 127.0.0.1\nsave ""\n',
    )
    group.start("redis", [binary, str(conf)])
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    wait_until("Redis answering", lambda: redis_up(url), timeout_s=30, check=group.check)
    if redis_up(f"redis://127.0.0.1:{port}/0"):
        raise CheckFailed("Redis answers without its password")
    return url


# The command docs/production.md gives for a self-signed certificate (with the host's names there).
CERTIFICATE_COMMAND = (
    "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -sha256 -days 825 -nodes "
    "-subj /CN={name} -addext subjectAltName={alt} -keyout {key} -out {cert}"
)


def make_certificate(tls: Path) -> tuple[Path, Path]:
    tls.mkdir()
    cert, key = tls / "odmoe.pem", tls / "odmoe.key"
    command = CERTIFICATE_COMMAND.format(name="127.0.0.1", alt="IP:127.0.0.1,DNS:localhost", key=key, cert=cert)
    run = subprocess.run(command.split(), capture_output=True, text=True)
    if run.returncode != 0:
        raise CheckFailed(f"openssl could not make the certificate: {run.stderr}")
    key.chmod(0o600)
    cert.chmod(0o644)  # public: the web workers read it for its pin (ODMOE_TLS_CERT_FILE)
    return cert, key


def write_environment(work: Path, values: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """deploy/odmoe.env.example with ``values`` in place of its own; every key must be the example's."""
    example = DEPLOY / "odmoe.env.example"
    known = set(re.findall(r"^#?([A-Z][A-Z0-9_]*)=", example.read_text(), flags=re.M))
    unknown = set(values) - known
    if unknown:
        raise CheckFailed(f"the environment file template has no {sorted(unknown)}")
    lines, done = [], set()
    for line in example.read_text().splitlines():
        key = line.removeprefix("#").split("=", 1)[0]
        if key in values and key not in done:  # a default shown commented out is set in its place
            line = f"{key}={values[key]}"
            done.add(key)
        lines.append(line)
    lines += [f"{key}={value}" for key, value in values.items() if key not in done]
    path = work / "etc" / "odmoe.env"
    path.parent.mkdir()
    write_private(path, "\n".join(lines) + "\n")
    return path, read_environment_file(path)


@dataclass
class HostPaths:
    """Where this run keeps what a host keeps under /opt/odmoe, /etc/odmoe and /var/lib/odmoe."""

    work: Path
    web_port: int

    def map(self) -> list[tuple[str, str]]:
        venv_bin = str(Path(sys.executable).parent)
        return [
            ("/opt/odmoe/.venv/bin/", venv_bin + "/"),
            ("/opt/odmoe", str(REPO)),
            ("/etc/odmoe/odmoe.env", str(self.work / "etc" / "odmoe.env")),
            ("/var/lib/odmoe", str(self.work / "var")),
        ]

    def move(self, word: str) -> str:
        for host, here in self.map():
            if word == host or word.startswith(host if host.endswith("/") else host + "/"):
                return here + word[len(host) :]
        return word

    def argv(self, unit: Unit) -> list[str]:
        argv = [self.move(word) for word in unit.argv]
        for i, word in enumerate(argv[:-1]):
            if word == "--port":
                argv[i + 1] = str(self.web_port)
        return argv


def unit_environment(unit: Unit, paths: HostPaths) -> dict[str, str]:
    env: dict[str, str] = {}
    for file in unit.all("EnvironmentFile"):
        env.update(read_environment_file(Path(paths.move(file.lstrip("-")))))
    env.update(unit.environment)
    return env


def render_nginx(work: Path, cert: Path, key: Path, web_port: int, https_port: int, http_port: int) -> Path:
    """deploy/nginx/odmoe.conf with this run's addresses, ports and certificate, in an nginx.conf of its own."""
    site = (DEPLOY / "nginx" / "odmoe.conf").read_text()
    replacements = [
        (r"server 127\.0\.0\.1:8000;", f"server 127.0.0.1:{web_port};"),
        (r"listen 443 ssl;", f"listen 127.0.0.1:{https_port} ssl;"),
        (r"listen 80;", f"listen 127.0.0.1:{http_port};"),
        (r"\n\s*listen \[::\]:\d+( ssl)?;", ""),
        (r"server_name odmoe\.example\.lan;", "server_name 127.0.0.1 localhost;"),
        (r"ssl_certificate /etc/odmoe/tls/odmoe\.pem;", f"ssl_certificate {cert};"),
        (r"ssl_certificate_key /etc/odmoe/tls/odmoe\.key;", f"ssl_certificate_key {key};"),
    ]
    for pattern, value in replacements:
        site, count = re.subn(pattern, value, site)
        if count == 0:
            raise CheckFailed(f"deploy/nginx/odmoe.conf no longer has {pattern!r}: update deploy/prodcheck.py")
    root = work / "nginx"
    root.mkdir()
    (root / "odmoe.conf").write_text(site)
    user = "user www-data;" if os.geteuid() == 0 else ""  # Debian's nginx user (root's default, nobody, has no group)
    temp = "\n".join(
        f"    {kind}_temp_path {root / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (root / "nginx.conf").write_text(
        f"{user}\nworker_processes 2;\ndaemon off;\npid {root / 'nginx.pid'};\n"
        f"error_log {work / 'logs' / 'nginx-error.log'} warn;\nevents {{ worker_connections 4096; }}\n"
        f"http {{\n    access_log {work / 'logs' / 'nginx-access.log'};\n{temp}\n"
        f"    include {root / 'odmoe.conf'};\n}}\n"
    )
    return root


# --- talking to it ------------------------------------------------------------------------------


class Client:
    """HTTPS to the stack through its proxy, trusting its certificate; a cookie jar for the browser's session."""

    def __init__(self, server: str, cert: Path, key: str = "") -> None:
        self.server, self.key = server, key
        self.context = ssl.create_default_context(cafile=str(cert))
        self.cookies = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPSHandler(context=self.context),
            urllib.request.HTTPCookieProcessor(self.cookies),
            NoRedirect(),
        )

    def request(
        self, method: str, path: str, body: dict | bytes | None = None, *, headers: dict | None = None
    ) -> tuple[int, dict, bytes]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        request = urllib.request.Request(self.server + path, data=data, method=method, headers=headers or {})
        if isinstance(body, dict):
            request.add_header("Content-Type", "application/json")
        if self.key:
            request.add_header("Authorization", f"Bearer {self.key}")
        try:
            with self.opener.open(request, timeout=60) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()
        except (urllib.error.URLError, OSError) as exc:  # not answering (yet): status 0, and why
            return 0, {}, str(getattr(exc, "reason", exc)).encode()

    def json(self, method: str, path: str, body: dict | None = None, expect: int = 200) -> dict:
        status, _, data = self.request(method, path, body)
        if status != expect:
            raise CheckFailed(f"{method} {path}: expected {expect}, got {status}: {data[:500]!r}")
        return json.loads(data)

    def cookie(self, name: str) -> str:
        return next((c.value for c in self.cookies if c.name == name), "")


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # a redirect is an answer to check, not to follow
        return None


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float, check: Callable[[], None]) -> float:
    started = time.monotonic()
    wait_until(what, ready, timeout_s=timeout_s, check=check)
    return time.monotonic() - started


# --- the stack ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """What the operator's setup made: the environment (and its file), the admin's password, an API key."""

    env_file: Path
    env: dict[str, str]
    password: str
    api_key: str


@dataclass
class Stack:
    """A running production stack: where it answers, and what drives it."""

    work: Path
    group: ProcessGroup
    server: str
    plain_server: str
    cert: Path
    env: dict[str, str]
    env_file: Path
    admin_password: str
    api: Client
    agent_pids: dict[str, int] = field(default_factory=dict)
    made_user: bool = False

    @property
    def pin(self) -> str:
        """The certificate's key as curl's --pinnedpubkey takes it (what join tokens carry)."""
        from agent.tls import pin_of_pem

        return pin_of_pem(self.cert.read_bytes())

    def check(self) -> None:
        self.group.check()

    def deps_dir(self) -> Path:
        """The agent's dependencies linked from this checkout's environment (no download), readable by all."""
        from controlplane.nodes.agent_wheel import requirements
        from tests.controlplane.isolated import link_dependencies

        deps = self.work / "agent-deps"
        if not deps.exists():
            deps.mkdir()
            link_dependencies(deps, requirements(REPO))
        return deps

    def join(self, names: list[str]) -> list[str]:
        """Install one agent per name through the console's one-liner for a fresh join token each,
        then run each from the unit the script wrote, as its user; the node ids."""
        deps = self.deps_dir()
        boxes = self.work / "boxes"
        boxes.mkdir(exist_ok=True, mode=0o755)
        commands = {}
        for name in names:
            token = self.api.json("POST", "/api/join-tokens", {"name": name, "ttl_s": 600}, expect=201)
            commands[name] = token["install_command"]
            if f"--pinnedpubkey '{self.pin}'" not in commands[name] or not commands[name].startswith("curl "):
                raise CheckFailed(f"the console's one-liner does not pin the proxy's key {self.pin}: {commands[name]}")
        results: dict[str, subprocess.CompletedProcess] = {}

        def install(name: str) -> None:
            box = boxes / name
            options = ["--name", name, "--dir", str(box), "--unit-dir", str(box / "unit"), "--no-deps"]
            if os.geteuid() == 0:
                options += ["--user", AGENT_USER]
            # No CA bundle of ours: the one-liner pins the proxy's key (curl --pinnedpubkey) and
            # passes the pin to the agent, which pins it for every request and its link.
            env = {
                **os.environ,
                "PYTHONPATH": str(deps),
                "PYTHON": SYSTEM_PYTHON,
                "HOME": str(box / "home"),
            }
            (box / "home").mkdir(parents=True)
            with (self.work / "logs" / f"install-{name}.log").open("wb") as log:
                results[name] = subprocess.run(
                    ["sh", "-c", commands[name] + " " + " ".join(options)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=600,
                    cwd=box,
                )

        if os.geteuid() == 0:
            self.made_user = subprocess.run(["id", AGENT_USER], capture_output=True).returncode != 0
        threads = [threading.Thread(target=install, args=(name,)) for name in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for name, run in results.items():
            if run.returncode != 0:
                log = (self.work / "logs" / f"install-{name}.log").read_text(errors="replace")
                raise CheckFailed(f"the one-liner failed for {name} (exit {run.returncode}):\n{log[-3000:]}")
        for name in names:
            unit = read_unit(boxes / name / "unit" / "odmoe-agent.service")
            env = {**unit.environment, "PYTHONPATH": str(deps)}
            child = self.group.start(f"agent-{name}", unit.argv, env=env, cwd=boxes / name, user=unit.get("User"))
            self.agent_pids[name] = child.process.pid
        nodes = {}

        def online() -> bool:
            listed = self.api.json("GET", "/api/nodes?limit=1000")["results"]
            nodes.update({n["name"]: n["id"] for n in listed if n["name"] in names and n["status"] == "online"})
            return len(nodes) == len(names)

        wait_for(f"{len(names)} agents online", online, 180, self.check)
        return [nodes[name] for name in names]

    def deploy(self, model_dir: Path, node_ids: list[str], name: str = DEPLOYMENT) -> dict:
        model = self.api.json("POST", "/api/models", {"name": name, "path": str(model_dir)}, expect=201)
        body = {"name": name, "model": model["id"], "nodes": node_ids}
        deployment = self.api.json("POST", "/api/deployments", body, expect=201)
        self.api.json("POST", f"/api/deployments/{deployment['id']}/start", expect=202)
        seen = {}

        def ready() -> bool:
            seen.update(self.api.json("GET", f"/api/deployments/{deployment['id']}"))
            if seen["status"] == "failed":
                raise CheckFailed(f"the deployment failed: {seen.get('status_reason')}")
            return seen["status"] == "ready"

        wait_for("the deployment ready", ready, 300, self.check)
        return seen

    def stop_deployments(self) -> None:
        with contextlib.suppress(Exception):
            for deployment in self.api.json("GET", "/api/deployments?limit=1000")["results"]:
                if deployment["status"] in ("deploying", "ready", "degraded"):
                    self.api.request("POST", f"/api/deployments/{deployment['id']}/stop")


def manage(env: dict[str, str], *args: str, stdin: str | None = None) -> str:
    run = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        input=stdin,
        timeout=300,
    )
    if run.returncode != 0:
        raise CheckFailed(f"manage.py {' '.join(args)} failed:\n{run.stdout[-2000:]}{run.stderr[-3000:]}")
    return run.stdout


def operator_setup(work: Path, database: Database, redis_url: str, cert: Path, settings: dict[str, str]) -> Setup:
    """The environment file an operator writes, then migrate, the admin and an API key by manage.py."""
    env_file, env = write_environment(
        work,
        {
            "DJANGO_SECRET_KEY": secrets.token_urlsafe(48),
            "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
            "DATABASE_URL": database.url,
            "REDIS_URL": redis_url,
            "ODMOE_VAR_DIR": str(work / "var"),
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")]),
            "ODMOE_TLS_CERT_FILE": str(cert),
            **settings,
        },
    )
    step("migrating, creating the admin and an API key (manage.py, as an operator does)")
    manage(env, "migrate", "--noinput")
    password = secrets.token_urlsafe(18)
    manage({**env, "DJANGO_SUPERUSER_PASSWORD": password}, "createsuperuser", "--noinput",
           "--username", ADMIN, "--email", "admin@example.org")  # fmt: skip
    key_clear = manage(env, "create_api_key", ADMIN, "--name", "prodcheck").strip().splitlines()[-1]
    return Setup(env_file, env, password, key_clear)


def start_control_plane(group: ProcessGroup, paths: HostPaths) -> None:
    """Each systemd unit of the control plane, started as its unit says (its paths moved under work)."""
    units = control_plane_units()
    for unit in units:
        argv = paths.argv(unit)
        name = unit.name.removesuffix(".service")
        cwd = Path(paths.move(unit.get("WorkingDirectory") or str(REPO)))
        # The control plane runs as this user here (User= names the host's odmoe).
        group.start(name, argv, env={**unit_environment(unit, paths), "PYTHONUNBUFFERED": "1"}, cwd=cwd)
    step("started " + ", ".join(u.name for u in units))


def start_nginx(group: ProcessGroup, work: Path, tls: tuple[Path, Path], ports: tuple[int, int, int]) -> None:
    """Debian's nginx with the shipped site, TLS with ``tls`` (certificate, key), on ``ports`` (web, https, http)."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise CheckFailed("nginx is needed: make prod-check installs Debian's nginx (apt-get install nginx)")
    root = render_nginx(work, *tls, *ports)
    test = subprocess.run([nginx, "-t", "-q", "-p", str(root), "-e", "stderr", "-c", str(root / "nginx.conf")],
                          capture_output=True, text=True)  # fmt: skip
    if test.returncode != 0:
        raise CheckFailed(f"nginx refuses the configuration: {test.stderr}")
    group.start("nginx", [nginx, "-p", str(root), "-e", "stderr", "-c", str(root / "nginx.conf")])


def tear_down(group: ProcessGroup, stack: Stack | None, database: Database | None) -> None:
    """The deployments stopped, then the agents, then the rest in the reverse of their start; the
    database dropped before a private PostgreSQL stops; the agents' system user removed if made."""
    if stack is not None:
        stack.stop_deployments()
    for child in [c for c in group.children if c.name.startswith("agent-")]:
        group.stop(child)
    for child in reversed([c for c in group.children if c.name != "postgres"]):
        group.stop(child)
    if database is not None:
        with contextlib.suppress(Exception):
            database.drop()
    group.stop_all()  # a private PostgreSQL last, once its database is dropped
    if stack is not None and stack.made_user:
        subprocess.run(["userdel", AGENT_USER], capture_output=True)


@contextlib.contextmanager
def production_stack(work: Path, *, keep: bool = False, settings: dict[str, str] | None = None) -> Iterator[Stack]:
    """The whole stack up (see the module's docstring), with ``settings`` in its environment file;
    everything stopped and removed on leaving."""
    work.chmod(0o755)  # the agents' user reaches its box under it
    (work / "logs").mkdir()
    group = ProcessGroup(work / "logs", {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")})
    database: Database | None = None
    stack = None
    failed = True
    try:
        step(f"work directory {work}")
        database = Database(postgres_server(group, work))
        database.create()
        step(f"PostgreSQL database {database.name} on {urllib.parse.urlsplit(database.admin_url).netloc}")
        redis_url = start_redis(group, work)
        step("Redis with a password")
        cert, key = make_certificate(work / "etc-tls")
        web_port, https_port, http_port = free_port(), free_port(), free_port()
        paths = HostPaths(work, web_port)
        (work / "var").mkdir()
        setup = operator_setup(work, database, redis_url, cert, settings or {})
        start_control_plane(group, paths)
        start_nginx(group, work, (cert, key), (web_port, https_port, http_port))
        server = f"https://127.0.0.1:{https_port}"
        api = Client(server, cert, setup.api_key)
        took = wait_for(
            "the control plane answering through the proxy",
            lambda: api.request("GET", "/api/schema/")[0] == 200,
            120,
            group.check,
        )
        step(f"answering over https through nginx after {took:.1f} s")
        stack = Stack(
            work, group, server, f"http://127.0.0.1:{http_port}", cert, setup.env, setup.env_file, setup.password, api
        )
        yield stack
        failed = False
    except BaseException:
        print_log_tails(group)
        raise
    finally:
        step("tearing down")
        tear_down(group, stack, database)
        if keep or failed:
            step(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def print_log_tails(group: ProcessGroup) -> None:
    for log in sorted(group.log_dir.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        print(f"\n--- the end of {log.name} ---", file=sys.stderr)
        print("\n".join(lines) or "(empty)", file=sys.stderr)


# --- the checks ---------------------------------------------------------------------------------


def check_edge(stack: Stack) -> None:
    """Plain HTTP is sent to HTTPS; HTTPS answers carry HSTS; the proxy refuses a body over the app's cap."""
    plain = Client(stack.plain_server, stack.cert)
    status, headers, _ = plain.request("GET", "/chat/")
    if status != 301 or not headers.get("Location", "").startswith("https://"):
        raise CheckFailed(f"plain HTTP answered {status} {headers.get('Location')}, not a redirect to https")
    status, headers, _ = stack.api.request("GET", "/accounts/login/")
    if status != 200 or "max-age=" not in headers.get("Strict-Transport-Security", ""):
        raise CheckFailed(f"the login page over https: {status}, HSTS {headers.get('Strict-Transport-Security')!r}")
    cap = int(stack.env.get("ODMOE_MAX_REQUEST_BYTES") or 16 * 2**20)  # the app's, as its settings read it
    json_body = {"Content-Type": "application/json"}
    big = b'{"prompt": "' + b"x" * cap + b'"}'
    status, _, data = stack.api.request("POST", "/api/jobs", big, headers=json_body)
    if status != 413 or b"nginx" not in data:
        raise CheckFailed(f"a body over the cap got {status} (expected the proxy's 413): {data[:200]!r}")
    # A body under the cap goes through to the app, which answers it (here: no such model).
    under = b'{"model": "none", "prompt": "' + b"x" * (cap // 4) + b'"}'
    status, _, data = stack.api.request("POST", "/api/jobs", under, headers=json_body)
    if status in (0, 413) or b"nginx" in data:
        raise CheckFailed(f"a body of a quarter of the cap did not reach the app: {status} {data[:200]!r}")
    step(
        f"edge: plain HTTP redirected to https, HSTS sent, a body over the app's {cap >> 20} MiB cap refused "
        f"by the proxy (413), one under it answered by the app ({status})"
    )


def check_roles_run_as_the_agents_user(stack: Stack) -> None:
    """Every agent, and every runtime role under it, runs as the unprivileged user its unit names."""
    expected = os.geteuid() if os.geteuid() != 0 else int(subprocess.check_output(["id", "-u", AGENT_USER]))
    found = []
    for name, pid in stack.agent_pids.items():
        for process in [pid, *descendants(pid)]:
            with contextlib.suppress(FileNotFoundError):
                status = Path(f"/proc/{process}/status").read_text()
                uid = int(re.search(r"^Uid:\s+(\d+)", status, flags=re.M)[1])
                command = Path(f"/proc/{process}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
                found.append((name, process, uid, command))
    roles = [f for f in found if "serve-role" in f[3] or "inference" in f[3]]
    wrong = [f for f in found if f[2] != expected]
    if wrong or not roles:
        raise CheckFailed(f"processes not running as uid {expected}: {wrong}; roles found: {roles}")
    step(f"{len(found)} agent and role processes all run as uid {expected}" + (f" ({AGENT_USER})" if expected else ""))


def web_workers(supervisor: int) -> list[int]:
    """The worker processes of uvicorn's supervisor (multiprocessing's spawned children, not its
    resource tracker)."""
    found = []
    for pid in descendants(supervisor):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def login(stack: Stack) -> Client:
    """The admin logs in through the login form, as a browser does (CSRF cookie, Referer, Origin)."""
    browser = Client(stack.server, stack.cert)
    status, _, _ = browser.request("GET", "/accounts/login/")
    form = urllib.parse.urlencode(
        {"username": ADMIN, "password": stack.admin_password, "csrfmiddlewaretoken": browser.cookie("csrftoken")}
    ).encode()
    headers = {
        "Content-Type": "application/x-www-form-urlencoded",
        "Referer": stack.server + "/accounts/login/",
        "Origin": stack.server,
    }
    status, _, data = browser.request("POST", "/accounts/login/", form, headers=headers)
    if status != 302 or not browser.cookie("sessionid"):
        raise CheckFailed(f"logging in through the form answered {status}: {data[:300]!r}")
    return browser


def check_chat_over_wss(stack: Stack) -> None:
    import asyncio

    from websockets.asyncio.client import connect

    browser = login(stack)
    url = stack.server.replace("https://", "wss://", 1) + "/ws/chat/"

    async def chat() -> tuple[str, dict]:
        context = ssl.create_default_context(cafile=str(stack.cert))
        cookie = f"sessionid={browser.cookie('sessionid')}"
        async with connect(url, ssl=context, additional_headers={"Cookie": cookie}, origin=stack.server,
                           open_timeout=20, proxy=None) as ws:  # fmt: skip
            await ws.send(json.dumps({"type": "send", "conversation": None, "content": PROMPT, "max_tokens": 12}))
            text = ""
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), timeout=180))
                if event.get("type") == "token":
                    text += event["text"]
                elif event.get("type") == "done":
                    return text, event

    text, done = asyncio.run(chat())
    if done.get("status") != "complete" or not text or text != done.get("content"):
        raise CheckFailed(f"the chat over wss ended {done.get('status')!r} with {text!r} (done: {done})")
    step(f"chat over wss: {len(text)} characters streamed, {text!r}")


def check_chat_survives_its_web_workers_restart(stack: Stack) -> None:
    """Every web worker killed mid-answer (uvicorn's supervisor starts them again): the chat socket
    closes; connected again, as the page does, it asks for the rest from its last piece and gets the
    whole answer (``controlplane.chat.writer``: a page takes over an answer whose writer died)."""
    import asyncio

    from websockets.asyncio.client import connect

    browser = login(stack)
    url = stack.server.replace("https://", "wss://", 1) + "/ws/chat/"
    context = ssl.create_default_context(cafile=str(stack.cert))
    headers = {"Cookie": f"sessionid={browser.cookie('sessionid')}"}
    web = next(child for child in stack.group.children if child.name == "odmoe-web")
    workers = web_workers(web.process.pid)

    async def receive(ws) -> dict:
        return json.loads(await asyncio.wait_for(ws.recv(), timeout=180))

    async def chat() -> tuple[str, list[dict], dict, float]:
        async with connect(url, ssl=context, additional_headers=headers, origin=stack.server,
                           open_timeout=20, proxy=None) as ws:  # fmt: skip
            await ws.send(json.dumps({"type": "send", "conversation": None, "content": PROMPT, "max_tokens": 96}))
            answer = (await receive(ws))["answer"]
            first = await receive(ws)
            while first.get("type") != "token":
                first = await receive(ws)
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        killed, shown = time.monotonic(), [first]
        while True:  # as the page does: connect again, ask for the rest
            try:
                async with connect(url, ssl=context, additional_headers=headers, origin=stack.server,
                                   open_timeout=20, proxy=None) as ws:  # fmt: skip
                    after = shown[-1]["index"] + 1
                    await ws.send(json.dumps({"type": "resume", "answer": answer, "after": after}))
                    while (event := await receive(ws)).get("type") != "done":
                        if event.get("type") == "token":
                            shown.append(event)
                        elif event.get("type") == "error":
                            raise CheckFailed(f"the resumed chat answered an error: {event}")
                    return answer, shown, event, time.monotonic() - killed
            except (TimeoutError, OSError) as exc:
                if time.monotonic() - killed > 120:
                    raise CheckFailed(f"the chat could not connect again after its web workers died: {exc}") from exc
                await asyncio.sleep(1.0)

    answer, shown, done, took = asyncio.run(chat())
    text = "".join(event["text"] for event in shown)
    indices = [event["index"] for event in shown]
    if done.get("status") != "complete" or text != done.get("content") or indices != sorted(set(indices)):
        raise CheckFailed(f"the chat across its web workers' restart ended {done} after {text!r}")
    restarted = [pid for pid in web_workers(web.process.pid) if pid not in workers]
    step(
        f"chat across a restart of {len(workers)} web workers (now {restarted}): answer {answer} whole "
        f"({len(text)} characters, pieces {indices[0]}..{indices[-1]}) {took:.1f} s after the kill"
    )


def check_chat_in_chromium_across_its_web_workers_restart(stack: Stack) -> None:
    """The chat page in Debian's Chromium, which trusts the proxy's certificate by its key alone (as the
    agents do): a question asked, every web worker killed once the answer shows, and the whole answer
    on the page once it has connected again, marked as carried across the restart."""
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        raise CheckFailed("the chat's browser check needs Chromium: make prod-check installs Debian's")
    pin = stack.pin.removeprefix("sha256//")
    args = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        f"--ignore-certificate-errors-spki-list={pin}",
    ]
    web = next(child for child in stack.group.children if child.name == "odmoe-web")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=args, headless=True)
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(stack.server + "/accounts/login/")
            page.fill("input[name=username]", ADMIN)
            page.fill("input[name=password]", stack.admin_password)
            page.click("button[type=submit]")
            page.wait_for_url("**/chat/")
            for asked in range(3):  # an answer that ends before the kill tests nothing: ask another
                page.fill("#prompt", f"{PROMPT} ({asked + 1})")
                page.wait_for_selector("#send:enabled")
                page.click("#send")
                showing = f"document.querySelectorAll('li.message.assistant')[{asked}].innerText.length > 0"
                page.wait_for_function(showing, polling=20)
                workers = web_workers(web.process.pid)
                for pid in workers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                answer = page.locator("li.message.assistant").nth(asked)
                page.wait_for_function(
                    f"!document.querySelectorAll('li.message.assistant')[{asked}].classList.contains('streaming')",
                    timeout=120_000,
                )
                took, classes = time.monotonic() - killed, answer.get_attribute("class") or ""
                text, figures = answer.locator(".content").inner_text(), answer.locator(".figures").inner_text()
                if "carried across a server restart" in figures:
                    break
                wait_for("the web workers answering again", lambda: stack.api.request("GET", "/api/schema/")[0] == 200,
                         60, stack.check)  # fmt: skip
            page.screenshot(path=str(stack.work / "logs" / "chat-restart.png"))
        finally:
            browser.close()
    if "complete" not in classes or not text or "carried across a server restart" not in figures:
        raise CheckFailed(f"the chat page across its web workers' restart ended {classes!r}: {figures!r}, {text!r}")
    step(
        f"chat in Chromium across a restart of {len(workers)} web workers: the whole answer on the page "
        f"({len(text)} characters) {took:.1f} s after the kill ({figures})"
    )


def check_job(stack: Stack, deployment: str) -> None:
    job = stack.api.json("POST", "/api/jobs", {"model": deployment, "prompts": [PROMPT], "max_tokens": 8}, 201)
    seen = {}

    def ended() -> bool:
        seen.update(stack.api.json("GET", f"/api/jobs/{job['id']}"))
        return seen["status"] in ("succeeded", "failed", "cancelled")

    took = wait_for("the job to end", ended, 180, stack.check)
    if seen["status"] != "succeeded":
        raise CheckFailed(f"the job ended {seen['status']}: {seen}")
    jobs_log = (stack.group.log_dir / "odmoe-jobs.log").read_text(errors="replace")
    if "controlplane.serving.tasks" not in jobs_log:
        raise CheckFailed("the job succeeded, but odmoe-jobs' log shows no serving task")
    step(f"job: succeeded in {took:.1f} s, run by the jobs queue's worker (odmoe-jobs)")


def check_openai(stack: Stack, deployment: str) -> None:
    import openai

    http_client = openai.DefaultHttpx2Client(verify=ssl.create_default_context(cafile=str(stack.cert)))
    client = openai.OpenAI(
        base_url=stack.server + "/v1", api_key=stack.api.key, max_retries=0, timeout=180, http_client=http_client
    )
    models = [m.id for m in client.models.list()]
    if deployment not in models:
        raise CheckFailed(f"/v1/models lists {models}, not {deployment}")
    stream = client.chat.completions.create(
        model=deployment, messages=[{"role": "user", "content": PROMPT}], max_tokens=8, stream=True
    )
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    if not "".join(pieces) or finish is None:
        raise CheckFailed(f"the OpenAI stream gave {pieces!r}, finish {finish!r}")
    step(f"OpenAI client: {len(pieces)} chunks streamed over SSE through the proxy, finish {finish!r}")


def run_checks(stack: Stack, agents: int, model: Path) -> None:
    check_edge(stack)
    names = [f"prodcheck-{i}" for i in range(agents)]
    started = time.monotonic()
    node_ids = stack.join(names)
    step(
        f"{agents} agents installed by the one-liner (curl pinned to {stack.pin[:19]}…) over https and online "
        f"in {time.monotonic() - started:.1f} s"
    )
    started = time.monotonic()
    deployment = stack.deploy(model, node_ids)
    step(f"deployment {deployment['name']} ready in {time.monotonic() - started:.1f} s")
    check_roles_run_as_the_agents_user(stack)
    check_chat_over_wss(stack)
    check_chat_survives_its_web_workers_restart(stack)
    check_chat_in_chromium_across_its_web_workers_restart(stack)
    check_job(stack, deployment["name"])
    check_openai(stack, deployment["name"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=3, help="agents to install and deploy on (at least 3)")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL, help="the checkpoint deployed (default: demo)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, certificate)")
    args = parser.parse_args(argv)
    if args.agents < 3:
        parser.error("--agents must be at least 3 (main, shadow and a worker)")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="odmoe-prodcheck-"))
    os.environ.update(python_env())
    try:
        with production_stack(work, keep=args.keep) as stack:
            run_checks(stack, args.agents, args.model.resolve())
    except (CheckFailed, ChildFailed) as exc:
        print(f"prod-check FAILED after {time.monotonic() - started:.0f} s: {exc}", file=sys.stderr)
        return 1
    print(f"prod-check passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
