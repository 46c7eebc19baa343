"""Running deployments without processes: what the control plane sends agents and how it reads their reports.

Commands travel on the real channel layer (the test Redis); each test listens on the node
groups the way an agent's socket would.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels import DEFAULT_CHANNEL_LAYER
from channels.layers import channel_layers
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from controlplane.artifacts.models import ModelArtifact
from controlplane.artifacts.services import register_model
from controlplane.config.asgi import application
from controlplane.console.snapshot import snapshot
from controlplane.deployments import lifecycle
from controlplane.deployments.models import Deployment, DeploymentNode, DeploymentStatus, MemberState
from controlplane.deployments.peers import PeerError, Seat, peer_table, pick_ports
from controlplane.deployments.services import DeploymentError, create_deployment, memory_plan
from controlplane.nodes.credentials import NODE_SECRET_PREFIX, digest, new_secret
from controlplane.nodes.groups import node_group
from controlplane.nodes.models import Node, NodeStatus
from controlplane.nodes.services import create_join_token, enroll_node, expire_silent_nodes, record_heartbeat
from inference.modelio.shards import verify_shard
from inference.runtime.curve import CurveKeys, check_keys, endpoint_keys_from_json
from inference.runtime.spec import DeploymentSettings, RoleSpec, validate_spec
from inference.wire.link import (
    AGENT_PROTOCOL,
    COMMANDS,
    LINK_PATH,
    PROTOCOL_HEADER,
    RoleState,
    StartRole,
    StopRole,
    parse,
)

# --- the peer table: pure decisions ----------------------------------------------------------

AGENT_HEADER = (PROTOCOL_HEADER.lower().encode(), str(AGENT_PROTOCOL).encode())  # as an agent of this protocol


def test_ports_come_from_what_each_node_offered_and_never_collide() -> None:
    seats = [Seat("main", "a", "10.0.0.1", [7000, 7001]), Seat("worker-0", "b", "10.0.0.1", [7000, 7002])]
    assert pick_ports(seats) == {"main": 7000, "worker-0": 7002}  # same host: the second takes another port
    seats = [Seat("main", "a", "10.0.0.1", [7000]), Seat("worker-0", "b", "10.0.0.2", [7000])]
    assert pick_ports(seats) == {"main": 7000, "worker-0": 7000}  # different hosts may share a number


@pytest.mark.parametrize(
    "seat, reason",
    [
        (Seat("main", "a", "", [7000]), "has not reported the address"),
        (Seat("main", "a", "10.0.0.1", []), "reported no free port"),
    ],
)
def test_a_node_without_address_or_ports_is_a_clear_error(seat: Seat, reason: str) -> None:
    with pytest.raises(PeerError, match=reason):
        pick_ports([seat])


def test_the_peer_table_lists_workers_in_index_order() -> None:
    hosts = {"main": "h0", "shadow": "h1", "worker-0": "h2", "worker-1": "h3"}
    ports = {"main": 1, "shadow": 2, "worker-0": 3, "worker-1": 4}
    assert peer_table(hosts, ports, 2) == {
        "main": "tcp://h0:1",
        "shadow": "tcp://h1:2",
        "workers": ["tcp://h2:3", "tcp://h3:4"],
    }
    del hosts["shadow"], ports["shadow"]  # a deployment without a shadow seat
    assert peer_table(hosts, ports, 2)["shadow"] is None


# --- the lifecycle, against the database and the channel layer --------------------------------


class Inbox:
    """What an agent's socket would receive: a channel in each node's group.

    Each call uses a layer of its own: a channel layer is bound to one event loop, and every
    ``async_to_sync`` call runs on a new one.
    """

    def __init__(self, nodes: list[Node]) -> None:
        self.channels = {str(node.pk): f"test-inbox-{uuid.uuid4().hex}" for node in nodes}
        for node_id, channel in self.channels.items():
            self._with_layer(lambda layer, n=node_id, c=channel: layer.group_add(node_group(n), c))

    def take(self, node: Node) -> list:
        channel = self.channels[str(node.pk)]

        async def drain(layer) -> list:
            got = []
            while True:
                try:
                    message = await asyncio.wait_for(layer.receive(channel), timeout=0.3)
                except TimeoutError:
                    return got
                got.append(parse(message["command"], allowed=COMMANDS))

        return self._with_layer(drain)

    @staticmethod
    def _with_layer(use):
        async def run():
            layer = channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)
            try:
                return await use(layer)
            finally:
                await layer.close_pools()

        return async_to_sync(run)()


@pytest.fixture
def cluster(transactional_db, channel_layer_on_test_redis, settings, tmp_path: Path, tiny_model: Path):
    """Four online nodes (main, shadow, two workers) in a draft deployment of the tiny model.

    lru-offload with the shadow as its predictor (its own is main's next gate, without a shadow seat).
    """
    settings.VAR_DIR = tmp_path / "var"
    nodes = []
    for i in range(4):
        _, token = create_join_token(created_by=None)
        node, _ = enroll_node(token=token, name=f"n{i}", inventory={})
        record_heartbeat(node_id=str(node.pk), inventory={"address": "127.0.0.1", "free_ports": [9100 + i, 9200 + i]})
        nodes.append(Node.objects.get(pk=node.pk))
    model = register_model(name="tiny", path=str(tiny_model))
    deployment = create_deployment(
        name="d",
        model=model,
        node_ids=[str(n.pk) for n in nodes],
        kv_period=2,
        strategy="lru-offload",
        predictor="shadow",
    )
    return deployment, nodes, Inbox(nodes)


def pushed(deployment: Deployment) -> Deployment:
    """Start it and run the push the Celery task would run."""
    started = lifecycle.start_deployment(deployment=deployment)
    lifecycle.push_deployment(deployment_id=started.pk, epoch=started.epoch)
    return Deployment.objects.get(pk=deployment.pk)


def report(node: Node, deployment: Deployment, state: str, detail: str = "") -> None:
    member = deployment.members.get(node=node)
    state_of = {"deployment": deployment.runtime_key, "role": member.role, "role_name": member.role_name}
    lifecycle.reconcile(node_id=str(node.pk), reports=[state_of | {"state": state, "detail": detail}], complete=False)


def test_starting_sends_each_node_a_valid_role_spec_with_one_peer_table(cluster, tmp_path: Path) -> None:
    deployment, nodes, inbox = cluster
    deployment = pushed(deployment)
    assert deployment.status == DeploymentStatus.DEPLOYING and deployment.epoch == 1
    specs = []
    for node in nodes:
        (command,) = inbox.take(node)
        assert isinstance(command, StartRole) and command.deployment == deployment.runtime_key
        shard = tmp_path / command.shard
        shard.mkdir()
        spec = command.spec
        specs.append(spec)
        _validate(spec, shard)
        assert spec["settings"]["kv_period"] == 2
        assert spec["settings"]["strategy"] == "lru-offload"  # the deployment's strategy reaches every role
        assert spec["settings"]["predictor"] == "shadow"  # and its predictor
    assert len({str(s["addresses"]) for s in specs}) == 1  # everyone shares one peer table
    assert sorted(s["role"] for s in specs) == ["main", "shadow", "worker", "worker"]


def _addresses(spec: dict):
    from inference.runtime.spec import Addresses

    return Addresses(**spec["addresses"])


def _settings(spec: dict):
    return DeploymentSettings(**spec["settings"])


def _validate(spec: dict, shard: Path) -> None:
    """Check a StartRole's spec as the runtime does (``validate_spec``), with its shard at ``shard``."""
    validate_spec(
        RoleSpec(
            spec["deployment"],
            spec["role"],
            str(shard),
            _addresses(spec),
            spec["worker"],
            _settings(spec),
            endpoint_keys_from_json(spec["curve"]),
        )
    )


def test_ready_only_when_every_role_is_and_a_failed_role_fails_the_deployment(cluster) -> None:
    deployment, nodes, inbox = cluster
    deployment = pushed(deployment)
    for node in nodes[:-1]:
        report(node, deployment, "ready")
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.DEPLOYING and "starting" not in deployment.status_reason
    report(nodes[-1], deployment, "ready")
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.READY
    for node in nodes:
        inbox.take(node)
    report(nodes[2], deployment, "failed", "shard worker-0: sha256 mismatch")
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.FAILED and "sha256 mismatch" in deployment.status_reason
    assert all(isinstance(c, StopRole) for node in nodes for c in inbox.take(node))


def test_an_offline_node_degrades_the_deployment_and_its_return_restarts_its_role(cluster) -> None:
    deployment, nodes, inbox = cluster
    deployment = pushed(deployment)
    for node in nodes:
        report(node, deployment, "ready")
        inbox.take(node)
    victim = nodes[3]
    Node.objects.filter(pk=victim.pk).update(last_seen=victim.last_seen.replace(year=2000))
    assert expire_silent_nodes(timeout_s=15) == [victim.name]  # what the beat task does
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.DEGRADED and victim.name in deployment.status_reason
    # The agent comes back without its role (it restarted): the control plane sends the role again.
    record_heartbeat(node_id=str(victim.pk), inventory={"address": "127.0.0.1"}, roles=[])
    (command,) = inbox.take(victim)
    assert isinstance(command, StartRole) and command.deployment == deployment.runtime_key
    assert deployment.members.get(node=victim).state == MemberState.PENDING
    # A second heartbeat before the agent acted on it does not send it twice.
    record_heartbeat(node_id=str(victim.pk), inventory={"address": "127.0.0.1"}, roles=[])
    assert inbox.take(victim) == []
    report(victim, deployment, "ready")
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.READY


def test_stop_tells_every_role_to_stop_and_a_stale_role_is_stopped_when_reported(cluster) -> None:
    deployment, nodes, inbox = cluster
    deployment = pushed(deployment)
    old_key = deployment.runtime_key
    for node in nodes:
        inbox.take(node)
    lifecycle.stop_deployment(deployment=deployment)
    for node in nodes:
        assert inbox.take(node) == [StopRole(deployment=old_key)]
    # A box that missed the stop and still runs the role is told again when it reports it.
    role_name = deployment.members.get(node=nodes[0]).role_name
    stale = {"deployment": old_key, "role": role_name.split("-")[0], "role_name": role_name, "state": "ready"}
    lifecycle.reconcile(node_id=str(nodes[0].pk), reports=[stale], complete=True)
    assert inbox.take(nodes[0]) == [StopRole(deployment=old_key, role_name=role_name)]
    # Redeploy: a new epoch, so roles of the old run can never be mistaken for the new one.
    again = pushed(Deployment.objects.get(pk=deployment.pk))
    assert again.epoch == 2 and again.runtime_key != old_key


def test_starting_needs_every_agent_connected_and_changes_nothing_otherwise(cluster) -> None:
    deployment, nodes, _ = cluster
    Node.objects.filter(pk=nodes[1].pk).update(status=NodeStatus.OFFLINE)
    with pytest.raises(DeploymentError, match="not connected: n1"):
        lifecycle.start_deployment(deployment=deployment)
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.DRAFT and deployment.epoch == 0


def test_only_staff_start_stop_change_or_generate(cluster) -> None:
    deployment, _, _ = cluster
    user = APIClient()
    user.force_authenticate(get_user_model().objects.create_user("someone"))
    base = f"/api/deployments/{deployment.pk}"
    assert user.post(f"{base}/start").status_code == 403
    assert user.post(f"{base}/stop").status_code == 403
    assert user.patch(f"{base}/settings", {"token_period": 4, "kv_period": 4}, format="json").status_code == 403
    assert user.post(f"{base}/generate", {"prompt_ids": [1]}, format="json").status_code == 403
    assert APIClient().post(f"{base}/start").status_code in (401, 403)
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.DRAFT and deployment.kv_period == 2


def test_generating_on_a_deployment_that_is_not_ready_says_why(cluster) -> None:
    deployment, _, _ = cluster
    staff = APIClient()
    staff.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))
    answer = staff.post(f"/api/deployments/{deployment.pk}/generate", {"prompt_ids": [1, 2]}, format="json")
    assert answer.status_code == 409 and "draft" in answer.json()["detail"]
    bad = staff.post(f"/api/deployments/{deployment.pk}/generate", {"prompt_ids": []}, format="json")
    assert bad.status_code == 400 and "prompt_ids" in bad.json()


