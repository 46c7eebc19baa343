"""The agent link: websocket consumer tests, and a real agent against a real ASGI server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async
from channels.layers import channel_layers
from channels.testing import WebsocketCommunicator
from django.test import override_settings
from django.utils import timezone

from agent.backoff import reconnect_delay
from controlplane.config.asgi import application
from controlplane.nodes.models import Node, NodeStatus
from controlplane.nodes.services import create_join_token, enroll_node, expire_silent_nodes
from controlplane.ops.processes import http_up
from inference.runtime.launcher import free_port
from inference.wire.link import AGENT_PROTOCOL, LINK_PATH, PROTOCOL_HEADER, Heartbeat, LinkPing, MessageError, parse
from tests.controlplane.conftest import redis_channel_layers
from tests.controlplane.live import database_url
from tests.paths import REPO


def enrolled(name: str = "box") -> tuple[Node, str]:
    _, token = create_join_token(created_by=None)
    return enroll_node(token=token, name=name, inventory={})


def communicator(authorization: str | None) -> WebsocketCommunicator:
    """A link as an agent of this protocol opens it (with ``authorization``, its credential)."""
    headers = [(PROTOCOL_HEADER.lower().encode(), str(AGENT_PROTOCOL).encode())]
    headers += [(b"authorization", authorization.encode())] if authorization else []
    return WebsocketCommunicator(application, LINK_PATH, headers=headers)


async def status_within(node: Node, status: str, *, timeout_s: float) -> str:
    """The node's status once it is ``status``, or whatever it is after ``timeout_s`` (heartbeats
    are recorded in the background, while the link goes on reading)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = await sync_to_async(lambda: Node.objects.get(pk=node.pk).status)()
        if now == status or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.05)


@pytest.mark.django_db(transaction=True)
def test_unauthenticated_and_forged_sockets_are_refused(channel_layer_on_test_redis) -> None:
    node, _ = enrolled()

    async def attempt(authorization: str | None) -> bool:
        comm = communicator(authorization)
        connected, _ = await comm.connect()
        await comm.disconnect()
        return connected

    from asgiref.sync import async_to_sync

    assert async_to_sync(attempt)(None) is False
    assert async_to_sync(attempt)(f"Node {node.pk}:odmoe-node-forged") is False
    assert async_to_sync(attempt)("Bearer something") is False


@pytest.mark.django_db(transaction=True)
def test_heartbeats_bring_a_node_online_and_a_closed_link_takes_it_offline(channel_layer_on_test_redis) -> None:
    from asgiref.sync import async_to_sync

    node, secret = enrolled()

    async def session() -> dict:
        comm = communicator(f"Node {node.pk}:{secret}")
        connected, _ = await comm.connect()
        assert connected
        await comm.send_json_to(Heartbeat(inventory={"cpu_count": 4, "address": "10.0.0.9"}).to_json())
        await comm.send_json_to({"type": "heartbeat"})  # malformed: no inventory
        error = await comm.receive_json_from(timeout=5)  # answered at once: the heartbeat is written meanwhile
        online = await status_within(node, NodeStatus.ONLINE, timeout_s=5)
        await comm.disconnect()
        return {"error": error, "online": online}

    result = async_to_sync(session)()
    assert result["online"] == NodeStatus.ONLINE
    assert result["error"]["type"] == "error" and "inventory" in result["error"]["detail"]
    node.refresh_from_db()
    assert node.status == NodeStatus.OFFLINE
    assert node.inventory["cpu_count"] == 4 and node.address == "10.0.0.9"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("number", "why"),
    [
        ("NaN", "NaN is not a JSON number"),
        ("Infinity", "Infinity is not a JSON number"),
        ("-Infinity", "-Infinity is not a JSON number"),
        ("1e999", "1e999 is past what a float holds"),
    ],
)
def test_a_heartbeat_with_a_number_json_has_not_is_refused_and_records_nothing(
    channel_layer_on_test_redis, number: str, why: str
) -> None:
    """Python's decoder takes NaN, and reads 1e999 as infinity; the inventory's JSON column takes
    neither (a fuzz run found the heartbeat's write failing with a logged error)."""
    from asgiref.sync import async_to_sync

    node, secret = enrolled()

    async def session() -> dict:
        comm = communicator(f"Node {node.pk}:{secret}")
        assert (await comm.connect())[0]
        await comm.send_to(text_data='{"type": "heartbeat", "inventory": {"cpu_count": ' + number + "}}")
        answer = await comm.receive_json_from(timeout=5)
        await comm.disconnect()
        return answer

    answer = async_to_sync(session)()
    assert answer["type"] == "error" and why in answer["detail"]
    node.refresh_from_db()
    assert node.inventory == {} and node.status != NodeStatus.ONLINE


