"""Heartbeats at rack scale: liveness in Redis at every heartbeat, the node's row and its roles'
report written only on change or after a while (``controlplane.nodes.beats``, ``liveness``), and a
silent node still turned offline on time (``services.expire_silent_nodes``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from controlplane.nodes import liveness, services, signals
from controlplane.nodes.beats import Beats
from controlplane.nodes.inventory import lasting
from controlplane.nodes.models import Node, NodeStatus
from controlplane.nodes.services import expire_silent_nodes, send_command
from inference.wire.link import Heartbeat
from tests.controlplane.test_agent_link import communicator, enrolled, status_within

READY = {"deployment": "dep1-1", "role": "worker", "role_name": "worker-0", "state": "ready", "detail": ""}


def report(**changes) -> list[dict]:
    """A worker's report, as a heartbeat carries it (``changes`` on top)."""
    return [{**READY, "memory": {"host_bytes": 1_000}, **changes}]


def test_a_link_writes_the_row_and_acts_on_the_roles_only_on_change_or_after_a_while() -> None:
    beats = Beats(refresh_s=30.0, stall_s=7.5)

    def heartbeat(at: float, roles: list[dict], *, writable: bool = True) -> tuple[bool, int | None]:
        beats.beat(at)
        return beats.row_due(at, writable=writable), beats.roles_due(roles, at)

    row, epoch = heartbeat(0.0, report())
    assert row and epoch is not None  # the link's first: both
    assert heartbeat(5.0, report()) == (False, None)  # acting on the same report is still under way
    beats.acted(epoch, False)  # it did something: not settled
    row, epoch = heartbeat(7.0, report())
    assert not row and epoch is not None  # not settled: the roles again
    beats.acted(epoch, True)
    assert heartbeat(10.0, report()) == (False, None)  # settled, the same report: nothing
    assert heartbeat(15.0, report(memory={"host_bytes": 2_000})) == (False, None)  # memory alone: nothing
    row, epoch = heartbeat(20.0, report(state="failed", detail="out of memory"))
    assert not row and epoch is not None  # what the role does changed: acted on
    beats.acted(epoch - 1, True)  # a late answer for an older report changes nothing
    assert heartbeat(25.0, report(state="failed", detail="out of memory"))[1] is None  # its own: under way
    beats.unsettle()  # a command went down the link: acted on again, though the last is under way
    assert heartbeat(28.0, report(state="failed", detail="out of memory"))[1] is not None
    beats.acted(epoch, True)  # the answer for the report of 20 comes late: changes nothing
    assert not beats.settled
    beats.acted(beats.epoch, True)
    failed = report(state="failed", detail="out of memory")
    assert heartbeat(31.0, failed) == (True, None)  # the row's 30 s are up; the roles were acted on at 28
    assert heartbeat(35.0, failed) == (False, None)
    assert heartbeat(36.0, failed, writable=False) == (True, None)  # Redis cannot take liveness: the row
    assert heartbeat(37.0, failed, writable=False) == (True, None)  # ... at every heartbeat
    for at in (42.0, 47.0, 52.0, 57.0):
        assert heartbeat(at, failed) == (False, None)
    row, epoch = heartbeat(58.5, failed)
    assert not row and epoch == beats.epoch  # the roles' 30 s since 28 are up
    beats.acted(epoch, True)
    row, epoch = heartbeat(70.0, failed)  # after a gap past stall_s: the node may have been taken offline
    assert row and epoch is not None


def test_a_change_in_what_the_box_holds_reaches_the_row_at_once_and_passing_figures_wait() -> None:
    beats = Beats(refresh_s=30.0, stall_s=7.5)
    box = {"cpu_count": 8, "free_ports": [7001], "disk_free_bytes": 9, "gpus": [{"index": 0, "free_bytes": 5}]}
    assert beats.row_due(0.0, writable=True, lasting=lasting(box))
    moved = {**box, "free_ports": [7002], "disk_free_bytes": 8, "gpus": [{"index": 0, "free_bytes": 4}]}
    assert not beats.row_due(5.0, writable=True, lasting=lasting(moved))  # what moves all the time waits
    fetched = {**moved, "shard_bytes": {"3/worker-0": 100}, "shard_codecs": {"3/worker-0": "exponent-plane"}}
    assert beats.row_due(10.0, writable=True, lasting=lasting(fetched))  # a shard it now holds: at once
    assert not beats.row_due(15.0, writable=True, lasting=lasting(fetched))


@pytest.mark.django_db
def test_a_silent_node_turns_offline_on_time_whichever_clock_holds_it(channel_layer_on_test_redis) -> None:
    """Redis's moment for a node outranks its coarse row; a node Redis does not hold is judged by its
    row, allowed ``ROW_REFRESH_S`` more (its row may lag that much), and none is taken for silent early."""
    now = timezone.now()
    names = ["heard", "silent", "row-fresh", "row-stale", "never-seen"]
    nodes = {name: enrolled(name)[0] for name in names}
    ages = {"heard": 60, "silent": 40, "row-fresh": 20, "row-stale": 15 + liveness.ROW_REFRESH_S + 5}
    for name, age in ages.items():
        Node.objects.filter(pk=nodes[name].pk).update(status=NodeStatus.ONLINE, last_seen=now - timedelta(seconds=age))
    Node.objects.filter(pk=nodes["never-seen"].pk).update(status=NodeStatus.ONLINE, last_seen=None)
    liveness.client().zrem(liveness.HEARD_KEY, *[str(n.pk) for n in nodes.values()])
    liveness.store(batch={str(nodes["heard"].pk): time.time() - 2, str(nodes["silent"].pk): time.time() - 20})
    assert sorted(expire_silent_nodes(timeout_s=15)) == ["never-seen", "row-stale", "silent"]
    assert Node.objects.get(pk=nodes["heard"].pk).status == NodeStatus.ONLINE
    assert Node.objects.get(pk=nodes["row-fresh"].pk).status == NodeStatus.ONLINE
    liveness.store(batch={str(nodes["heard"].pk): time.time() - 100})  # an older moment never goes back
    assert liveness.heard_at([str(nodes["heard"].pk)])[str(nodes["heard"].pk)] > time.time() - 3


