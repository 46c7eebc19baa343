"""The one-line agent install: the script and the package the control plane serves, and a real run."""

from __future__ import annotations

import grp
import hashlib
import io
import os
import pwd
import re
import shutil
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest
from django.test import Client

import inference
from controlplane.nodes.agent_wheel import build_wheel, requirements
from controlplane.nodes.install import agent_lock, agent_wheel, package_sha256
from controlplane.nodes.models import Node
from controlplane.nodes.services import create_join_token
from controlplane.ops.processes import ProcessGroup, asgi_argv, http_up, python_env, wait_until
from deploy.units import read_unit
from inference.runtime.launcher import free_port
from tests.controlplane.isolated import (
    CONTROL_PLANE,
    NOBODY,
    as_ordinary_user,
    install_isolated,
    link_dependencies,
)
from tests.controlplane.live import database_url
from tests.paths import REPO


def test_the_install_script_is_served_with_this_server_filled_in(db, settings) -> None:
    settings.ALLOWED_HOSTS = ["cp.example"]
    response = Client().get("/agent/install.sh", HTTP_HOST="cp.example:8000")
    assert response.status_code == 200
    script = response.content.decode()
    name, _, sha256 = agent_wheel()
    assert 'SERVER="http://cp.example:8000"' in script and "@SERVER@" not in script
    assert f'AGENT_SHA256="{sha256}"' in script and f'WHEEL="{name}"' in script  # the package it installs is pinned
    package = Client().get(f"/agent/{name}", HTTP_HOST="cp.example:8000").content
    assert hashlib.sha256(package).hexdigest() == package_sha256() == sha256
    assert Client().get("/agent/odmoe_agent-0.0.1-py3-none-any.whl", HTTP_HOST="cp.example").status_code == 404
    # The dependencies' hash-locked list is pinned the same way, and every line of it carries hashes.
    lock_name, lock, lock_sha256 = agent_lock()
    assert f'LOCK="{lock_name}"' in script and f'LOCK_SHA256="{lock_sha256}"' in script and "@AGENT_LOCK" not in script
    served_lock = Client().get(f"/agent/{lock_name}", HTTP_HOST="cp.example:8000").content
    assert served_lock == lock and hashlib.sha256(served_lock).hexdigest() == lock_sha256
    assert "--require-hashes" in script and "--only-binary :all:" in script
    check = subprocess.run(["sh", "-n"], input=script, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr


def test_the_agent_package_is_a_wheel_of_the_agent_and_runtime_with_only_their_dependencies(db) -> None:
    name, data, _ = agent_wheel()
    response = Client().get(f"/agent/{name}")
    assert response.status_code == 200 and response.content == data
    assert name == f"odmoe_agent-{inference.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(io.BytesIO(data)) as wheel:
        names = wheel.namelist()
        metadata = wheel.read(f"odmoe_agent-{inference.__version__}.dist-info/METADATA").decode()
        record = wheel.read(f"odmoe_agent-{inference.__version__}.dist-info/RECORD").decode()
    assert "agent/__main__.py" in names and "inference/runtime/spec.py" in names and "agent/doctor.py" in names
    assert not [n for n in names if n.split("/")[0] not in ("agent", "inference") and ".dist-info/" not in n]
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    required = [line.removeprefix("Requires-Dist: ") for line in metadata.splitlines() if "Requires-Dist" in line]
    assert required == requirements(REPO)  # agent/requirements.txt, the one declaration
    assert not [r for r in required if r.split(">")[0].split("[")[0].lower() in CONTROL_PLANE]
    assert len(record.splitlines()) == len(names)  # every file hashed (RECORD lists itself unhashed)
    assert build_wheel(REPO) == data  # the same bytes every time: the sha256 in the script holds


def test_the_agent_package_ships_only_the_files_git_tracks(tmp_path: Path) -> None:
    """A file left untracked in agent/ or inference/ (a scratch script, a key) never reaches the boxes;
    without git, or in a folder that is not a checkout's top, the package holds what the folders hold."""

    def tree(root: Path) -> Path:
        for name, text in {
            "agent/__init__.py": "",
            "agent/requirements.txt": "numpy>=2\n",
            "agent/gone.py": "",
            "inference/__init__.py": '__version__ = "9.9.9"\n',
        }.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        return root

    def shipped(repo: Path) -> set[str]:
        with zipfile.ZipFile(io.BytesIO(build_wheel(repo))) as wheel:
            return {n for n in wheel.namelist() if ".dist-info/" not in n}

    def git(*args: str, cwd: Path) -> None:
        identity = ["-c", "user.name=test", "-c", "user.email=test@example.invalid"]
        subprocess.run(["git", *identity, *args], cwd=cwd, check=True, capture_output=True)

    repo = tree(tmp_path / "checkout")
    git("init", "-q", cwd=repo)
    git("add", "agent", "inference", cwd=repo)
    git("commit", "-q", "-m", "tracked", cwd=repo)
    (repo / "agent" / "gone.py").unlink()  # tracked, deleted in the working tree: not there to ship
    (repo / "agent" / "stray_key.py").write_text("SECRET = 'x'\n")
    (repo / "inference" / "notes.txt").write_text("scratch\n")
    assert shipped(repo) == {"agent/__init__.py", "inference/__init__.py"}
    if os.geteuid() == 0:  # production: the checkout is another user's than the server's
        for path in [repo, *repo.rglob("*")]:
            os.lchown(path, NOBODY.pw_uid, NOBODY.pw_gid)
        assert shipped(repo) == {"agent/__init__.py", "inference/__init__.py"}
    with pytest.MonkeyPatch.context() as patch:  # a checkout git cannot list: refused, never walked
        patch.setenv("PATH", str(tmp_path / "no-git-here"))
        with pytest.raises(RuntimeError, match="git cannot list its files"):
            build_wheel(repo)

    plain = tree(tmp_path / "outer" / "tarball")  # inside another repository, not its top: its folders
    git("init", "-q", cwd=tmp_path / "outer")
    (plain / "agent" / "extra.py").write_text("")
    assert shipped(plain) == {"agent/__init__.py", "agent/gone.py", "agent/extra.py", "inference/__init__.py"}


def test_the_agent_package_imports_without_any_control_plane_distribution(tmp_path: Path) -> None:
    """The wheel's files with only its dependencies' distributions: the agent and the runtime import,
    and no control-plane distribution is there to be found."""
    _, data, _ = agent_wheel()
    python = install_isolated(data, tmp_path)
    probe = (
        "import importlib.metadata as m, importlib.util as u\n"
        "names = {d.metadata['Name'].lower() for d in m.distributions()}\n"
        f"assert not names & set({sorted(CONTROL_PLANE)!r}), names\n"
        "assert all(u.find_spec(n) is None for n in ('django', 'celery', 'rest_framework', 'channels', 'matplotlib'))\n"
        "import agent.__main__, agent.link, agent.doctor\n"
        "import inference.runtime.roles.worker, inference.runtime.roles.main\n"
        "print(m.version('odmoe-agent'))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    run = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == inference.__version__


@pytest.mark.parametrize(
    "args, error",
    [
        ([], "--token is required"),
        (["--token", "t", "--server", "ftp://x"], "must be an http(s) URL"),
        (["--token", "t", "--bogus"], "unknown option --bogus"),
        (["--token", "t", "--server", "http://10.0.0.1:8000"], "refusing plain http to 10.0.0.1"),
        (["--token", "t", "--server", "http://127.example.com"], "refusing plain http to 127.example.com"),
    ],
)
def test_the_install_script_refuses_bad_arguments_before_touching_anything(db, tmp_path: Path, args, error) -> None:
    script = Client().get("/agent/install.sh").content.decode()
    run = subprocess.run(
        ["sh", "-s", "--", "--dir", str(tmp_path / "agent"), *args], input=script, text=True, capture_output=True
    )
    assert run.returncode != 0 and error in run.stderr
    assert not (tmp_path / "agent").exists()


def test_the_install_script_imports_nothing_from_the_directory_it_was_started_in(db, tmp_path: Path) -> None:
    """Python puts the current directory first on its import path for -c, -m and stdin scripts: a
    module another user left where root started the one-liner (cd /tmp) must never run."""
    script = Client().get("/agent/install.sh").content.decode()
    planted = tmp_path / "planted"
    planted.mkdir()
    marker = tmp_path / "ran"
    for module in ("venv", "ensurepip", "hashlib"):
        (planted / f"{module}.py").write_text(f"open({str(marker)!r}, 'a').write({module!r})\n")
    options = ["--server", "http://127.0.0.1:9", "--token", "t", "--dir", str(tmp_path / "agent"), "--no-service"]
    run = subprocess.run(
        ["sh", "-s", "--", *options, "--dry-run"],
        input=script,
        text=True,
        capture_output=True,
        cwd=planted,
        env={**os.environ, "PYTHON": "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert not marker.exists(), marker.read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="installs as root")
def test_as_root_a_state_kept_before_the_agent_had_a_user_moves_and_becomes_that_users(db, tmp_path: Path) -> None:
    """A box enrolled by root before the agent had a user of its own keeps its credential: the
    state moves to /var/lib/odmoe-agent and is chown'ed to the agent's user (a dry run: the plan)."""
    if Path("/var/lib/odmoe-agent/state").exists():
        pytest.skip("this machine has an agent installed as root")
    script = Client().get("/agent/install.sh").content.decode()
    home = tmp_path / "home"
    legacy = home / ".local" / "share" / "odmoe-agent" / "state"
    legacy.mkdir(parents=True)
    (legacy / "node.json").write_text("{}")
    run = subprocess.run(
        ["sh", "-s", "--", "--server", "http://127.0.0.1:9", "--no-service", "--dry-run"],
        input=script,
        text=True,
        capture_output=True,
        env={**os.environ, "HOME": str(home)},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    moved = lines.index(f"odmoe install: would run: mv {legacy} /var/lib/odmoe-agent/state")
    owned = lines.index("odmoe install: would run: chown -R odmoe-agent: /var/lib/odmoe-agent/state")
    made = next(i for i, line in enumerate(lines) if "would run: useradd" in line)
    assert moved < made < owned  # moved, the user made, then the moved files are that user's
    assert "upgrading the agent" in run.stdout  # the moved credential is kept: no token needed


@pytest.mark.slow
def test_the_one_liner_installs_the_agent_and_enrolls_the_box(transactional_db, tmp_path: Path, box: Path) -> None:
    """An ordinary user's install (run as root, the test makes it as nobody): a venv, the credential,
    the doctor, an upgrade in place, the uninstall."""
    import urllib.request

    _, token = create_join_token(created_by=None)
    port = free_port()
    server = f"http://127.0.0.1:{port}"
    env = python_env(
        DJANGO_SETTINGS_MODULE="controlplane.config.settings.test",
        DATABASE_URL=database_url(),
    )
    with ProcessGroup(tmp_path / "logs", env) as group:
        group.start("asgi", asgi_argv(port))
        wait_until("the ASGI server", lambda: http_up(server + "/api/schema/"), timeout_s=60, check=group.check)
        with urllib.request.urlopen(f"{server}/agent/install.sh") as response:
            script = response.read().decode()
        # A package that is not the one the script was served with is never installed.
        tampered = re.sub(r'AGENT_SHA256="[0-9a-f]{64}"', 'AGENT_SHA256="' + "0" * 64 + '"', script)
        refused = install(tampered, token, box / "tampered", box)
        assert refused.returncode != 0 and "does not match the sha256" in refused.stderr
        assert not (box / "tampered" / "venv" / "bin" / "odmoe-agent").exists()
        assert not Node.objects.filter(name="installed-box").exists()
        deps = box / "deps"
        deps.mkdir()
        link_dependencies(deps, requirements(REPO))  # the agent's dependencies only, no control plane
        target = box / "odmoe-agent"
        dry = install(script, token, target, deps, "--dry-run")
        assert dry.returncode == 0, dry.stdout + dry.stderr
        assert "would run:" in dry.stdout and not target.exists()  # a dry run changes nothing
        run = install(script, token, target, deps)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "start the agent with" in run.stdout and f"--server {server}" in run.stdout
        assert "python -m agent doctor" in run.stdout
        node = Node.objects.get(name="installed-box")
        credential = target / "state" / "node.json"
        assert stat.S_IMODE(credential.stat().st_mode) == 0o600
        assert (target / "venv" / "bin" / "python").exists()
        # Again, without a token: an upgrade in place that keeps the credential (and the node).
        saved = credential.read_bytes()
        again = install(script, "", target, deps)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "upgrading the agent" in again.stdout and credential.read_bytes() == saved
        assert Node.objects.filter(name="installed-box").count() == 1 and Node.objects.get(pk=node.pk)
    removed = install(script, "", target, deps, "--uninstall")
    assert removed.returncode == 0, removed.stderr
    assert not (target / "venv").exists() and credential.exists() and "kept" in removed.stdout
    purged = install(script, "", target, deps, "--uninstall", "--purge")
    assert purged.returncode == 0, purged.stderr
    assert not target.exists()


def install(
    script: str, token: str, target: Path, deps: Path, *options: str, as_root: bool = False
) -> subprocess.CompletedProcess:
    """Run the install script for ``target`` with the dependencies linked in ``deps`` (``--no-deps``:
    a box would install them from the hash-locked list); as nobody when the tests run as root,
    unless ``as_root``."""
    home = target.parent / "home"  # a throwaway home: nothing of this machine's user is touched
    env = {
        **os.environ,
        "PYTHONPATH": str(deps),
        "PYTHON": "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3",  # the box's own
        "ODMOE_JOIN_TOKEN": token,  # from the environment: not in the process list
        "HOME": str(home),
    }
    home.mkdir(exist_ok=True)
    who = {} if as_root else as_ordinary_user(home)
    service = [] if "--unit-dir" in options else ["--no-service"]
    return subprocess.run(
        ["sh", "-s", "--", "--name", "installed-box", "--dir", str(target), "--no-deps", *service, *options],
        input=script,
        text=True,
        capture_output=True,
        env=env,
        cwd=target.parent,
        timeout=600,
        **who,
    )


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="installs as root")
def test_installed_as_root_the_agent_runs_as_a_system_user_of_its_own_in_a_sandboxed_unit(
    transactional_db, tmp_path: Path, box: Path
) -> None:
    """As root the script makes a system user (in the GPU's groups), gives it the agent's state and
    nothing else, enrolls as it, and writes a unit that runs the agent, and so every runtime role
    it starts, as that user, sandboxed; systemd accepts the unit."""
    import urllib.request

    user = f"odmoe-t{os.getpid()}"
    _, token = create_join_token(created_by=None)
    port = free_port()
    server = f"http://127.0.0.1:{port}"
    env = python_env(
        DJANGO_SETTINGS_MODULE="controlplane.config.settings.test",
        DATABASE_URL=database_url(),
    )
    try:
        with ProcessGroup(tmp_path / "logs", env) as group:
            group.start("asgi", asgi_argv(port))
            wait_until("the ASGI server", lambda: http_up(server + "/api/schema/"), timeout_s=60, check=group.check)
            with urllib.request.urlopen(f"{server}/agent/install.sh") as response:
                script = response.read().decode()
            deps = box / "deps"
            deps.mkdir()
            link_dependencies(deps, requirements(REPO))
            target, units = box / "agent", box / "units"
            run = install(script, token, target, deps, "--user", user, "--unit-dir", str(units), as_root=True)
            assert run.returncode == 0, run.stdout + run.stderr
        account = pwd.getpwnam(user)
        assert account.pw_uid != 0 and account.pw_shell == "/usr/sbin/nologin"
        groups = {g.gr_name for g in grp.getgrall() if user in g.gr_mem}
        assert groups == {g for g in ("video", "render") if g in {x.gr_name for x in grp.getgrall()}}
        state, credential = target / "state", target / "state" / "node.json"
        assert (state.stat().st_uid, stat.S_IMODE(state.stat().st_mode)) == (account.pw_uid, 0o700)
        assert credential.stat().st_uid == account.pw_uid  # enrolled as the agent's user, not as root
        assert (target / "venv").stat().st_uid == 0  # the code stays root's: the agent cannot change it
        assert Node.objects.filter(name="installed-box").exists()
        unit = read_unit(units / "odmoe-agent.service")
        assert unit.argv == [
            str(target / "venv" / "bin" / "python"),
            "-m",
            "agent",
            "--server",
            server,
            "--state-dir",
            str(state),
        ]
        assert (unit.get("User"), unit.get("Group")) == (user, user)
        sandbox = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes"}
        assert {key: unit.get(key) for key in sandbox} == sandbox
        assert unit.all("ReadWritePaths") == [str(state)] and unit.environment == {"HOME": str(state)}
        if shutil.which("systemd-analyze"):
            verify = subprocess.run(
                ["systemd-analyze", "verify", str(units / "odmoe-agent.service")], capture_output=True, text=True
            )
            assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr
    finally:
        subprocess.run(["userdel", user], capture_output=True)


@pytest.mark.slow
def test_agents_from_the_agent_package_alone_enroll_and_serve_a_deployment(
    transactional_db, redis_url: str, tmp_path: Path, tiny_model: Path
) -> None:
    """Two agents run from an empty venv holding the served wheel and its dependencies only (no
    Django, Celery, DRF, Channels or matplotlib): they enroll, report their version and doctor,
    take main and a worker, and answer Transformers' tokens through the control plane."""
    from controlplane.nodes.models import Node
    from tests.controlplane.conftest import tiny_cluster
    from tests.controlplane.live import purge_stale_tasks
    from tests.reference import PROMPTS, reference_generate

    _, data, _ = agent_wheel()
    python = install_isolated(data, tmp_path / "box")
    purge_stale_tasks()
    with tiny_cluster(tmp_path, tiny_model, redis_url, agents=2, predictor="next-gate", agent_python=python) as (
        served,
        _,
    ):
        api = served.api(served.staff_key)
        (deployment,) = api.get("/api/deployments")["results"]
        body = {"prompt_ids": PROMPTS[0], "max_new_tokens": 8}
        answer = api.post(f"/api/deployments/{deployment['id']}/generate", body)
        assert answer["token_ids"] == reference_generate(tiny_model, PROMPTS[0], 8)
        agents = [c for c in served.plane.group.children if c.name.startswith("agent-")]
        assert len(agents) == 2 and all(c.process.args[0] == str(python) for c in agents)
        for node in Node.objects.all():
            assert node.inventory["agent_version"] == inference.__version__
            assert node.inventory["doctor"]["ok"] is True, node.inventory["doctor"]