@pytest.mark.django_db(transaction=True)
def test_a_rotated_credential_replaces_the_old_once_the_agent_has_saved_it(channel_layer_on_test_redis) -> None:
    from asgiref.sync import async_to_sync

    from controlplane.nodes.services import NodeError, authenticate_node, rotate_credential

    node, old = enrolled()
    with pytest.raises(NodeError, match="must be connected"):
        rotate_credential(node=node)  # enrolled, never connected: nobody to hand a credential to

    async def session() -> dict:
        comm = communicator(f"Node {node.pk}:{old}")
        assert (await comm.connect())[0]
        await comm.send_json_to(Heartbeat(inventory={}).to_json())
        assert await status_within(node, NodeStatus.ONLINE, timeout_s=5) == NodeStatus.ONLINE
        await sync_to_async(lambda: rotate_credential(node=Node.objects.get(pk=node.pk)))()
        command = await comm.receive_json_from(timeout=5)
        # Until the agent says it saved the new one, both work (its answer could be lost).
        both = await sync_to_async(lambda: [authenticate_node(node_id=str(node.pk), secret=old) is not None])()
        await comm.send_json_to({"type": "credential_saved"})
        await asyncio.sleep(0.3)
        await comm.disconnect()
        return {"command": command, "both": both}

    result = async_to_sync(session)()
    assert result["command"]["type"] == "rotate_credential" and result["both"] == [True]
    new = result["command"]["node_secret"]
    assert new.startswith("odmoe-node-") and new != old
    assert authenticate_node(node_id=str(node.pk), secret=old) is None
    assert authenticate_node(node_id=str(node.pk), secret=new) is not None
    node.refresh_from_db()
    assert node.credential_rotated_at is not None and not node.rotation_pending
    assert new not in node.secret_hash  # only its digest is kept

    # An agent that saved the new credential but whose answer was lost: using it confirms the rotation.
    from controlplane.nodes.services import begin_rotation

    pending = begin_rotation(node_id=str(node.pk))
    assert authenticate_node(node_id=str(node.pk), secret=new) is not None  # the current one still works
    assert authenticate_node(node_id=str(node.pk), secret=pending) is not None
    assert authenticate_node(node_id=str(node.pk), secret=new) is None  # ... and is gone once the new is used


@pytest.mark.django_db
def test_silent_online_nodes_expire_and_others_stay() -> None:
    quiet, _ = enrolled("quiet")
    chatty, _ = enrolled("chatty")
    now = timezone.now()
    Node.objects.filter(pk=quiet.pk).update(status=NodeStatus.ONLINE, last_seen=now - timedelta(seconds=60))
    Node.objects.filter(pk=chatty.pk).update(status=NodeStatus.ONLINE, last_seen=now)
    assert expire_silent_nodes(timeout_s=15) == ["quiet"]
    assert Node.objects.get(pk=quiet.pk).status == NodeStatus.OFFLINE
    assert Node.objects.get(pk=chatty.pk).status == NodeStatus.ONLINE


def test_link_messages_are_validated_on_arrival() -> None:
    assert parse({"type": "ping", "nonce": "n1"}, allowed=(LinkPing,)) == LinkPing(nonce="n1")
    for bad in [[], {"type": "ping"}, {"type": "ping", "nonce": 3}, {"type": "nope"}, {"type": "heartbeat"}]:
        with pytest.raises(MessageError):
            parse(bad, allowed=(LinkPing,))
    with pytest.raises(MessageError, match="unknown field"):
        parse({"type": "ping", "nonce": "x", "extra": 1}, allowed=(LinkPing,))


