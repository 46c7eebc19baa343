"""What ``deploy/`` ships for a real host, read as the host reads it: the units, the proxy, the
environment file and the hash locks. (``make prod-check`` runs them; these are the fast checks.)"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from deploy.units import (
    UNIT_DIR,
    Unit,
    UnitError,
    celery_role,
    control_plane_units,
    read_environment_file,
    read_unit,
)
from tests.paths import REPO

SETTINGS = REPO / "platform" / "controlplane" / "config" / "settings"


def units() -> dict[str, Unit]:
    return {unit.name: unit for unit in control_plane_units()}


def test_every_queue_the_settings_route_to_is_consumed_and_beat_runs_exactly_once(settings) -> None:
    """Under the shipped units every task has a worker: the default queue and every queue of
    CELERY_TASK_ROUTES (jobs too), and one beat, in a unit of its own, not inside a worker."""
    routed = {route["queue"] for route in settings.CELERY_TASK_ROUTES.values()} | {settings.CELERY_TASK_DEFAULT_QUEUE}
    roles = {name: celery_role(unit) for name, unit in units().items()}
    consumed = {queue for role in roles.values() if role and role[0].startswith("worker") for queue in role[1]}
    assert routed <= consumed, f"queues no unit consumes: {sorted(routed - consumed)}"
    beats = [name for name, role in roles.items() if role and "beat" in role[0]]
    assert beats == ["odmoe-beat.service"]
    assert roles["odmoe-beat.service"] == ("beat", [])


def test_the_web_unit_runs_two_asgi_workers_on_loopback_behind_the_proxy() -> None:
    argv = units()["odmoe-web.service"].argv
    assert Path(argv[0]).name == "uvicorn" and argv[1] == "controlplane.config.asgi:application"
    option = dict(itertools.pairwise(argv))
    assert option["--host"] == "127.0.0.1" and int(option["--workers"]) >= 2
    assert "--proxy-headers" in argv and option["--forwarded-allow-ips"] == "127.0.0.1"


@pytest.mark.parametrize("name", sorted(p.name for p in UNIT_DIR.glob("*.service")))
def test_every_control_plane_unit_runs_unprivileged_and_sandboxed(name: str) -> None:
    unit = read_unit(UNIT_DIR / name)
    assert unit.get("User") not in (None, "root") and unit.get("EnvironmentFile") == "/etc/odmoe/odmoe.env"
    sandbox = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes"}
    assert {key: unit.get(key) for key in sandbox} == sandbox
    assert unit.all("ReadWritePaths") == ["/var/lib/odmoe"] and unit.all("CapabilityBoundingSet") == []


def test_the_unit_reader_refuses_what_it_would_read_wrongly(tmp_path: Path) -> None:
    path = tmp_path / "x.service"
    path.write_text("[Service]\nExecStart=/bin/celery -A x worker --hostname a@%h\n")
    with pytest.raises(UnitError, match="specifiers"):
        _ = read_unit(path).argv
    path.write_text("[Service]\nExecStart=/bin/x \\\n  --y\n")
    with pytest.raises(UnitError, match="continuations"):
        read_unit(path)
    path.write_text("[Service]\nExecStart=/bin/celery -A x worker --hostname a@%%h\n")
    assert read_unit(path).argv[-1] == "a@%h"


def settings_variables() -> set[str]:
    found = set()
    for path in SETTINGS.glob("*.py"):
        found |= set(re.findall(r"""os\.environ(?:\.get)?\(\s*["']([A-Z][A-Z0-9_]+)["']""", path.read_text()))
        found |= set(re.findall(r"""["']([A-Z][A-Z0-9_]+)["'] (?:not )?in os\.environ""", path.read_text()))
    return found


def test_the_environment_file_template_names_every_variable_the_settings_read() -> None:
    example = (REPO / "deploy" / "odmoe.env.example").read_text()
    named = set(re.findall(r"^#?([A-Z][A-Z0-9_]+)=", example, flags=re.M))
    assert settings_variables() - named == set()
    required = read_environment_file(REPO / "deploy" / "odmoe.env.example")
    assert required["DJANGO_SETTINGS_MODULE"] == "controlplane.config.settings.production"
    assert "REDIS-PASSWORD@" in required["REDIS_URL"]  # Redis with a password, carried by the URL


def nginx_locations(text: str) -> dict[str, str]:
    return dict(re.findall(r"location (\S+) \{(.*?)\n    \}", text, flags=re.S))


def test_the_proxy_caps_bodies_as_the_app_does_and_forwards_https_and_websockets(settings) -> None:
    text = (REPO / "deploy" / "nginx" / "odmoe.conf").read_text()
    (cap,) = re.findall(r"client_max_body_size (\d+)m;", text)
    assert int(cap) * 2**20 == settings.MAX_REQUEST_BYTES == settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    locations = nginx_locations(text)
    assert set(locations) == {"/", "/ws/"}
    for body in locations.values():
        assert "proxy_set_header X-Forwarded-Proto $scheme;" in body and "proxy_set_header Host $http_host;" in body
    assert "proxy_set_header Upgrade $http_upgrade;" in locations["/ws/"]
    assert "proxy_buffering off;" in text  # SSE streams as produced
    assert re.search(r"server 127\.0\.0\.1:8000;", text)


def locked(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9._-]+)==([^ ;\\]+)", line)
        if match:
            pins[canonicalize_name(match[1])] = match[2]
    return pins


def constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


@pytest.mark.parametrize(
    "lock, requirement_files",
    [
        ("deploy/requirements.lock", ["agent/requirements.txt", "platform/requirements.txt"]),
        ("agent/requirements.lock", ["agent/requirements.txt"]),
    ],
)
def test_the_hash_locks_pin_what_constraints_pins_each_wheel_by_sha256(lock: str, requirement_files: list[str]) -> None:
    """Every package of a lock is at constraints.txt's version where that pins it, every direct
    requirement is there, and every line has its hashes (run deploy/lock.py after a change)."""
    pins, tested = locked(REPO / lock), constraints()
    drifted = {
        name: (version, tested[name]) for name, version in pins.items() if name in tested and tested[name] != version
    }
    assert drifted == {}, f"{lock} disagrees with constraints.txt (lock, constraints): run deploy/lock.py"
    for path in requirement_files:
        for line in (REPO / path).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                assert canonicalize_name(Requirement(line).name) in pins, f"{line} is not in {lock}"
    blocks = re.split(r"\n(?=[A-Za-z0-9])", (REPO / lock).read_text().split("\n\n")[-1])
    for block in blocks:
        if "==" in block:
            assert re.search(r"--hash=sha256:[0-9a-f]{64}", block), block.splitlines()[0]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_every_unit(tmp_path: Path) -> None:
    """``systemd-analyze verify`` on each unit, its paths moved to ones that exist here."""
    moved = tmp_path / "units"
    moved.mkdir()
    venv_bin = Path(shutil.which("celery") or REPO / ".venv" / "bin" / "celery").parent
    for path in UNIT_DIR.glob("*.service"):
        text = path.read_text().replace("/opt/odmoe/.venv/bin", str(venv_bin)).replace("/opt/odmoe", str(REPO))
        text = text.replace("/etc/odmoe/odmoe.env", str(REPO / "deploy" / "odmoe.env.example"))
        text = re.sub(r"^After=.*$", "After=network-online.target", text, flags=re.M)  # no PostgreSQL unit here
        (moved / path.name).write_text(text)
    run = subprocess.run(
        ["systemd-analyze", "verify", *sorted(str(p) for p in moved.glob("*.service"))],
        capture_output=True,
        text=True,
    )
    problems = [line for line in run.stderr.splitlines() if "Failed to" not in line or "Unit" not in line]
    assert run.returncode == 0 and not problems, run.stderr


def test_the_production_check_moves_every_host_path_of_the_units(tmp_path: Path) -> None:
    """What ``make prod-check`` runs for each unit: no host path left, every program there to run."""
    from deploy.prodcheck import HostPaths

    paths = HostPaths(tmp_path, web_port=18000)
    for unit in control_plane_units():
        argv = paths.argv(unit)
        assert not [w for w in argv if w.startswith(("/opt/odmoe", "/var/lib/odmoe", "/etc/odmoe"))], argv
        assert Path(argv[0]).exists(), argv[0]
    web = paths.argv(units()["odmoe-web.service"])
    assert web[web.index("--port") + 1] == "18000"


@pytest.mark.skipif(shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(), reason="no nginx")
def test_nginx_accepts_the_proxy_configuration_as_the_production_check_renders_it(tmp_path: Path) -> None:
    from deploy.prodcheck import make_certificate, render_nginx

    (tmp_path / "logs").mkdir()
    cert, key = make_certificate(tmp_path / "tls")
    root = render_nginx(tmp_path, cert, key, web_port=18000, https_port=18443, http_port=18080)
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    run = subprocess.run(
        [nginx, "-t", "-q", "-p", str(root), "-e", "stderr", "-c", str(root / "nginx.conf")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr


@pytest.mark.skipif(not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")), reason="no PostgreSQL server package")
def test_the_production_check_starts_a_postgresql_of_its_own_where_none_answers() -> None:
    """A machine with no PostgreSQL running (a user's fresh one) still runs ``make prod-check``: the
    check starts a private server (as Debian's postgres user when root), makes its database on it,
    and leaves nothing running."""
    import psycopg

    from controlplane.ops.processes import ProcessGroup
    from deploy.prodcheck import Database, private_postgres

    work = Path(tempfile.mkdtemp(prefix="odmoe-pg-"))  # not under pytest's root-only directory
    work.chmod(0o755)
    try:
        with ProcessGroup(work / "logs", {}) as group:
            url = private_postgres(group, work)
            assert not url.startswith("postgres://postgres@127.0.0.1:5432/")
            database = Database(url)
            database.create()
            with psycopg.connect(database.url) as conn:
                assert conn.execute("SELECT current_user, current_database()").fetchone() == (database.name,) * 2
            database.drop()
            server = group.children[0].process
        assert server.poll() is not None  # stopped with the group
    finally:
        shutil.rmtree(work, ignore_errors=True)