def test_a_roles_memory_travels_from_its_agent_to_the_api_and_the_console(cluster) -> None:
    deployment, _, _ = cluster
    deployment = pushed(deployment)
    main = deployment.members.select_related("node").get(role="main")
    secret = new_secret(NODE_SECRET_PREFIX)  # this node's credential, known to the test
    Node.objects.filter(pk=main.node_id).update(secret_hash=digest(secret))
    memory = {"host_bytes": 3 * 2**30, "peak_host_bytes": 5 * 2**30, "device_bytes": 7 * 2**30}
    state = RoleState(
        deployment=deployment.runtime_key, role="main", role_name="main", state="ready", memory=memory
    ).to_json()
    staff = APIClient()
    staff.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))

    def shown() -> tuple[dict, dict, dict]:
        listed = staff.get("/api/deployments").json()["results"][0]
        detail = staff.get(f"/api/deployments/{deployment.pk}").json()
        console = snapshot()["deployments"][0]
        return tuple({m["role"]: m["memory"] for m in d["members"]} for d in (listed, detail, console))

    async def agent_session() -> tuple:
        headers = [(b"authorization", f"Node {main.node_id}:{secret}".encode()), AGENT_HEADER]
        comm = WebsocketCommunicator(application, LINK_PATH, headers=headers)
        connected, _ = await comm.connect()
        assert connected
        await comm.send_json_to(state)
        await comm.send_json_to({**state, "memory": {"host_bytes": -1}})  # refused on arrival
        error = await comm.receive_json_from(timeout=5)
        # The link writes what it accepted in the background, in order: wait until the first is in.
        deadline = time.monotonic() + 10
        seen = await sync_to_async(shown)()
        while not seen[0].get("main") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            seen = await sync_to_async(shown)()
        await comm.disconnect()
        return error, seen

    error, (listed, detail, console) = async_to_sync(agent_session)()
    assert error["type"] == "error" and "memory" in error["detail"]
    assert listed["main"] == detail["main"] == console["main"] == memory
    assert listed["shadow"] == {} and console["worker-0"] == {}  # no answer from those yet
    # The agent's link closed: its node is offline and its figures are gone with it.
    member = deployment.members.get(role="main")
    assert (member.state, member.memory) == (MemberState.OFFLINE, {})
    # Back, a heartbeat carries the latest figures (unchecked on arrival: what is not a byte count is left out).
    bad = {**state, "memory": {**memory, "device_bytes": "7 GB"}}
    record_heartbeat(node_id=str(main.node_id), inventory={"address": "127.0.0.1"}, roles=[bad])
    assert deployment.members.get(role="main").memory == {"host_bytes": 3 * 2**30, "peak_host_bytes": 5 * 2**30}
    record_heartbeat(node_id=str(main.node_id), inventory={"address": "127.0.0.1"}, roles=[state])
    assert deployment.members.get(role="main").memory == memory
    lifecycle.stop_deployment(deployment=deployment)
    assert deployment.members.get(role="main").memory == {}