def ready_worker():
    """An enrolled node (offline until it is heard), the one worker of a ready deployment: the node,
    its secret and the deployment."""
    from controlplane.artifacts.models import ModelArtifact
    from controlplane.deployments.models import Deployment, DeploymentNode, DeploymentStatus, MemberState, Role

    node, secret = enrolled()
    model = ModelArtifact.objects.create(name="m", path="/nowhere")
    deployment = Deployment.objects.create(name="d", model=model, status=DeploymentStatus.READY)
    DeploymentNode.objects.create(
        deployment=deployment, node=node, role=Role.WORKER, worker_index=0, port=7000, state=MemberState.READY
    )
    return node, secret, deployment


@pytest.fixture
def acted() -> Iterator[list[str]]:
    """The state of each complete roles' report the deployments app is asked to act on, in order."""
    states: list[str] = []

    def count(sender, *, reports, complete, **kwargs) -> bool:
        if complete:
            states.append(reports[0]["state"])
        return True

    signals.runtime_reported.connect(count, weak=False, dispatch_uid="test.count")
    try:
        yield states
    finally:
        signals.runtime_reported.disconnect(dispatch_uid="test.count")


@pytest.mark.django_db(transaction=True)
def test_a_heartbeats_roles_are_acted_on_once_its_row_says_the_node_is_online(
    channel_layer_on_test_redis, acted: list[str], monkeypatch, caplog
) -> None:
    """However long the row's write takes, the roles the same heartbeat reports are acted on after
    it: a ready deployment never sees the node it is hearing from as offline, and one report of an
    unchanged role is acted on once. (Under load the two writes raced, and the deployment went
    degraded, then ready, acting on the report three times.)"""
    node, secret, deployment = ready_worker()  # the node offline until its first heartbeat's row is written
    row_written = services.record_liveness

    def slow_row(**kwargs) -> None:
        time.sleep(0.5)  # a busy database: the roles' write, queued right after, starts first
        row_written(**kwargs)

    monkeypatch.setattr(services, "record_liveness", slow_row)
    roles = [{**READY, "deployment": deployment.runtime_key, "memory": {"host_bytes": 1_000}}]

    async def session() -> str:
        comm = communicator(f"Node {node.pk}:{secret}")
        assert (await comm.connect())[0]
        for _ in range(3):
            await comm.send_json_to(Heartbeat(inventory={"cpu_count": 4}, roles=roles).to_json())
            await asyncio.sleep(0.7)
        said = caplog.text  # before the link closes (that turns the node offline)
        await comm.disconnect()
        return said

    with caplog.at_level("INFO", logger="controlplane.deployments.lifecycle"):
        said = async_to_sync(session)()
    assert acted == ["ready"]  # the first heartbeat's report, with the node online; settled since
    assert "degraded" not in said, said


@pytest.mark.django_db(transaction=True)
def test_repeated_heartbeats_reach_redis_every_time_and_the_database_on_change(
    channel_layer_on_test_redis, acted: list[str]
) -> None:
    """A worker of a ready deployment heartbeats eight times: every moment reaches Redis; the row is
    written by the first (its inventory kept: the later ones differ in free ports alone); its roles are acted on by the
    first, again when its state changed and until that settled, and after a command went down the
    link, never for a repeat, a memory figure or a free port that moved."""
    node, secret, deployment = ready_worker()
    mine = {**READY, "deployment": deployment.runtime_key}

    async def beat(comm, n: int, **changes) -> None:
        roles = [{**mine, "memory": {"host_bytes": 1_000}, **changes}]
        box = {"cpu_count": 4, "free_ports": [7000 + n]}  # a fresh pick of free ports each time, as agents send
        await comm.send_json_to(Heartbeat(inventory=box, roles=roles).to_json())
        await asyncio.sleep(0.4)

    async def session() -> float:
        comm = communicator(f"Node {node.pk}:{secret}")
        assert (await comm.connect())[0]
        await beat(comm, 1)
        assert await status_within(node, NodeStatus.ONLINE, timeout_s=5) == NodeStatus.ONLINE
        await beat(comm, 2)
        await beat(comm, 3, memory={"host_bytes": 5_000})
        await beat(comm, 4, state="starting")  # acted on; the deployment's status moves: not settled
        await beat(comm, 5, state="starting")  # acted on again, and now settled
        await beat(comm, 6, state="starting")
        await sync_to_thread(lambda: send_command(node_id=str(node.pk), command={"type": "ping", "nonce": "n"}))
        assert (await comm.receive_json_from(timeout=5))["type"] == "ping"
        await beat(comm, 7, state="starting")
        await beat(comm, 8, state="starting")
        await asyncio.sleep(liveness.FLUSH_S + 0.5)
        heard = await sync_to_thread(lambda: liveness.heard_at([str(node.pk)]))
        await comm.disconnect()
        return heard[str(node.pk)]

    heard = async_to_sync(session)()
    assert heard > time.time() - 3  # the last heartbeat's moment, in Redis
    node.refresh_from_db()
    assert node.inventory["free_ports"] == [7001]  # the row: the link's first heartbeat alone
    assert acted == ["ready", "starting", "starting", "starting"]  # heartbeats 1, 4, 5 and 7


async def sync_to_thread(fn):
    return await asyncio.get_running_loop().run_in_executor(None, fn)
