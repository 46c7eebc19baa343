"""A real agent process enrolls against a live control plane, then needs no token again."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.nodes.models import Node
from controlplane.nodes.services import create_join_token
from inference.runtime.launcher import free_port

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def run_agent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


def test_agent_enrolls_once_and_then_uses_its_credential(live_server, tmp_path: Path) -> None:
    _, token = create_join_token(created_by=None, name="test")
    state = tmp_path / "state"
    first = run_agent(
        "--server", live_server.url, "--token", token, "--name", "box-a", "--state-dir", str(state), "--enroll-only"
    )
    assert first.returncode == 0, first.stderr
    assert "box-a" in first.stdout
    node = Node.objects.get(name="box-a")
    assert node.inventory["cpu_count"] >= 1 and node.inventory["ram_bytes"] > 0
    credential = state / "node.json"
    assert stat.S_IMODE(credential.stat().st_mode) == 0o600
    assert token not in credential.read_text()

    again = run_agent("--server", live_server.url, "--state-dir", str(state), "--enroll-only")
    assert again.returncode == 0, again.stderr
    node.refresh_from_db()
    assert node.last_seen is not None

    reused = run_agent(
        "--server", live_server.url, "--token", token, "--name", "box-b", "--state-dir", str(tmp_path / "other")
    )
    assert reused.returncode == 1
    assert "already used" in reused.stderr
    assert Node.objects.count() == 1


def test_agent_reports_an_unreachable_server_clearly(tmp_path: Path) -> None:
    result = run_agent("--server", f"http://127.0.0.1:{free_port()}", "--token", "t", "--state-dir", str(tmp_path))
    assert result.returncode == 1
    assert "cannot reach the control plane" in result.stderr
    assert "Traceback" not in result.stderr