def test_a_quantized_shadow_fetches_its_shard_converted_once_by_the_shard_build(cluster) -> None:
    deployment, nodes, inbox = cluster
    Deployment.objects.filter(pk=deployment.pk).update(shadow_dtype="nf4")
    deployment = pushed(Deployment.objects.get(pk=deployment.pk))
    artifact = ModelArtifact.objects.get(pk=deployment.model_id)
    assert artifact.shard_shadow_dtypes == ["nf4"]
    shadow_node = deployment.members.get(role="shadow").node
    commands = {str(node.pk): inbox.take(node) for node in nodes}
    (start,) = commands[str(shadow_node.pk)]
    assert start.shard == "shadow-nf4"  # the tiny model is fp32: its nf4 shadow is ~1/7 of it
    manifest = verify_shard(Path(artifact.shard_dir) / "shadow-nf4", expect_role="shadow")
    assert manifest["shadow_dtype"] == "nf4"
    assert {c.shard for cs in commands.values() for c in cs} - {"shadow-nf4"} == {"main", "worker-0", "worker-1"}

    # Another shadow dtype later adds its shard; nothing else is rebuilt.
    lifecycle.stop_deployment(deployment=deployment)
    main_parts = {p: p.stat().st_mtime_ns for p in (Path(artifact.shard_dir) / "main").glob("part-*")}
    Deployment.objects.filter(pk=deployment.pk).update(shadow_dtype="int8")
    pushed(Deployment.objects.get(pk=deployment.pk))
    artifact.refresh_from_db()
    assert artifact.shard_shadow_dtypes == ["nf4", "int8"]
    assert {p: p.stat().st_mtime_ns for p in main_parts} == main_parts
    start = next(c for c in inbox.take(shadow_node) if isinstance(c, StartRole))
    assert start.shard == "shadow-int8"


