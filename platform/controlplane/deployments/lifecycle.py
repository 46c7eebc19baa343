"""Running a deployment: start it, push it to its agents, follow what they report, stop it.

The database says what should run (the *desired* state); agents say what does run (every
heartbeat and every role-state event carries it). ``reconcile`` closes the gap for one node
at a time: it (re)sends the role a node should run, stops a role nobody wants any more,
and sets the deployment's status from its members' states. So a restarted agent, a
control-plane restart or a lost command all heal the same way, and every command sent
is idempotent.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import asdict
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from controlplane.artifacts.services import (
    ModelError,
    build_model_shards,
    needed_shadow_dtypes,
    shadow_shard_name,
    shard_dir_for,
    shard_set_name,
    shards_ready_for,
)
from controlplane.nodes.models import Node, NodeStatus, NodeTask
from controlplane.nodes.services import send_command
from controlplane.queueing import queue_task
from controlplane.storable import storable_json, storable_text
from inference.building.fit import gpu_index
from inference.policies.alignment import validate_periods
from inference.runtime.curve import CurveKeys, SeatKeys, new_seat_keys, role_keys
from inference.wire.link import MEMORY_FIGURES, ApplyAlignment, StartRole, StopRole

from .models import ACTIVE, RUNNING, Deployment, DeploymentNode, DeploymentStatus, MemberState, Role
from .peers import PeerError, Seat, peer_table, pick_ports
from .services import DeploymentError, check_fits, check_nodes_free, check_predictor

log = logging.getLogger(__name__)

PUSH_DEPLOYMENT_TASK = "controlplane.deployments.tasks.push_deployment_task"  # queued by name (controlplane.queueing)
RESEND_AFTER_S = 15.0  # a start command not acted on within this long is sent again
KEY_FIELDS = ("role_public_key", "role_secret_key", "client_public_key", "client_secret_key")
UNAVAILABLE = (NodeStatus.OFFLINE, NodeStatus.ENROLLED)


# --- start, push, stop ---------------------------------------------------------------------


def start_deployment(*, deployment: Deployment) -> Deployment:
    """Deploy: shards are built if needed and each agent told what to fetch and run (in Celery)."""
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if locked.status in RUNNING:
            raise DeploymentError(f"deployment {locked.name} is already {locked.status}; stop it first")
        members = list(locked.members.select_related("node"))
        shadow = check_predictor(locked.strategy, locked.predictor)  # refuses a combination changed since
        if shadow and not any(m.role == Role.SHADOW for m in members) and _complete(members, shadow=False):
            raise DeploymentError(
                f"deployment {locked.name} has no shadow seat, and its predictor is now the shadow; create it again"
            )
        if not _complete(members, shadow=shadow):
            raise DeploymentError(f"deployment {locked.name} lost a node ({locked.status_reason}); create it again")
        check_nodes_free([m.node for m in members], exclude=locked)
        down = [m.node.name for m in members if m.node.status != NodeStatus.ONLINE]
        if down:
            raise DeploymentError(f"these nodes' agents are not connected: {', '.join(down)}")
        # Checked again on every start: inventories (free disk above all) change after creation.
        check_fits(model=locked.model, settings=locked.settings, seats={m.role_name: (m.node, m.gpu) for m in members})
        locked.epoch += 1
        locked.status = DeploymentStatus.DEPLOYING
        locked.status_reason = "queued"
        locked.save(update_fields=["epoch", "status", "status_reason", "updated_at"])
        locked.members.update(state=MemberState.PENDING, detail="", port=None, start_sent_at=None, memory={})
        # New keys per seat and per start: roles of an earlier run cannot talk to this one.
        keys = new_seat_keys(m.role_name for m in members)
        for member in members:
            seat = keys[member.role_name]
            member.role_public_key, member.role_secret_key = seat.role.public, seat.role.secret
            member.client_public_key, member.client_secret_key = seat.client.public, seat.client.secret
        DeploymentNode.objects.bulk_update(members, KEY_FIELDS)
        epoch = locked.epoch
        transaction.on_commit(lambda: queue_task(PUSH_DEPLOYMENT_TASK, locked.pk, epoch))
    return locked


def push_deployment(*, deployment_id: int, epoch: int) -> None:
    """Build the shards if needed, choose ports, and send every node its role (a Celery task)."""
    deployment = Deployment.objects.select_related("model").get(pk=deployment_id)
    if deployment.epoch != epoch or deployment.status != DeploymentStatus.DEPLOYING:
        return  # stopped or started again since: that run pushes itself
    members = list(deployment.members.select_related("node"))
    workers = sum(1 for m in members if m.role == Role.WORKER)
    shadow = any(m.role == Role.SHADOW for m in members)
    artifact = deployment.model
    codec = deployment.expert_codec
    try:
        ready = shards_ready_for(
            artifact, workers=workers, shadow_dtype=deployment.shadow_dtype, shadow=shadow, expert_codec=codec
        )
        if not ready:
            # The shadow's shard comes converted to its dtype: a shadow box downloads nf4, not bf16.
            # A deployment without a shadow seat needs no converted shadow shard. The set of its
            # workers and codec is reused where built (another deployment's, an earlier start's).
            shadow_dtypes = needed_shadow_dtypes(artifact, deployment.shadow_dtype) if shadow else ()
            shadow = f" and its {', '.join(shadow_dtypes)} shadow" if shadow_dtypes else ""
            coded = f", experts coded {codec}" if codec != "none" else ""
            reason = f"building shards of {artifact.name} for {workers} workers{coded}{shadow}"
            _set_status(deployment, DeploymentStatus.DEPLOYING, reason)
            build_model_shards(
                artifact_id=artifact.pk, workers=workers, shadow_dtypes=shadow_dtypes, expert_codec=codec
            )
            deployment.model.refresh_from_db()
    except ModelError as exc:
        _set_status(deployment, DeploymentStatus.FAILED, str(exc))
        return
    seats = [Seat(m.role_name, m.node.name, m.node.address, _free_ports(m.node)) for m in members]
    try:
        ports = pick_ports(seats)
    except PeerError as exc:
        _set_status(deployment, DeploymentStatus.FAILED, str(exc))
        return
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment_id)
        if locked.epoch != epoch or locked.status != DeploymentStatus.DEPLOYING:
            return
        for member in members:
            member.port = ports[member.role_name]
            member.save(update_fields=["port", "updated_at"])
        _set_status(locked, DeploymentStatus.DEPLOYING, "starting roles")
        for member in members:
            _send_start(locked, member, members)


def stop_deployment(*, deployment: Deployment) -> Deployment:
    """Stopped: every role is told to stop and its nodes are free for another deployment."""
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        was_running = locked.status in RUNNING
        locked.status = DeploymentStatus.STOPPED
        locked.status_reason = "stopped by an administrator"
        locked.save(update_fields=["status", "status_reason", "updated_at"])
        locked.members.exclude(state=MemberState.OFFLINE).update(state=MemberState.STOPPED, memory={})
        if was_running:
            key = locked.runtime_key
            nodes = list(locked.members.values_list("node_id", flat=True))
            transaction.on_commit(lambda: _broadcast_stop(nodes, key))
    return locked


def release_node(*, node_id: str, name: str) -> None:
    """A node is being removed: every deployment it belongs to lets go of it.

    A running deployment is stopped (its other roles are told to stop) and fails with the
    reason, keeping its name and settings. Without a worker it can start again with one
    worker fewer (the rest renumbered); without its main or shadow it cannot.
    """
    members = DeploymentNode.objects.filter(node_id=node_id).select_related("deployment")
    for member in list(members):
        deployment = Deployment.objects.select_for_update().get(pk=member.deployment_id)
        role = member.role_name
        if deployment.status in RUNNING:
            key = deployment.runtime_key
            others = list(deployment.members.exclude(node_id=node_id).values_list("node_id", flat=True))
            transaction.on_commit(lambda others=others, key=key: _broadcast_stop(others, key))
        member.delete()
        workers = list(deployment.members.filter(role=Role.WORKER).order_by("worker_index"))
        for index, worker in enumerate(workers):
            if worker.worker_index != index:
                worker.worker_index = index
                worker.save(update_fields=["worker_index", "updated_at"])
        if role.startswith("worker") and workers:
            reason = f"node {name} ({role}) was removed; start it again to run on the {len(workers)} workers left"
        else:
            reason = f"node {name} ({role}) was removed; create the deployment again with another node"
        deployment.status = DeploymentStatus.FAILED
        deployment.status_reason = reason
        deployment.save(update_fields=["status", "status_reason", "updated_at"])


def send_alignment(*, deployment: Deployment) -> None:
    """Hand the deployment's current alignment periods to its running main (no restart)."""
    if deployment.status not in RUNNING:
        return
    main = deployment.members.filter(role=Role.MAIN).first()
    if main is None:
        return
    command = ApplyAlignment(
        deployment=deployment.runtime_key, token_period=deployment.token_period, kv_period=deployment.kv_period
    ).to_json()
    transaction.on_commit(lambda: send_command(node_id=str(main.node_id), command=command))