def test_reconnect_delays_grow_are_capped_and_jittered() -> None:
    import random

    rng = random.Random(0)
    delays = [reconnect_delay(n, base_s=0.5, cap_s=30, rng=rng) for n in range(12)]
    assert all(0.25 <= d <= 30 for d in delays)
    assert delays[-1] >= 15 and delays[0] <= 0.5
    assert len(set(delays)) == len(delays)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_real_agent_keeps_its_node_online_and_reconnects(redis_url: str, tmp_path: Path) -> None:
    node, secret = enrolled("real-box")
    port = free_port()
    env = service_env(redis_url)
    server = start_server(port, env, tmp_path)
    agent = start_agent(port, node, secret, tmp_path / "state", env, tmp_path)
    try:
        wait_for_status(node, NodeStatus.ONLINE, timeout_s=40)
        # The credential is rotated over the live link: the agent stores the new one, the old stops working.
        from controlplane.nodes.services import rotate_credential

        with override_settings(CHANNEL_LAYERS=redis_channel_layers(redis_url)):
            channel_layers.backends.clear()
            rotate_credential(node=node)
            channel_layers.backends.clear()
        deadline = time.monotonic() + 20
        while Node.objects.get(pk=node.pk).credential_rotated_at is None and time.monotonic() < deadline:
            time.sleep(0.2)
        stored = json.loads((tmp_path / "state" / "node.json").read_text())
        assert stored["node_secret"] != secret and Node.objects.get(pk=node.pk).credential_rotated_at is not None
        assert oct((tmp_path / "state" / "node.json").stat().st_mode & 0o777) == "0o600"
        server.send_signal(signal.SIGTERM)  # the control plane restarts: the link drops
        server.wait(timeout=20)
        wait_for_status(node, NodeStatus.OFFLINE, timeout_s=20)
        server = start_server(port, env, tmp_path)
        wait_for_status(
            node, NodeStatus.ONLINE, timeout_s=60
        )  # the agent reconnected by itself, with the new credential
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=20) == 0
        wait_for_status(node, NodeStatus.OFFLINE, timeout_s=20)
    finally:
        for proc in (agent, server):
            if proc.poll() is None:
                proc.kill()


def service_env(redis_url: str) -> dict:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.config.settings.test",
        "DATABASE_URL": database_url(),
        "REDIS_URL": redis_url,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")]),
    }


def start_server(port: int, env: dict, logs: Path) -> subprocess.Popen:
    """The control plane's ASGI app under a real uvicorn."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "controlplane.config.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=open(logs / "server.log", "ab"),
    )


def start_agent(port: int, node: Node, secret: str, state: Path, env: dict, logs: Path) -> subprocess.Popen:
    """A real agent process holding ``node``'s credential."""
    state.mkdir(exist_ok=True)
    credential = {"server": f"http://127.0.0.1:{port}", "node_id": str(node.pk), "node_secret": secret}
    (state / "node.json").write_text(json.dumps({**credential, "name": node.name}))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent",
            "--server",
            f"http://127.0.0.1:{port}",
            "--state-dir",
            str(state),
            "--heartbeat",
            "0.3",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(logs / "agent.log", "ab"),
    )