def test_a_coded_deployment_gets_its_own_shard_set_which_an_uncoded_one_of_the_model_never_confuses(cluster) -> None:
    """The deployment's expert_codec reaches the shard build (a set per codec, reused once built),
    every role's spec, the shard each agent is served, and the fit check's bytes."""
    deployment, nodes, inbox = cluster
    Deployment.objects.filter(pk=deployment.pk).update(expert_codec="exponent-plane")
    coded = pushed(Deployment.objects.get(pk=deployment.pk))
    artifact = ModelArtifact.objects.get(pk=coded.model_id)
    coded_dir = Path(artifact.shard_dir)
    assert (coded_dir.name, artifact.shard_expert_codec) == ("workers-2-exponent-plane", "exponent-plane")
    assert verify_shard(coded_dir / "worker-0", expect_role="worker", expect_worker=0)["stored"]  # coded experts
    assert "stored" not in verify_shard(coded_dir / "main", expect_role="main")  # main's never is
    for node in nodes:
        (start,) = inbox.take(node)
        assert start.spec["settings"]["expert_codec"] == "exponent-plane"
    worker_node = coded.members.get(role="worker", worker_index=0).node
    assert _served_manifest(worker_node, artifact, "worker-0")["stored"]

    # The fit check counts the coded set's bytes once it is built: a worker's RAM and disk hold fewer.
    plans = {
        codec: memory_plan(
            model=artifact,
            workers=2,
            settings=DeploymentSettings(shadow_dtype="fp32", strategy="lru-offload", max_batch=8, expert_codec=codec),
        )
        for codec in ("none", "exponent-plane")
    }
    plain_worker, coded_worker = (next(r for r in plans[c].roles if r.role == "worker-0") for c in plans)
    assert coded_worker.disk_bytes < plain_worker.disk_bytes and coded_worker.host_bytes < plain_worker.host_bytes

    # Another deployment of the model, uncoded, gets a set of its own; the coded one is left as it was.
    lifecycle.stop_deployment(deployment=coded)
    coded_files = {p: p.stat().st_mtime_ns for p in coded_dir.rglob("*.safetensors")}
    plain = create_deployment(
        name="plain", model=artifact, node_ids=[str(n.pk) for n in nodes], strategy="lru-offload", predictor="shadow"
    )
    plain = pushed(plain)
    artifact.refresh_from_db()
    plain_dir = Path(artifact.shard_dir)
    assert (plain_dir.name, artifact.shard_expert_codec) == ("workers-2", "none")
    assert "stored" not in verify_shard(plain_dir / "worker-0", expect_role="worker", expect_worker=0)
    assert {p: p.stat().st_mtime_ns for p in coded_files} == coded_files
    plain_worker_node = plain.members.get(role="worker", worker_index=0).node
    assert "stored" not in _served_manifest(plain_worker_node, artifact, "worker-0")
    for node in nodes:
        (start,) = [c for c in inbox.take(node) if isinstance(c, StartRole)]
        assert start.spec["settings"]["expert_codec"] == "none"

    # Started again, the coded deployment reuses its set: nothing is rebuilt, and its workers get it.
    lifecycle.stop_deployment(deployment=plain)
    plain_files = {p: p.stat().st_mtime_ns for p in plain_dir.rglob("*.safetensors")}
    coded = pushed(Deployment.objects.get(pk=coded.pk))
    assert coded.status == DeploymentStatus.DEPLOYING, coded.status_reason
    artifact.refresh_from_db()
    assert Path(artifact.shard_dir) == coded_dir and artifact.shard_expert_codec == "exponent-plane"
    assert {p: p.stat().st_mtime_ns for p in coded_files} == coded_files
    assert {p: p.stat().st_mtime_ns for p in plain_files} == plain_files
    worker_node = coded.members.get(role="worker", worker_index=0).node
    assert _served_manifest(worker_node, artifact, "worker-0")["stored"]