def change_alignment(*, deployment: Deployment, token_period: int, kv_period: int) -> Deployment:
    try:
        validate_periods(token_period, kv_period)
    except ValueError as exc:
        raise DeploymentError(str(exc)) from None
    if deployment.status not in ACTIVE:
        raise DeploymentError(f"deployment {deployment.name} is {deployment.status}; start it again to change it")
    with transaction.atomic():
        deployment.token_period, deployment.kv_period = token_period, kv_period
        deployment.save(update_fields=["token_period", "kv_period", "updated_at"])
        send_alignment(deployment=deployment)  # a running main takes it at its next step
    return deployment


def _broadcast_stop(node_ids: list, key: str) -> None:
    for node_id in dict.fromkeys(node_ids):  # a node with a role per GPU is told once: it stops them all
        send_command(node_id=str(node_id), command=StopRole(deployment=key).to_json())


def _complete(members: list[DeploymentNode], *, shadow: bool = True) -> bool:
    """Whether the members still form a deployment: a main, a shadow where its predictor is the
    shadow (``shadow``), and workers 0..n-1.

    A deployment created before the predictor was a setting has a shadow seat whatever its
    strategy: without ``shadow`` one is allowed, and its shadow is started but idles.
    """
    roles = [m.role for m in members]
    workers = sorted(m.worker_index for m in members if m.role == Role.WORKER)
    shadows = roles.count(Role.SHADOW)
    whole = roles.count(Role.MAIN) == 1 and (shadows == 1 if shadow else shadows <= 1)
    return whole and bool(workers) and workers == list(range(len(workers)))