def wait_for_status(node: Node, status: str, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        node.refresh_from_db()
        if node.status == status:
            return
        time.sleep(0.2)
    raise AssertionError(f"node {node.name} is {node.status}, expected {status} within {timeout_s} s")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_fetch_command_reaches_the_agent_which_downloads_the_shard(
    redis_url: str, channel_layer_on_test_redis, settings, tmp_path: Path, tiny_model: Path
) -> None:
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    from controlplane.artifacts.services import build_model_shards, register_model
    from controlplane.nodes.models import NodeTask, TaskState
    from inference.modelio.shards import verify_shard

    settings.VAR_DIR = tmp_path / "var"
    artifact = build_model_shards(artifact_id=register_model(name="tiny", path=str(tiny_model)).pk, workers=2)
    node, secret = enrolled("fetcher")
    port = free_port()
    env = service_env(redis_url)
    state = tmp_path / "state"
    server = start_server(port, env, tmp_path)
    agent = start_agent(port, node, secret, state, env, tmp_path)
    staff = APIClient()
    staff.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))
    try:
        wait_for_status(node, NodeStatus.ONLINE, timeout_s=40)
        sent = staff.post(f"/api/nodes/{node.pk}/fetch", {"model": artifact.pk, "role": "worker-1"}, format="json")
        assert sent.status_code == 202, sent.content
        task = NodeTask.objects.get(pk=sent.json()["id"])
        deadline = time.monotonic() + 60
        while task.state not in (TaskState.DONE, TaskState.FAILED) and time.monotonic() < deadline:
            time.sleep(0.2)
            task.refresh_from_db()
        assert task.state == TaskState.DONE, task.detail
        assert task.total > 0 and task.done == task.total
        verify_shard(Path(task.detail), expect_role="worker", expect_worker=1)
        assert Path(task.detail).is_relative_to(state)
        tasks = staff.get(f"/api/nodes/{node.pk}/tasks").json()
        assert tasks["results"][0]["state"] == "done"
    finally:
        for proc in (agent, server):
            if proc.poll() is None:
                proc.kill()


@pytest.mark.django_db
def test_fetch_needs_a_connected_agent() -> None:
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    node, _ = enrolled("offline-box")
    staff = APIClient()
    staff.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))
    refused = staff.post(f"/api/nodes/{node.pk}/fetch", {"model": 1, "role": "main"}, format="json")
    assert refused.status_code == 409 and "must be connected" in refused.json()["detail"]
    bad_role = staff.post(f"/api/nodes/{node.pk}/fetch", {"model": 1, "role": "../etc"}, format="json")
    assert bad_role.status_code == 400


@pytest.mark.django_db(transaction=True)
def test_a_node_relays_only_generations_it_was_given(channel_layer_on_test_redis) -> None:
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from controlplane.nodes.groups import generation_group, node_group
    from inference.wire.generation import Done, Generate, Token

    node, secret = enrolled()

    async def session() -> list:
        layer = get_channel_layer()
        listener = await layer.new_channel()
        await layer.group_add(generation_group("r1"), listener)
        await layer.group_add(generation_group("r2"), listener)
        comm = communicator(f"Node {node.pk}:{secret}")
        assert (await comm.connect())[0]
        # Not given r2: its "tokens" are dropped.
        await comm.send_json_to(Token(request_id="r2", index=0, token_id=7).to_json())
        command = Generate(request_id="r1", deployment="dep1-1", prompt_ids=[1, 2], max_new_tokens=2).to_json()
        await layer.group_send(node_group(str(node.pk)), {"type": "agent.command", "command": command})
        assert await comm.receive_json_from(timeout=5) == command
        await comm.send_json_to(Token(request_id="r1", index=0, token_id=5).to_json())
        done = Done(request_id="r1", token_ids=[5, 6], finish_reason="length", metrics={})
        await comm.send_json_to(done.to_json())
        await comm.send_json_to(Token(request_id="r1", index=2, token_id=9).to_json())  # after done
        relayed = []
        with contextlib.suppress(TimeoutError):
            while True:
                relayed.append((await asyncio.wait_for(layer.receive(listener), timeout=1))["event"])
        await comm.disconnect()
        return relayed

    relayed = async_to_sync(session)()
    assert [e["type"] for e in relayed] == ["generation_token", "generation_done"]
    assert all(e["request_id"] == "r1" for e in relayed)