def _served_manifest(node: Node, artifact: ModelArtifact, shard: str) -> dict:
    """The manifest of ``shard`` as the shard API serves it to ``node``'s agent."""
    agent = APIClient()
    agent.force_authenticate(user=None, token=node)
    response = agent.get(f"/api/models/{artifact.pk}/shards/{shard}/manifest.json")
    assert response.status_code == 200, response
    return json.loads(b"".join(response.streaming_content))


def test_removing_a_node_stops_its_deployment_which_cannot_start_without_it(cluster) -> None:
    deployment, nodes, inbox = cluster
    deployment = pushed(deployment)
    for node in nodes:
        inbox.take(node)  # the StartRoles
    worker = deployment.members.get(role="worker", worker_index=1).node
    staff = APIClient()
    staff.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))
    assert staff.delete(f"/api/nodes/{worker.pk}").status_code == 204  # was a 500 (a protected row)
    assert not Node.objects.filter(pk=worker.pk).exists()
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.FAILED
    assert f"node {worker.name} (worker-1) was removed; start it again" in deployment.status_reason
    assert deployment.name == "d" and deployment.kv_period == 2  # what the user set is kept
    for node in nodes:
        if node.pk != worker.pk:
            assert any(isinstance(c, StopRole) for c in inbox.take(node))
    # One worker fewer is still a deployment: it starts again on the rest, renumbered.
    assert [m.worker_index for m in deployment.members.filter(role="worker")] == [0]
    assert staff.post(f"/api/deployments/{deployment.pk}/start").status_code == 202
    lifecycle.stop_deployment(deployment=Deployment.objects.get(pk=deployment.pk))
    # Without its main it is not one: it says so and changes nothing.
    main = deployment.members.get(role="main").node
    assert staff.delete(f"/api/nodes/{main.pk}").status_code == 204
    again = staff.post(f"/api/deployments/{deployment.pk}/start")
    assert again.status_code == 409 and "lost a node" in again.json()["detail"]
    assert Deployment.objects.get(pk=deployment.pk).status == DeploymentStatus.FAILED


