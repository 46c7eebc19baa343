"""What the control plane does with an agent's version, protocol and doctor report: the facts a
doctor compares with, the console's view, a refused role, and an agent of another protocol
turned away at connect with the command that upgrades it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import Client, override_settings
from rest_framework.test import APIClient

import inference
from controlplane.artifacts.services import register_model
from controlplane.config.asgi import application
from controlplane.console.snapshot import snapshot
from controlplane.nodes.inventory import clean_inventory, doctor_problems
from controlplane.nodes.models import Node
from controlplane.nodes.services import create_join_token, enroll_node
from inference.wire.link import (
    AGENT_PROTOCOL,
    CLOSE_PROTOCOL_MISMATCH,
    FRAME_LIMIT_HEADER,
    LINK_PATH,
    OLDEST_AGENT_PROTOCOL,
    PROTOCOL_HEADER,
)
from tests.controlplane.conftest import redis_channel_layers

GIB = 2**30
FAILED_DISK = {
    "ok": False,
    "protocol": 1,
    "checks": [
        {"name": "python", "status": "ok", "detail": "Python 3.11.7", "fix": ""},
        {"name": "disk", "status": "fail", "detail": "2.0 GiB free at /srv", "fix": "free 40.0 GiB there"},
        {"name": "gpus", "status": "warn", "detail": "no GPU visible to torch", "fix": "install the driver"},
    ],
}


def box(name: str, **inventory) -> Node:
    _, token = create_join_token(created_by=None)
    node, secret = enroll_node(
        token=token, name=name, inventory={"gpus": [{"memory_bytes": 24 * GIB}], "ram_bytes": 64 * GIB, **inventory}
    )
    node.secret = secret  # type: ignore[attr-defined]
    return node


def test_the_facts_a_doctor_compares_with_are_public(db, tiny_model: Path) -> None:
    facts = Client().get("/agent/facts").json()
    assert facts["version"] == inference.__version__ and facts["protocol"] == AGENT_PROTOCOL
    assert facts["oldest_protocol"] == OLDEST_AGENT_PROTOCOL
    assert facts["largest_shard_bytes"] is None  # no shard built yet
    assert facts["install_command"] == "curl -fsSL http://testserver/agent/install.sh | sh"


def test_a_doctor_report_is_kept_only_in_its_shape() -> None:
    assert clean_inventory({"doctor": FAILED_DISK})["doctor"] == FAILED_DISK
    for bad in ({"ok": "yes", "checks": []}, {"ok": True, "checks": "x"}, {"ok": True, "checks": [{"name": 3}]}):
        assert "doctor" not in clean_inventory({"doctor": bad})
        # A report that is there but unreadable keeps the node out, rather than let it through.
        (unreadable,) = doctor_problems({"doctor": bad})
        assert unreadable.startswith("its doctor's report is unreadable")
    assert doctor_problems({"doctor": FAILED_DISK}) == ["disk: 2.0 GiB free at /srv (fix: free 40.0 GiB there)"]
    assert doctor_problems({}) == []  # an agent older than the doctor: nothing known against it


@pytest.mark.django_db
def test_a_node_whose_doctor_failed_gets_no_role_and_the_console_says_why(tiny_model: Path) -> None:
    model = register_model(name="tiny", path=str(tiny_model))
    ok = [box(f"ok{i}", agent_version=inference.__version__, protocol=1) for i in range(2)]
    bad = box("full-disk", doctor=FAILED_DISK, agent_version="0.0.9")
    staff = APIClient()
    staff.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))
    nodes = [str(n.pk) for n in [*ok, bad]]
    for answer in (
        staff.post("/api/deployments/suggest", {"model": model.pk, "nodes": nodes}, format="json"),
        staff.post("/api/deployments", {"name": "d", "model": model.pk, "nodes": nodes}, format="json"),
    ):
        assert answer.status_code == 400, answer.content
        assert "full-disk: disk: 2.0 GiB free at /srv (fix: free 40.0 GiB there)" in str(answer.json())
    shown = {n["name"]: n for n in snapshot()["nodes"]}
    assert shown["full-disk"]["problems"] == ["disk: 2.0 GiB free at /srv (fix: free 40.0 GiB there)"]
    assert shown["full-disk"]["warnings"] == ["gpus: no GPU visible to torch"]
    assert shown["full-disk"]["agent_version"] == "0.0.9" and snapshot()["server_version"] == inference.__version__
    assert shown["ok0"]["problems"] == [] and shown["ok0"]["agent_version"] == inference.__version__


@pytest.mark.django_db(transaction=True)
def test_an_agent_of_another_protocol_is_turned_away_at_connect_with_the_upgrade(redis_url: str) -> None:
    node = box("old-agent")

    async def connect(protocol: str | None, limit: str | None = None, *, expect_close: bool) -> tuple[bool, object]:
        headers = [(b"authorization", f"Node {node.pk}:{node.secret}".encode())]
        if protocol is not None:
            headers.append((PROTOCOL_HEADER.lower().encode(), protocol.encode()))
        if limit is not None:
            headers.append((FRAME_LIMIT_HEADER.lower().encode(), limit.encode()))
        comm = WebsocketCommunicator(application, LINK_PATH, headers=headers)
        connected, _ = await comm.connect()
        closed = await comm.receive_output(timeout=5) if connected and expect_close else None
        if not expect_close:
            await comm.disconnect()
        return connected, closed

    with override_settings(CHANNEL_LAYERS=redis_channel_layers(redis_url)):
        # This protocol, announcing its frame limit or not (held then to websockets' default).
        for protocol, limit in ((str(AGENT_PROTOCOL), "16777216"), (str(OLDEST_AGENT_PROTOCOL), None)):
            connected, _ = asyncio.run(connect(protocol, limit, expect_close=False))
            assert connected, protocol
        # One older than the oldest taken, a newer one, or none (an agent older than the header speaks the first).
        for refused in (str(OLDEST_AGENT_PROTOCOL - 1), str(AGENT_PROTOCOL + 1), None):
            _, closed = asyncio.run(connect(refused, expect_close=True))
            assert closed["type"] == "websocket.close" and closed["code"] == CLOSE_PROTOCOL_MISMATCH
            assert "upgrade" in closed["reason"] and "install one-liner" in closed["reason"]
        # A frame limit that is no number of bytes: nothing is known to fit such an agent.
        for unusable in ("lots", "0", "-5", "1" * 19):
            _, closed = asyncio.run(connect(str(AGENT_PROTOCOL), unusable, expect_close=True))
            assert closed["code"] == CLOSE_PROTOCOL_MISMATCH and FRAME_LIMIT_HEADER in closed["reason"], unusable
        # The link turned away never counted as connected after the accepted ones went.
        status = asyncio.run(sync_to_async(lambda: Node.objects.get(pk=node.pk).status)())
        assert status != "online"