@pytest.mark.django_db(transaction=True)
def test_a_caller_in_the_links_process_gets_its_events_straight_and_the_channel_layer_none(
    channel_layer_on_test_redis,
) -> None:
    """Where the caller listens in the process of main's link, each event goes to it as the struct
    the link checked (step report and all), and not also through Redis; a caller elsewhere gets
    them through the channel layer, without the step report only the console reads."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from controlplane.nodes.groups import generation_group, node_group
    from controlplane.nodes.relay import listening
    from inference.wire.generation import Done, Generate, Token

    node, secret = enrolled()
    step = {"step": 1, "tokens": 1, "batch": 1, "ms": 2.5, "recall": None, "layers": []}

    async def session() -> tuple[list, list, int]:
        layer = get_channel_layer()
        elsewhere = await layer.new_channel()
        await layer.group_add(generation_group("here"), elsewhere)
        await layer.group_add(generation_group("there"), elsewhere)
        comm = communicator(f"Node {node.pk}:{secret}")
        assert (await comm.connect())[0]
        for request_id in ("here", "there"):
            command = Generate(request_id=request_id, deployment="dep1-1", prompt_ids=[1], max_new_tokens=1)
            await layer.group_send(node_group(str(node.pk)), {"type": "agent.command", "command": command.to_json()})
            assert (await comm.receive_json_from(timeout=5))["request_id"] == request_id
        with listening("here") as inbox:
            for request_id in ("here", "there"):
                await comm.send_json_to(Token(request_id=request_id, index=0, token_id=5, step=step).to_json())
                done = Done(request_id=request_id, token_ids=[5], finish_reason="length", metrics={})
                await comm.send_json_to(done.to_json())
            here = [await asyncio.wait_for(inbox.get(), timeout=5) for _ in range(2)]
            there = []
            with contextlib.suppress(TimeoutError):
                while True:
                    there.append((await asyncio.wait_for(layer.receive(elsewhere), timeout=1))["event"])
        await comm.disconnect()
        return here, there, inbox.qsize()

    here, there, left = async_to_sync(session)()
    assert [type(e) for e in here] == [Token, Done] and here[0].step == step and left == 0
    assert [(e["type"], e["request_id"]) for e in there] == [
        ("generation_token", "there"),
        ("generation_done", "there"),
    ]
    assert there[0]["step"] is None


@pytest.mark.django_db(transaction=True)
def test_a_link_that_closes_mid_generation_pauses_it_and_the_nodes_next_link_finishes_it(
    channel_layer_on_test_redis,
) -> None:
    """A control-plane restart (or a blip) drops main's link: the caller hears that it closed, not
    that the generation failed. The agent's next link sends again what was not acknowledged, and
    it is relayed, though this link never sent the ``Generate``; another node cannot speak for it.
    Every event is acknowledged, so the agent forgets it."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from controlplane.nodes.consumers import ACK_EVERY_S
    from controlplane.nodes.groups import generation_group, node_group
    from controlplane.nodes.relay import PAUSED
    from inference.wire.generation import Done, Generate, Token

    node, secret = enrolled()
    other, other_secret = enrolled("other")

    async def session() -> tuple[list, list, list]:
        layer = get_channel_layer()
        listener = await layer.new_channel()
        await layer.group_add(generation_group("r1"), listener)
        comm = communicator(f"Node {node.pk}:{secret}")
        assert (await comm.connect())[0]
        command = Generate(request_id="r1", deployment="dep1-1", prompt_ids=[1, 2], max_new_tokens=3).to_json()
        await layer.group_send(node_group(str(node.pk)), {"type": "agent.command", "command": command})
        assert await comm.receive_json_from(timeout=5) == command
        await comm.send_json_to(Token(request_id="r1", index=0, token_id=5).to_json())
        first = [await comm.receive_json_from(timeout=5)]  # its acknowledgement
        await comm.send_json_to(Token(request_id="r1", index=1, token_id=6).to_json())
        await comm.disconnect()  # before token 1 was acknowledged
        relayed = [(await asyncio.wait_for(layer.receive(listener), timeout=5)) for _ in range(3)]

        intruder = communicator(f"Node {other.pk}:{other_secret}")
        assert (await intruder.connect())[0]
        await intruder.send_json_to(Token(request_id="r1", index=2, token_id=66).to_json())
        refused = [await intruder.receive_json_from(timeout=5)]  # dropped, and forgotten by its agent too
        await intruder.disconnect()

        again = communicator(f"Node {node.pk}:{secret}")
        assert (await again.connect())[0]
        for event in (
            Token(request_id="r1", index=1, token_id=6),
            Token(request_id="r1", index=2, token_id=7),
            Done(request_id="r1", token_ids=[5, 6, 7], finish_reason="length", metrics={}, index=3),
        ):
            await again.send_json_to(event.to_json())
        await asyncio.sleep(ACK_EVERY_S)
        acks = [await again.receive_json_from(timeout=5)]
        with contextlib.suppress(TimeoutError):
            while True:
                relayed.append(await asyncio.wait_for(layer.receive(listener), timeout=1))
        await again.disconnect()
        return relayed, first + acks, refused

    relayed, acks, refused = async_to_sync(session)()
    shown = [(m["type"], m.get("event", {}).get("index")) for m in relayed]
    assert shown == [
        ("generation.event", 0),
        ("generation.event", 1),
        (PAUSED, None),
        ("generation.event", 1),  # sent again: the caller drops it by its index
        ("generation.event", 2),
        ("generation.event", 3),
    ]
    assert relayed[-1]["event"]["type"] == "generation_done"
    assert acks == [{"type": "acknowledge", "acks": [["r1", 0]]}, {"type": "acknowledge", "acks": [["r1", 3]]}]
    assert refused == [{"type": "acknowledge", "acks": [["r1", 2]]}]
    assert Node.objects.get(pk=node.pk).status == NodeStatus.OFFLINE