def test_a_removed_nodes_open_link_is_closed_at_once(cluster) -> None:
    from controlplane.nodes.services import remove_node

    _, nodes, _ = cluster
    node = nodes[3]
    secret = new_secret(NODE_SECRET_PREFIX)
    Node.objects.filter(pk=node.pk).update(secret_hash=digest(secret))

    async def run() -> int:
        link = WebsocketCommunicator(
            application, LINK_PATH, headers=[(b"authorization", f"Node {node.pk}:{secret}".encode()), AGENT_HEADER]
        )
        connected, _ = await link.connect()
        assert connected
        await sync_to_async(remove_node)(node=await sync_to_async(Node.objects.get)(pk=node.pk))
        closing = await link.receive_output(timeout=5)
        return closing.get("code")

    assert async_to_sync(run)() == 4401


def test_a_box_with_four_gpus_runs_a_role_on_each_and_reports_them_together(
    transactional_db, channel_layer_on_test_redis, settings, tmp_path: Path, tiny_model: Path
) -> None:
    """One box of four GPUs is a whole deployment: main, shadow and two workers, each on its own cuda:N."""
    settings.VAR_DIR = tmp_path / "var"
    _, token = create_join_token(created_by=None)
    node, _ = enroll_node(token=token, name="quad", inventory={})
    gpus = [{"index": i, "name": "RTX 3090", "memory_bytes": 24 * 2**30} for i in range(4)]
    inventory = {"address": "127.0.0.1", "free_ports": [9300, 9301, 9302, 9303, 9304], "gpus": gpus}
    record_heartbeat(node_id=str(node.pk), inventory=inventory | {"ram_bytes": 64 * 2**30})
    node = Node.objects.get(pk=node.pk)
    inbox = Inbox([node])
    model = register_model(name="tiny", path=str(tiny_model))
    deployment = create_deployment(name="quad", model=model, node_ids=[str(node.pk)])
    members = {m.role_name: m for m in deployment.members.all()}
    assert sorted(members) == ["main", "shadow", "worker-0", "worker-1"]
    assert sorted(m.gpu for m in members.values()) == [0, 1, 2, 3]
    deployment = pushed(deployment)
    commands = inbox.take(node)
    assert len(commands) == 4 and all(isinstance(c, StartRole) for c in commands)
    devices = set()
    for command in commands:
        settings_ = command.spec["settings"]
        member = members[command.shard if not command.shard.startswith("shadow") else "shadow"]
        assert settings_["device"] == f"cuda:{member.gpu}"
        devices.add(settings_["device"])
    assert devices == {"cuda:0", "cuda:1", "cuda:2", "cuda:3"}
    table = commands[0].spec["addresses"]
    inboxes = [table["main"], table["shadow"], *table["workers"]]
    assert len(set(inboxes)) == 4  # four inboxes on one host: four ports
    # One heartbeat carries every role: ready once all four are.
    states = [
        RoleState(deployment=deployment.runtime_key, role=m.role, role_name=name, state="ready").to_json()
        for name, m in members.items()
    ]
    record_heartbeat(node_id=str(node.pk), inventory=inventory, roles=states[:3])
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.DEPLOYING
    record_heartbeat(node_id=str(node.pk), inventory=inventory, roles=states)
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.READY
    # A role that one heartbeat no longer lists is sent again (once it is due), the others left alone.
    lifecycle.reconcile(node_id=str(node.pk), reports=states[1:], complete=True)
    inbox.take(node)
    missing = members[states[0]["role_name"]]
    DeploymentNode.objects.filter(pk=missing.pk).update(start_sent_at=None)
    lifecycle.reconcile(node_id=str(node.pk), reports=states[1:], complete=True)
    (again,) = inbox.take(node)
    assert isinstance(again, StartRole) and again.spec["settings"]["device"] == f"cuda:{missing.gpu}"
    lifecycle.stop_deployment(deployment=Deployment.objects.get(pk=deployment.pk))
    assert inbox.take(node) == [StopRole(deployment=deployment.runtime_key)]  # one stop for all four