def _free_ports(node: Node) -> list[int]:
    ports = node.inventory.get("free_ports", [])
    return [p for p in ports if isinstance(p, int) and 1024 <= p <= 65535] if isinstance(ports, list) else []


def _send_start(deployment: Deployment, member: DeploymentNode, members: list[DeploymentNode]) -> None:
    workers = sum(1 for m in members if m.role == Role.WORKER)
    shard = shard_name(deployment, member, workers)
    task = NodeTask.objects.create(
        node_id=member.node_id,
        kind="start_role",
        params={
            "deployment": deployment.pk,
            "model_id": deployment.model_id,
            "role": member.role_name,
            "shard": shard,
            # The set the shard is served from (artifacts.api.ShardFileApi): this deployment's
            # workers and codec, whatever set of the model was built since.
            "shard_set": shard_set_name(workers, deployment.expert_codec),
        },
    )
    command = StartRole(
        task_id=str(task.pk),
        deployment=deployment.runtime_key,
        model_id=deployment.model_id,
        shard=shard,
        spec=role_spec(deployment, member, members),
        client_keys=asdict(seat_keys(member).client),
    ).to_json()
    DeploymentNode.objects.filter(pk=member.pk).update(start_sent_at=timezone.now())
    transaction.on_commit(lambda: send_command(node_id=str(member.node_id), command=command))


