"""TLS end to end with real processes: uvicorn serving TLS itself (as the proxy would), Redis, agents
and the install one-liner. A box enrolls over pinned https, links over wss, downloads a shard,
follows a renewed certificate and refuses another key before anything is sent."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent import credentials
from agent.tls import probe_certificate
from controlplane.artifacts.services import build_model_shards, register_model
from controlplane.nodes.agent_wheel import requirements
from controlplane.nodes.models import JoinToken, Node, NodeStatus, NodeTask, TaskState
from controlplane.nodes.services import create_join_token, request_fetch
from controlplane.nodes.tls import enroll_commands
from controlplane.ops.processes import Child, ProcessGroup, agent_argv, python_env, wait_until
from inference.modelio.shards import verify_shard
from inference.runtime.launcher import free_port
from inference.wire.link import LINK_PATH
from tests.certificates import ServerIdentity, server_identity
from tests.controlplane.isolated import as_ordinary_user, link_dependencies
from tests.controlplane.live import database_url
from tests.paths import REPO

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def start_tls_server(group: ProcessGroup, port: int, identity: ServerIdentity, name: str) -> Child:
    """The control plane under uvicorn presenting ``identity``, its access log in ``name``'s log."""
    argv = [sys.executable, "-m", "uvicorn", "controlplane.config.asgi:application", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--log-level", "info", "--ssl-certfile", str(identity.cert_path)]
    child = group.start(name, [*argv, "--ssl-keyfile", str(identity.key_path)])
    wait_until(f"{name} serving TLS", lambda: _handshakes(port), timeout_s=60, check=group.check)
    return child


def _handshakes(port: int) -> bool:
    try:
        probe_certificate(f"https://127.0.0.1:{port}", timeout_s=2)
    except OSError:
        return False
    return True


def requests_in(log: Path) -> list[str]:
    """The HTTP requests and websockets uvicorn's access log shows."""
    return re.findall(r'"(?:GET|POST|PUT|PATCH|DELETE|HEAD|WebSocket) [^"]*"', log.read_text())


def wait_for(what: str, ready, group: ProcessGroup, timeout_s: float = 60) -> None:
    wait_until(what, ready, timeout_s=timeout_s, check=group.check)


def test_a_box_enrolls_over_pinned_https_links_over_wss_downloads_and_follows_its_servers_key(
    redis_url: str, channel_layer_on_test_redis, settings, tmp_path: Path, tiny_model: Path
) -> None:

    settings.VAR_DIR = tmp_path / "var"
    artifact = build_model_shards(artifact_id=register_model(name="tiny", path=str(tiny_model)).pk, workers=2)
    certs = tmp_path / "certs"
    a = server_identity(certs, "a")
    renewed = server_identity(certs, "a-renewed", a.key, common_name="odmoe renewed")
    other = server_identity(certs, "b")
    settings.TLS_CERT_FILE = str(a.cert_path)
    _, token = create_join_token(created_by=None)
    spare, unspent = create_join_token(created_by=None)
    port = free_port()
    server, state, logs = f"https://127.0.0.1:{port}", tmp_path / "state", tmp_path / "logs"
    env = python_env(
        DJANGO_SETTINGS_MODULE="controlplane.config.settings.test",
        DATABASE_URL=database_url(),
        REDIS_URL=redis_url,
        ODMOE_TLS_CERT_FILE=str(a.cert_path),
    )
    with ProcessGroup(logs, env) as group:
        asgi = start_tls_server(group, port, a, "asgi-a")
        group.start("agent", agent_argv(server, state, name="tls-box", token=token, heartbeat_s=0.5))
        online = lambda: Node.objects.filter(name="tls-box", status=NodeStatus.ONLINE).exists()  # noqa: E731
        wait_for("the agent's link over wss", online, group)
        stored = credentials.load(state)
        assert stored is not None and stored.pin == a.pin and credentials.load_certificate(state) == a.pem
        assert f'"WebSocket {LINK_PATH}"' in requests_in(logs / "asgi-a.log")  # the link, over wss

        node = Node.objects.get(name="tls-box")
        task = request_fetch(node=node, model_id=artifact.pk, role="worker-1")
        done = lambda: NodeTask.objects.get(pk=task.pk).state in (TaskState.DONE, TaskState.FAILED)  # noqa: E731
        wait_for("the shard download over https", done, group)
        task.refresh_from_db()
        assert task.state == TaskState.DONE, task.detail
        verify_shard(Path(task.detail), expect_role="worker", expect_worker=1)

        # The proxy renews its certificate, same key: the agent takes it and its link comes back.
        group.stop(asgi)
        asgi = start_tls_server(group, port, renewed, "asgi-renewed")
        renewal = lambda: credentials.load_certificate(state) == renewed.pem + a.pem and online()  # noqa: E731
        wait_for("the link on the renewed certificate", renewal, group)

        # Another key: the link is refused and says what to do; a new box with the same pinned token too,
        # and that server never reads a request.
        group.stop(asgi)
        start_tls_server(group, port, other, "asgi-b")
        refusing = lambda: "not the pinned" in (logs / "agent.log").read_text()  # noqa: E731
        wait_for("the agent to refuse the other key", refusing, group)
        assert "run the install one-liner from its console again" in (logs / "agent.log").read_text()
        new_box = subprocess.run(
            [*agent_argv(server, tmp_path / "new-box", name="new-box", token=unspent), "--enroll-only"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=REPO,
        )
        assert new_box.returncode == 1 and f"whose key has pin {other.pin}, not the pinned {a.pin}" in new_box.stderr
        assert not (tmp_path / "new-box" / credentials.FILE_NAME).exists()
        assert not (tmp_path / "new-box" / credentials.CERTIFICATE_FILE).exists()
        assert requests_in(logs / "asgi-b.log") == [] and JoinToken.objects.get(pk=spare.pk).uses == 0
        assert credentials.load_certificate(state) == renewed.pem + a.pem  # the other key's is not kept
        control = subprocess.run(["curl", "-fsSk", f"{server}/agent/facts"], capture_output=True, timeout=30)
        assert control.returncode == 0  # and a request it does read shows in its log:
        wait_for("the access log", lambda: requests_in(logs / "asgi-b.log") == ['"GET /agent/facts HTTP/1.1"'], group)

        # The key was changed on purpose: --pin follows it.
        group.stop(next(c for c in group.children if c.name == "agent"))
        argv = [*agent_argv(server, state, name="tls-box"), "--enroll-only", "--pin", other.pin]
        repinned = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
        assert repinned.returncode == 0, repinned.stderr
        assert credentials.load(state).pin == other.pin and credentials.load_certificate(state) == other.pem


def test_the_pinned_one_liner_installs_and_enrolls_a_box_and_with_another_key_installs_nothing(
    settings, tmp_path: Path, box: Path
) -> None:

    a = server_identity(tmp_path / "certs", "a")
    settings.TLS_CERT_FILE = str(a.cert_path)
    _, token = create_join_token(created_by=None)
    port = free_port()
    server = f"https://127.0.0.1:{port}"
    env = python_env(
        DJANGO_SETTINGS_MODULE="controlplane.config.settings.test",
        DATABASE_URL=database_url(),
        ODMOE_TLS_CERT_FILE=str(a.cert_path),
    )
    one_liner = enroll_commands(server, token)["install_command"]  # what the console shows for this URL
    assert one_liner.startswith(f"curl -fsSL --pinnedpubkey '{a.pin}' -k {server}/agent/install.sh | ")
    deps = box / "deps"  # the installing user's own (nobody's, when the tests run as root)
    deps.mkdir()
    link_dependencies(deps, requirements(REPO))  # the agent's dependencies only (no network here)
    with ProcessGroup(tmp_path / "logs", env) as group:
        start_tls_server(group, port, a, "asgi")
        wrong = one_liner.replace(a.pin, server_identity(tmp_path / "certs", "b").pin)
        refused = one_liner_run(wrong, box / "refused", deps)
        assert "public key does not match pinned public key" in refused.stderr, refused.stderr
        assert not (box / "refused").exists() and not Node.objects.exists()

        run = one_liner_run(one_liner, box / "odmoe-agent", deps)
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"key {a.pin}" in run.stdout  # the package came over the pinned channel
        assert f"OK   server   {server} answers" in run.stdout  # and the doctor reached the server pinned too
    node = Node.objects.get(name="installed-box")
    stored = credentials.load(box / "odmoe-agent" / "state")
    assert stored is not None and stored.node_id == str(node.pk) and stored.pin == a.pin
    assert credentials.load_certificate(box / "odmoe-agent" / "state") == a.pem


def one_liner_run(command: str, target: Path, deps: Path) -> subprocess.CompletedProcess:
    """Run the console's one-liner as an ordinary user would paste it (nobody, when the tests run as
    root: as root the script installs for a system user, tests/controlplane/test_install.py),
    installing into ``target``; the dependencies are linked in from this test run (no network)."""
    home = target.parent / "home"
    home.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(deps),
        "PYTHON": "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3",  # the box's own
        "HOME": str(home),
    }
    options = f" --name installed-box --dir {target} --no-service --no-deps"
    return subprocess.run(
        ["sh", "-c", command + options],
        capture_output=True,
        text=True,
        env=env,
        cwd=target.parent,
        timeout=600,
        **as_ordinary_user(home),
    )