def _seat_keys(commands: list) -> tuple[dict, dict]:
    """By role name, the role's keys and its client's pair, as each StartRole carries them."""
    from agent.runtime import role_name_of

    roles = {role_name_of(c.spec): endpoint_keys_from_json(c.spec["curve"]) for c in commands}
    clients = {role_name_of(c.spec): check_keys(CurveKeys(**c.client_keys)) for c in commands}
    return roles, clients


def test_each_start_gives_every_seat_its_own_new_keys_that_no_api_shows(cluster) -> None:
    deployment, nodes, inbox = cluster
    deployment = pushed(deployment)
    commands = [c for node in nodes for c in inbox.take(node)]
    roles, clients = _seat_keys(commands)
    assert sorted(roles) == ["main", "shadow", "worker-0", "worker-1"]
    publics = {k.pair.public for k in roles.values()} | {c.public for c in clients.values()}
    assert len(publics) == 8  # a role pair and a client pair per seat, all different
    for seat, keys in roles.items():  # each admits its own client, and knows its peers' own keys
        assert keys.peers.pop("client") == clients[seat].public
        assert all(public == roles[peer].pair.public for peer, public in keys.peers.items())
    assert set(roles["worker-0"].peers) == {"main", "shadow"}  # no other worker's key
    staff = APIClient()
    staff.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))
    shown = staff.get(f"/api/deployments/{deployment.pk}").content + staff.get("/api/deployments").content
    secrets = [k.pair.secret for k in roles.values()] + [c.secret for c in clients.values()]
    assert not any(secret.encode() in shown for secret in secrets)
    assert b"curve" not in shown and b"_key" not in shown
    member = deployment.members.get(role="main")
    shown_elsewhere = repr(member) + str(member) + "".join(repr(c) for c in commands)  # what a log line could hold
    assert not any(secret in shown_elsewhere for secret in secrets)
    lifecycle.stop_deployment(deployment=deployment)
    again = pushed(Deployment.objects.get(pk=deployment.pk))
    roles_again, clients_again = _seat_keys([c for node in nodes for c in inbox.take(node) if isinstance(c, StartRole)])
    publics_again = {k.pair.public for k in roles_again.values()} | {c.public for c in clients_again.values()}
    assert len(publics_again) == 8 and not publics_again & publics and again.epoch == 2