def shard_name(deployment: Deployment, member: DeploymentNode, workers: int) -> str:
    """The shard ``member`` fetches: its role's, the shadow's converted to its dtype where built
    (in the set of the deployment's ``workers`` and codec)."""
    if member.role == Role.SHADOW:
        shard_dir = shard_dir_for(deployment.model, workers, deployment.expert_codec)
        return shadow_shard_name(deployment.model, deployment.shadow_dtype, shard_dir)
    return member.role_name


def role_spec(deployment: Deployment, member: DeploymentNode, members: list[DeploymentNode]) -> dict:
    """``inference.runtime.spec.RoleSpec`` as JSON, less ``shard_dir`` (the agent knows where its shard is)."""
    workers = sum(1 for m in members if m.role == Role.WORKER)
    table = peer_table({m.role_name: m.node.address for m in members}, {m.role_name: m.port for m in members}, workers)
    settings = dataclasses.replace(deployment.settings, device=role_device(member.node.inventory, member.gpu))
    return {
        "deployment": deployment.runtime_key,
        "role": member.role,
        "addresses": table,
        "worker": member.worker_index,
        "settings": asdict(settings),
        "curve": asdict(role_keys(member.role_name, {m.role_name: seat_keys(m) for m in members})),
    }


def seat_keys(member: DeploymentNode) -> SeatKeys:
    """The keys of ``member``'s seat, as its deployment's last start made them."""
    return SeatKeys(
        role=CurveKeys(member.role_public_key, member.role_secret_key),
        client=CurveKeys(member.client_public_key, member.client_secret_key),
    )


def role_device(inventory: dict, gpu: int | None = None) -> str:
    """``cuda:N``: the GPU the role map gave the role, else the node's GPU with the most memory;
    ``auto`` on a node without one."""
    if gpu is not None:
        return f"cuda:{gpu}"
    index = gpu_index(inventory) if isinstance(inventory, dict) else None
    return "auto" if index is None else f"cuda:{index}"


# --- following what agents report ----------------------------------------------------------


def reconcile(*, node_id: str, reports: list[dict], complete: bool) -> bool:
    """Act on what node ``node_id`` runs: ``reports`` are RoleStates as JSON.

    ``complete``: they are everything the node runs (a heartbeat), so a role it should run and
    does not is sent again; otherwise (one RoleState event) only the roles reported are updated.
    A role nobody wants any more (another deployment, an earlier start) is told to stop.

    Returns whether the node is settled: the reports are complete, every role it should run was
    heard, and nothing changed but memory figures, nothing was sent and no deployment's status
    moved. The agent link then need not act on the same report again for a while
    (``nodes.consumers``).
    """
    members = list(
        DeploymentNode.objects.select_related("deployment", "node").filter(
            node_id=node_id, deployment__status__in=RUNNING
        )
    )
    wanted = {(m.deployment.runtime_key, m.role_name): m for m in members}
    heard: set[int] = set()
    settled = complete
    for report in reports:
        if not isinstance(report, dict):
            continue
        reported = report.get("deployment") if isinstance(report.get("deployment"), str) else None
        role_name = report.get("role_name") if isinstance(report.get("role_name"), str) else ""
        state = report.get("state")
        member = wanted.get((reported, role_name))
        if member is None or member.port is None:
            if reported and state not in (MemberState.STOPPED, MemberState.FAILED):
                stop = StopRole(deployment=reported, role_name=role_name)
                send_command(node_id=node_id, command=stop.to_json())  # nobody wants it
                settled = False
            continue
        if state in MemberState.values:
            heard.add(member.pk)
            settled &= not _record_state(member, report, state)
    for member in members:
        missing = complete and member.pk not in heard and member.port is not None
        settled &= not missing
        if missing and member.state != MemberState.FAILED and _start_due(member):
            # The box runs something else, or nothing (its agent restarted): start its role again.
            member.state, member.detail = MemberState.PENDING, "role sent again"
            member.save(update_fields=["state", "detail", "updated_at"])
            with transaction.atomic():
                _send_start(member.deployment, member, list(member.deployment.members.select_related("node")))
    for deployment in {m.deployment_id: m.deployment for m in members}.values():
        settled &= not refresh_status(deployment)
    return settled


