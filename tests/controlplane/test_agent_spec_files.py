"""The agent's role spec files hold the role's secret key: on disk only while the role runs.

A real agent runner (``RoleRunner``) downloads a worker's shard from a live control plane,
writes the role's spec and starts the role process, which it probes with its seat's client
keys until it answers ready. The spec is gone once the role stops, once the agent stops, and
when a start fails; one an agent killed earlier left behind goes when the next agent starts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import msgspec
import pytest

from agent.credentials import NodeCredential
from agent.roles import Roles
from agent.runtime import RoleRunner
from controlplane.artifacts.services import build_model_shards, register_model
from controlplane.nodes.models import NodeTask
from controlplane.nodes.services import create_join_token, enroll_node
from inference.runtime.curve import new_seat_keys, role_keys
from inference.runtime.launcher import free_port
from inference.wire.link import StartRole

DEPLOYMENT = "dep1-1"


@pytest.fixture
def shards(settings, tmp_path: Path, tiny_model: Path):
    settings.VAR_DIR = tmp_path / "var"
    artifact = register_model(name="tiny", path=str(tiny_model))
    return build_model_shards(artifact_id=artifact.pk, workers=1)


@pytest.fixture
def credential(live_server, shards) -> NodeCredential:
    _, token = create_join_token(created_by=None)
    node, secret = enroll_node(token=token, name="box", inventory={})
    NodeTask.objects.create(node=node, kind="fetch_shard", params={"model_id": shards.pk, "role": "worker-0"})
    return NodeCredential(live_server.url, str(node.pk), secret, node.name)


def start_worker(model_id: int, **settings) -> StartRole:
    seats = new_seat_keys(["main", "worker-0"])
    addresses = {"main": f"tcp://127.0.0.1:{free_port()}", "workers": [f"tcp://127.0.0.1:{free_port()}"]}
    spec = {
        "deployment": DEPLOYMENT,
        "role": "worker",
        "worker": 0,
        "addresses": addresses,
        "settings": settings,
        "curve": asdict(role_keys("worker-0", seats)),
    }
    client = asdict(seats["worker-0"].client)
    return StartRole(
        task_id="t1", deployment=DEPLOYMENT, model_id=model_id, shard="worker-0", spec=spec, client_keys=client
    )


async def until(condition: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_roles_spec_file_goes_when_the_role_stops_when_the_agent_stops_and_when_a_start_fails(
    credential: NodeCredential, shards, tmp_path: Path
) -> None:
    spec_file = tmp_path / "runtime" / DEPLOYMENT / "worker-0.spec.json"
    seen: dict[str, object] = {}

    async def send(message) -> None:
        pass

    async def scenario() -> None:
        runner = RoleRunner(credential, tmp_path, send)
        ready = lambda: runner.state is not None and runner.state.state == "ready"  # noqa: E731
        await runner.start(start_worker(shards.pk))
        await until(ready)  # its probe got in with the seat's client keys
        seen["mode while running"] = spec_file.stat().st_mode & 0o777
        await runner.stop()
        seen["after stop"] = spec_file.exists()
        await runner.start(start_worker(shards.pk))
        await until(ready)
        seen["running again"] = spec_file.exists()
        await runner.close()  # the agent stops
        seen["after the agent stopped"] = spec_file.exists()
        seen["process after the agent stopped"] = runner.process
        for label, command in (
            ("a spec the runtime refuses", start_worker(shards.pk, threads=0)),
            ("client keys that are no pair", _bad_client_keys(shards.pk)),
        ):
            runner = RoleRunner(credential, tmp_path, send)  # the next agent
            await runner.start(command)
            await runner._work
            seen[label] = (runner.state.state, runner.state.detail, spec_file.exists())

    asyncio.run(scenario())
    assert seen["mode while running"] == 0o600
    assert seen["after stop"] is False
    assert seen["running again"] is True
    assert seen["after the agent stopped"] is False and seen["process after the agent stopped"] is None
    state, detail, left = seen["a spec the runtime refuses"]
    assert (state, left) == ("failed", False) and "bad role spec" in detail and "threads" in detail
    state, detail, left = seen["client keys that are no pair"]
    assert (state, left) == ("failed", False) and "bad client keys" in detail and "does not belong" in detail


def _bad_client_keys(model_id: int) -> StartRole:
    command = start_worker(model_id)
    other = new_seat_keys(["worker-0"])["worker-0"]
    return msgspec.structs.replace(command, client_keys={**command.client_keys, "secret": other.client.secret})


def test_spec_files_an_agent_left_behind_go_when_the_next_agent_starts(tmp_path: Path) -> None:
    left = tmp_path / "runtime" / "dep3-2" / "main.spec.json"
    left.parent.mkdir(parents=True)
    left.write_text("{}")
    log = left.with_name("main.log")
    log.write_text("kept")

    async def send(message) -> None:
        pass

    Roles(None, tmp_path, send)
    assert not left.exists() and log.exists()
