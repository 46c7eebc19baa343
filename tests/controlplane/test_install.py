"""The one-line agent install: the script and the package the control plane serves, and a real run."""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
import subprocess
import sysconfig
import tarfile
from pathlib import Path

import pytest
from django.test import Client

from controlplane.nodes.install import package_sha256
from controlplane.nodes.models import Node
from controlplane.nodes.services import create_join_token
from controlplane.ops.processes import ProcessGroup, asgi_argv, http_up, python_env, wait_until
from inference.launcher import free_port


def test_the_install_script_is_served_with_this_server_filled_in(db, settings) -> None:
    settings.ALLOWED_HOSTS = ["cp.example"]
    response = Client().get("/agent/install.sh", HTTP_HOST="cp.example:8000")
    assert response.status_code == 200
    script = response.content.decode()
    assert 'SERVER="http://cp.example:8000"' in script and "@SERVER@" not in script
    assert f'AGENT_SHA256="{package_sha256()}"' in script  # the package it installs is pinned
    package = Client().get("/agent/odmoe-agent.tar.gz", HTTP_HOST="cp.example:8000").content
    assert hashlib.sha256(package).hexdigest() == package_sha256()
    check = subprocess.run(["sh", "-n"], input=script, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr


def test_the_agent_package_holds_the_agent_and_runtime_and_no_build_litter(db) -> None:
    response = Client().get("/agent/odmoe-agent.tar.gz")
    assert response.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
        names = tar.getnames()
    assert "odmoe-agent/pyproject.toml" in names and "odmoe-agent/agent/__main__.py" in names
    assert "odmoe-agent/inference/spec.py" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


@pytest.mark.parametrize(
    "args, error",
    [
        ([], "--token is required"),
        (["--token", "t", "--server", "ftp://x"], "must be an http(s) URL"),
        (["--token", "t", "--bogus"], "unknown option --bogus"),
    ],
)
def test_the_install_script_refuses_bad_arguments_before_touching_anything(db, tmp_path: Path, args, error) -> None:
    script = Client().get("/agent/install.sh").content.decode()
    run = subprocess.run(
        ["sh", "-s", "--", "--dir", str(tmp_path / "agent"), *args], input=script, text=True, capture_output=True
    )
    assert run.returncode != 0 and error in run.stderr
    assert not (tmp_path / "agent").exists()


@pytest.mark.slow
def test_the_one_liner_installs_the_agent_and_enrolls_the_box(transactional_db, tmp_path: Path) -> None:
    import urllib.request

    from django.db import connection

    _, token = create_join_token(created_by=None)
    port = free_port()
    server = f"http://127.0.0.1:{port}"
    env = python_env(
        DJANGO_SETTINGS_MODULE="controlplane.config.settings.test",
        DATABASE_URL=f"sqlite:///{connection.settings_dict['NAME']}",
    )
    with ProcessGroup(tmp_path / "logs", env) as group:
        group.start("asgi", asgi_argv(port))
        wait_until("the ASGI server", lambda: http_up(server + "/api/schema/"), timeout_s=60, check=group.check)
        with urllib.request.urlopen(f"{server}/agent/install.sh") as response:
            script = response.read().decode()
        # A package that is not the one the script was served with is never installed.
        tampered = re.sub(r'AGENT_SHA256="[0-9a-f]{64}"', 'AGENT_SHA256="' + "0" * 64 + '"', script)
        refused = install(tampered, token, tmp_path / "tampered")
        assert refused.returncode != 0 and "does not match the sha256" in refused.stderr
        assert not (tmp_path / "tampered" / "venv" / "bin" / "odmoe-agent").exists()
        assert not Node.objects.filter(name="installed-box").exists()
        run = install(script, token, tmp_path / "odmoe-agent")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "start the agent with" in run.stdout and f"--server {server}" in run.stdout
    assert Node.objects.filter(name="installed-box").exists()
    credential = tmp_path / "odmoe-agent" / "state" / "node.json"
    assert stat.S_IMODE(credential.stat().st_mode) == 0o600
    assert (tmp_path / "odmoe-agent" / "venv" / "bin" / "python").exists()


def install(script: str, token: str, target: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        # Dependencies are this test run's own (the box would download them from the package index).
        "ODMOE_PIP_ARGS": "--no-deps",
        "PYTHONPATH": sysconfig.get_paths()["purelib"],
        "PYTHON": "python3",
        "ODMOE_JOIN_TOKEN": token,  # from the environment: not in the process list
    }
    return subprocess.run(
        ["sh", "-s", "--", "--name", "installed-box", "--dir", str(target), "--no-service"],
        input=script,
        text=True,
        capture_output=True,
        env=env,
        timeout=600,
    )