def _record_state(member: DeploymentNode, report: dict, state: str) -> bool:
    """The member's reported state saved; whether anything but its memory figures changed."""
    detail = storable_text(str(report.get("detail", ""))[:4000])
    metrics = storable_json(report["metrics"]) if isinstance(report.get("metrics"), dict) else member.metrics
    memory = role_memory(report.get("memory"))
    moved = (member.state, member.detail, member.metrics) != (state, detail, metrics)
    if moved or member.memory != memory:
        member.state, member.detail, member.metrics, member.memory = state, detail, metrics, memory
        member.save(update_fields=["state", "detail", "metrics", "memory", "updated_at"])
    return moved


def role_memory(reported: object) -> dict[str, int]:
    """The memory figures of a report (``MEMORY_FIGURES``), or {} when it has none.

    A heartbeat's runtime report is not checked on arrival the way a RoleState is, so
    anything but a non-negative integer per known figure is left out here.
    """
    if not isinstance(reported, dict):
        return {}
    return {name: value for name in MEMORY_FIGURES if type(value := reported.get(name)) is int and value >= 0}


def nodes_went_offline(*, node_ids: list[str]) -> None:
    members = DeploymentNode.objects.filter(node_id__in=node_ids, deployment__status__in=RUNNING)
    deployments = {m.deployment_id for m in members}
    members.update(state=MemberState.OFFLINE, detail="the node's agent is not connected", start_sent_at=None, memory={})
    for deployment in Deployment.objects.filter(pk__in=deployments):
        refresh_status(deployment)


def _start_due(member: DeploymentNode) -> bool:
    sent = member.start_sent_at
    return sent is None or timezone.now() - sent > timedelta(seconds=RESEND_AFTER_S) or member.state == "offline"


def refresh_status(deployment: Deployment) -> bool:
    """The deployment's status from its members': ready only when every role is. Whether it moved
    (or the deployment is no longer running)."""
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if locked.status not in RUNNING:
            return True
        members = list(locked.members.select_related("node"))
        status, reason = _status_from(locked, members)
        moved = (status, reason) != (locked.status, locked.status_reason)
        if moved:
            _set_status(locked, status, reason)
        if status == DeploymentStatus.FAILED:
            key, nodes = locked.runtime_key, [m.node_id for m in members]
            transaction.on_commit(lambda: _broadcast_stop(nodes, key))
        return moved


def _status_from(deployment: Deployment, members: list[DeploymentNode]) -> tuple[str, str]:
    failed = [m for m in members if m.state == MemberState.FAILED]
    if failed:
        m = failed[0]
        return DeploymentStatus.FAILED, f"{m.role_name} on {m.node.name} failed: {m.detail}"
    offline = [m for m in members if m.node.status in UNAVAILABLE or m.state == MemberState.OFFLINE]
    if offline:
        names = ", ".join(f"{m.node.name} ({m.role_name})" for m in offline)
        return DeploymentStatus.DEGRADED, f"offline: {names}"
    waiting = [m for m in members if m.state != MemberState.READY]
    if not waiting:
        return DeploymentStatus.READY, ""
    if deployment.status == DeploymentStatus.DEPLOYING and deployment.status_reason.startswith("building"):
        return deployment.status, deployment.status_reason
    names = ", ".join(f"{m.role_name} ({m.state})" for m in waiting[:4]) + (" …" if len(waiting) > 4 else "")
    status = (
        DeploymentStatus.DEPLOYING if deployment.status == DeploymentStatus.DEPLOYING else DeploymentStatus.DEGRADED
    )
    return status, f"waiting for {names}"


def _set_status(deployment: Deployment, status: str, reason: str) -> None:
    Deployment.objects.filter(pk=deployment.pk).update(status=status, status_reason=reason, updated_at=timezone.now())
    deployment.status, deployment.status_reason = status, reason
    log.info("deployment %s: %s %s", deployment.name, status, reason)