@pytest.mark.django_db(transaction=True)
def test_chat_sockets_need_a_logged_in_user(channel_layer_on_test_redis) -> None:
    from asgiref.sync import async_to_sync

    async def attempt(headers: list) -> bool:
        comm = WebsocketCommunicator(application, "/ws/chat/", headers=headers)
        connected, _ = await comm.connect()
        await comm.disconnect()
        return connected

    from django.contrib.auth import get_user_model
    from django.test import Client

    same_site = [(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]
    assert async_to_sync(attempt)(same_site) is False  # no session
    browser = Client()
    browser.force_login(get_user_model().objects.create_user("reader"))
    cookie = [(b"cookie", f"sessionid={browser.cookies['sessionid'].value}".encode())]
    assert async_to_sync(attempt)(same_site + cookie) is True
    assert async_to_sync(attempt)([(b"origin", b"http://evil.example"), (b"host", b"127.0.0.1"), *cookie]) is False


@pytest.mark.django_db
def test_an_old_links_late_close_does_not_take_a_reconnected_node_offline() -> None:
    from controlplane.nodes.services import mark_connected, mark_offline, record_heartbeat

    node, _ = enrolled()
    first = mark_connected(node_id=str(node.pk))
    time.sleep(0.01)
    mark_connected(node_id=str(node.pk))  # the agent reconnected before the old link's close was handled
    record_heartbeat(node_id=str(node.pk), inventory={})
    mark_offline(node_id=str(node.pk), link_since=first)
    assert Node.objects.get(pk=node.pk).status == NodeStatus.ONLINE
    mark_offline(node_id=str(node.pk), link_since=Node.objects.get(pk=node.pk).connected_at)
    assert Node.objects.get(pk=node.pk).status == NodeStatus.OFFLINE


# --- a hostile node: what its frames can make the control plane hold and store -----------------------


def test_an_inventory_keeps_only_the_entries_its_readers_know_each_within_its_size() -> None:
    from controlplane.nodes.inventory import MAX_GPUS, clean_inventory

    sent = {
        "cpu_count": 8,
        "hostname": "box",
        "junk": "x" * 100_000,  # kept as sent, before
        "shard_bytes": {f"1/worker-{i}": 10 for i in range(1000)},
        "free_ports": list(range(1, 5000)),
        "gpus": [{"index": 0, "memory_bytes": 24, "evil": "y" * 1000}] * 1000,
        "ram_bytes": 2**70,
        "address": "a" * 10_000,
    }
    kept = clean_inventory(sent)
    assert kept == {"cpu_count": 8, "hostname": "box", "gpus": [{"index": 0, "memory_bytes": 24}] * MAX_GPUS}
    assert clean_inventory({"free_ports": [9300, 9301], "shard_bytes": {"1/main": 5}}) == {
        "free_ports": [9300, 9301],
        "shard_bytes": {"1/main": 5},
    }
    codecs = {"1/main": "none", "1/worker-0": "exponent-plane"}
    assert clean_inventory({"shard_codecs": codecs}) == {"shard_codecs": codecs}
    for bad in (
        {"1/worker-0": "gzip"},
        {"1/worker-0": ["none"]},
        {f"1/worker-{i}": "none" for i in range(1000)},
        "none",
    ):
        assert clean_inventory({"shard_codecs": bad}) == {}, bad


def test_a_role_report_keeps_its_known_figures_within_their_sizes() -> None:
    from controlplane.nodes.reports import MAX_DETAIL_CHARS, clean_role_report, clean_role_reports

    report = {
        "type": "role_state",
        "deployment": "dep1-1",
        "role": "main",
        "role_name": "main",
        "state": "ready",
        "detail": "d" * 100_000,
        "metrics": {"recall": 0.5, "groups": [[0, 1]], "recall_per_layer": [0.5] * 100_000, "junk": 1},
        "memory": {"host_bytes": 7, "device_bytes": 2**64, "evil": 3},
        "extra": "z" * 1000,
    }
    cleaned = clean_role_report(report)
    assert cleaned == {
        "deployment": "dep1-1",
        "role": "main",
        "role_name": "main",
        "state": "ready",
        "detail": "d" * MAX_DETAIL_CHARS,
        "metrics": {"recall": 0.5, "groups": [[0, 1]]},  # the figure too large to keep is left out
        "memory": {"host_bytes": 7},
    }
    assert "metrics" not in clean_role_report({"state": "ready"})  # none sent: the last ones stay
    assert len(clean_role_reports([report] * 10_000)) == 64
    assert clean_role_reports("x") == [] and clean_role_report(3) is None


def test_pending_writes_keep_one_per_kind_the_latest_and_at_most_their_limit() -> None:
    from controlplane.nodes.reports import PendingWrites

    pending = PendingWrites(limit=3)
    for i in range(10_000):
        assert pending.put(("roles",), print, {"n": i})
        assert pending.put(("role", "dep1-1", "main"), print, {"n": i})
    assert len(pending) == 2
    assert pending.put(("progress", "t1"), print, {"n": 1})
    assert not pending.put(("progress", "t2"), print, {"n": 2})  # a new kind past the limit
    assert pending.put(("roles",), print, {"n": "last"})  # a known kind still replaces its write
    assert [pending.take()[1]["n"] for _ in range(len(pending))] == [9999, 1, "last"]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_hostile_node_flooding_its_link_gets_bounded_rows_and_an_answering_link(
    redis_url: str, tmp_path: Path, tiny_model: Path
) -> None:
    """A node credential sends thousands of frames, as fast as the socket takes them, with huge and
    unknown fields: its node row and its role's row keep what is known and small, no task appears,
    the server does not hold the frames (its memory grows by less than they add up to), and the link
    still answers."""
    import uuid

    from websockets.asyncio.client import connect

    from controlplane.artifacts.services import register_model
    from controlplane.deployments.models import Deployment, DeploymentNode, DeploymentStatus, Role
    from controlplane.nodes.inventory import ENTRIES
    from controlplane.nodes.models import NodeTask
    from inference.wire.link import AGENT_PROTOCOL, MEMORY_FIGURES, PROTOCOL_HEADER, RUNTIME_METRICS

    node, secret = enrolled("hostile")
    deployment = Deployment.objects.create(
        name="d", model=register_model(name="tiny", path=str(tiny_model)), status=DeploymentStatus.READY, epoch=1
    )
    DeploymentNode.objects.create(deployment=deployment, node=node, role=Role.MAIN, port=9300, state="ready")
    port = free_port()
    env = service_env(redis_url)
    server = start_server(port, env, tmp_path)
    junk = "x" * 20_000
    heartbeat = {
        "type": "heartbeat",
        "inventory": {"cpu_count": 4, "junk": junk, "gpus": [{"memory_bytes": 1, "evil": "y" * 100}] * 50},
        "roles": [{"deployment": deployment.runtime_key, "role_name": "main", "state": "ready", "x": "z" * 1000}] * 20,
    }
    role_state = {
        "type": "role_state",
        "deployment": deployment.runtime_key,
        "role": "main",
        "role_name": "main",
        "state": "ready",
        "metrics": {"recall": 0.5, "recall_per_layer": [0.25] * 5000, "junk": junk},
        "memory": {"host_bytes": 1, "evil": 2},
    }
    frames = 1000

    def rss_kib() -> int:
        status = Path(f"/proc/{server.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))

    async def flood() -> tuple[int, list[dict]]:
        headers = {"Authorization": f"Node {node.pk}:{secret}", PROTOCOL_HEADER: str(AGENT_PROTOCOL)}
        url = f"ws://127.0.0.1:{port}{LINK_PATH}"
        texts = [json.dumps(heartbeat), json.dumps(role_state)]
        sent, answers = 0, []
        async with connect(url, additional_headers=headers, max_size=None) as ws:
            for i in range(frames):
                progress = {"type": "task_progress", "task_id": str(uuid.uuid4()), "done": i, "total": frames}
                for text in (*texts, json.dumps(progress)):
                    await ws.send(text)
                    sent += len(text)
                if i % 250 == 249:  # now and then, a frame the link must answer, and it does
                    await ws.send(json.dumps({"type": "nonsense"}))
                    while (answer := json.loads(await asyncio.wait_for(ws.recv(), timeout=60)))["type"] != "error":
                        pass  # a command the control plane sent it meanwhile
                    answers.append(answer)
        return sent, answers

    try:
        deadline = time.monotonic() + 60
        while not http_up(f"http://127.0.0.1:{port}/api/schema/") and time.monotonic() < deadline:
            time.sleep(0.2)
        before = rss_kib()
        began = time.monotonic()
        sent, answers = asyncio.run(flood())
        grown = rss_kib() - before
        assert len(answers) == frames // 250 and all("nonsense" in a["detail"] for a in answers)  # it still answers
        print(
            f"sent {sent / 2**20:.0f} MiB in {3 * frames} frames in {time.monotonic() - began:.0f} s; "
            f"the server's memory grew {grown / 1024:.0f} MiB"
        )
        assert grown * 1024 < sent / 4  # holding the frames grew it by 76 MiB of 94 sent; now by 9
        deadline = time.monotonic() + 30
        while Node.objects.get(pk=node.pk).inventory.get("cpu_count") != 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        inventory = Node.objects.get(pk=node.pk).inventory
        assert set(inventory) <= set(ENTRIES) | {"gpus"} and "junk" not in inventory
        assert all(set(gpu) == {"memory_bytes"} for gpu in inventory["gpus"]) and len(json.dumps(inventory)) < 4096
        member = DeploymentNode.objects.get(deployment=deployment)
        assert set(member.metrics) <= set(RUNTIME_METRICS) and member.metrics.get("recall") in (None, 0.5)
        assert set(member.memory) <= set(MEMORY_FIGURES)
        assert len(json.dumps(member.metrics)) + len(member.detail) < 4096
        assert not NodeTask.objects.exists()
    finally:
        server.kill()
        server.wait(timeout=20)


@pytest.mark.django_db(transaction=True)
def test_the_links_writes_keep_their_connections_and_replace_a_dropped_one() -> None:
    """Heartbeats are written on a few threads that keep their connection (CONN_MAX_AGE is 0 for
    requests); a connection that went away is replaced on the next write, which succeeds."""
    import threading

    from asgiref.sync import async_to_sync
    from django.db import connection

    from controlplane.nodes import link_writes

    def which() -> tuple[int, object]:
        Node.objects.count()  # a query: the thread's connection is open
        return threading.get_ident(), connection.connection  # held in ``seen``: no two alive share an id

    def drop() -> None:
        Node.objects.count()
        connection.close()  # as a server restart or a failed health check leaves it

    async def writes(fn, n: int) -> list:
        return [await link_writes.write(fn) for _ in range(n)]

    seen = async_to_sync(writes)(which, 24)
    per_thread: dict[int, set[int]] = {}
    for thread, conn in seen:
        per_thread.setdefault(thread, set()).add(id(conn))
    assert len(per_thread) <= link_writes.THREADS and all(len(conns) == 1 for conns in per_thread.values())
    async_to_sync(writes)(drop, link_writes.THREADS * 3)
    assert len(async_to_sync(writes)(which, 8)) == 8