def test_a_next_gate_deployment_runs_without_a_shadow_and_builds_no_shadow_shard(
    transactional_db, channel_layer_on_test_redis, settings, tmp_path: Path, tiny_model: Path
) -> None:
    """odmoe with main's next-gate predictor: main and workers only, their peer table without a shadow."""
    settings.VAR_DIR = tmp_path / "var"
    nodes = []
    for i in range(3):
        _, token = create_join_token(created_by=None)
        node, _ = enroll_node(token=token, name=f"g{i}", inventory={})
        record_heartbeat(node_id=str(node.pk), inventory={"address": "127.0.0.1", "free_ports": [9400 + i]})
        nodes.append(Node.objects.get(pk=node.pk))
    inbox = Inbox(nodes)
    model = register_model(name="tiny", path=str(tiny_model))
    ids = [str(n.pk) for n in nodes]
    deployment = create_deployment(name="g", model=model, node_ids=ids, predictor="next-gate", shadow_dtype="nf4")
    assert sorted(m.role_name for m in deployment.members.all()) == ["main", "worker-0", "worker-1"]
    deployment = pushed(deployment)
    assert ModelArtifact.objects.get(pk=model.pk).shard_shadow_dtypes == []  # no nf4 shadow converted for nobody
    specs = []
    for node in nodes:
        (command,) = inbox.take(node)
        shard = tmp_path / command.shard
        shard.mkdir()
        spec = command.spec
        specs.append(spec)
        _validate(spec, shard)
        assert spec["settings"]["predictor"] == "next-gate" and spec["settings"]["strategy"] == "odmoe"
        assert spec["addresses"]["shadow"] is None and len(spec["addresses"]["workers"]) == 2
    assert sorted(s["role"] for s in specs) == ["main", "worker", "worker"]
    for node in nodes:
        report(node, deployment, "ready")
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.READY
    assert [m["role"] for m in snapshot()["deployments"][0]["members"]] == ["main", "worker-0", "worker-1"]
    assert snapshot()["deployments"][0]["predictor"] == "next-gate"
    lifecycle.stop_deployment(deployment=deployment)
    # Its predictor changed to the shadow behind the API's back: it has no seat for one, and says so.
    Deployment.objects.filter(pk=deployment.pk).update(predictor="shadow")
    with pytest.raises(DeploymentError, match="has no shadow seat, and its predictor is now the shadow"):
        lifecycle.start_deployment(deployment=Deployment.objects.get(pk=deployment.pk))
    Deployment.objects.filter(pk=deployment.pk).update(strategy="full-cache", predictor="next-gate")
    with pytest.raises(DeploymentError, match="full-cache loads only what is routed and takes no predictor"):
        lifecycle.start_deployment(deployment=Deployment.objects.get(pk=deployment.pk))
    assert Deployment.objects.get(pk=deployment.pk).status == DeploymentStatus.STOPPED


def test_a_deployment_created_with_a_shadow_seat_still_starts_under_a_strategy_without_one(cluster) -> None:
    """Deployments from before the predictor setting have a shadow seat whatever their strategy: it idles."""
    deployment, nodes, inbox = cluster
    Deployment.objects.filter(pk=deployment.pk).update(strategy="full-cache", predictor="")
    deployment = pushed(Deployment.objects.get(pk=deployment.pk))
    assert deployment.status == DeploymentStatus.DEPLOYING
    specs = [c.spec for node in nodes for c in inbox.take(node)]
    assert sorted(s["role"] for s in specs) == ["main", "shadow", "worker", "worker"]
    assert all(s["addresses"]["shadow"] is not None for s in specs)


def test_a_deployment_s_draft_tokens_reach_every_role_s_settings(cluster) -> None:
    deployment, nodes, inbox = cluster
    Deployment.objects.filter(pk=deployment.pk).update(draft_tokens=3, draft_policy="auto")
    pushed(Deployment.objects.get(pk=deployment.pk))
    for node in nodes:
        (start,) = inbox.take(node)
        assert (start.spec["settings"]["draft_tokens"], start.spec["settings"]["draft_policy"]) == (3, "auto")
