"""Writes of the nodes app: join tokens, enrollment, node credentials and their rotation."""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Case, Value, When
from django.utils import timezone

from agent.tls import join_token as clear_join_token
from agent.tls import split_join_token
from controlplane.storable import storable_text

from . import liveness, selectors, signals
from .credentials import JOIN_TOKEN_PREFIX, NODE_SECRET_PREFIX, digest, matches, new_secret
from .groups import node_group
from .inventory import clean_inventory
from .models import JoinToken, Node, NodeStatus, NodeTask, TaskState
from .reports import MAX_DETAIL_CHARS
from .tls import server_pin

log = logging.getLogger(__name__)

MAX_TOKEN_TTL_S = 30 * 24 * 3600


class EnrollmentError(ValueError):
    """A node could not enroll; the message says why, for the person at the box."""


def create_join_token(
    *, created_by: AbstractBaseUser | None, name: str = "", ttl_s: int | None = None, max_uses: int = 1
) -> tuple[JoinToken, str]:
    """A new join token and its clear value, which is shown once and never stored.

    The clear value carries this control plane's certificate pin when it has one
    (``agent.tls.join_token``): the box that spends it trusts that key alone. Only the
    secret part is stored, hashed.
    """
    ttl_s = settings.JOIN_TOKEN_TTL_S if ttl_s is None else ttl_s
    if not 60 <= ttl_s <= MAX_TOKEN_TTL_S:
        raise ValueError(f"a join token lives between 60 s and {MAX_TOKEN_TTL_S} s, got {ttl_s}")
    if not 1 <= max_uses <= 1000:
        raise ValueError(f"max_uses must be between 1 and 1000, got {max_uses}")
    secret = new_secret(JOIN_TOKEN_PREFIX)
    pin = server_pin()
    token = JoinToken.objects.create(
        name=name,
        token_hash=digest(secret),
        prefix=secret[len(JOIN_TOKEN_PREFIX) : len(JOIN_TOKEN_PREFIX) + 6],
        created_by=created_by,
        expires_at=timezone.now() + timedelta(seconds=ttl_s),
        max_uses=max_uses,
    )
    return token, clear_join_token(secret, pin)


@transaction.atomic
def enroll_node(*, token: str, name: str, inventory: dict, address: str = "") -> tuple[Node, str]:
    """Spend one use of ``token`` on a new node; returns the node and its clear credential.

    The token's pin, if it carries one, is the agent's business (it checked the server's key
    before sending it): the secret part alone is looked up, so tokens without a pin work alike.
    """
    try:
        secret_part, _ = split_join_token(token)
    except ValueError as exc:
        raise EnrollmentError(str(exc)) from None
    join_token = JoinToken.objects.select_for_update().filter(token_hash=digest(secret_part)).first()
    if join_token is None:
        raise EnrollmentError("unknown join token; check it was copied whole, or create a new one")
    reason = join_token.unusable_reason()
    if reason:
        raise EnrollmentError(reason)
    secret = new_secret(NODE_SECRET_PREFIX)
    try:
        with transaction.atomic():
            node = Node.objects.create(
                name=name,
                secret_hash=digest(secret),
                inventory=clean_inventory(inventory),
                address=address,
                join_token=join_token,
            )
    except IntegrityError:
        raise EnrollmentError(f"a node named {name!r} is already enrolled; pick another --name") from None
    join_token.uses += 1
    join_token.save(update_fields=["uses"])
    return node, secret


def authenticate_node(*, node_id: str, secret: str) -> Node | None:
    """The node whose credential this is, or None (also for an id that is not a node id at all).

    The secret of a rotation not yet confirmed counts too, and using it confirms the rotation:
    the agent saved it but its answer was lost.
    """
    try:
        node = Node.objects.filter(pk=node_id).first()
    except (ValueError, ValidationError):
        return None
    if node is None:
        return None
    if node.pending_secret_hash and matches(secret, node.pending_secret_hash):
        return confirm_rotation(node_id=str(node.pk))
    return node if matches(secret, node.secret_hash) else None


def rotate_credential(*, node: Node) -> None:
    """Ask the node's agent to take a new credential: its link makes one, the agent stores it and
    says so, and only then does the old one stop working (``confirm_rotation``). The clear secret
    goes straight down the agent's socket and is never stored nor put on the channel layer."""
    if node.status not in (NodeStatus.ONLINE, NodeStatus.DRAINING):
        raise NodeError(f"node {node.name} is {node.status}: its agent must be connected to take a new credential")
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    async_to_sync(get_channel_layer().group_send)(node_group(str(node.pk)), {"type": "agent.rotate"})


def begin_rotation(*, node_id: str) -> str | None:
    """A new clear credential for the node, kept as pending beside the current one; None if the node is gone."""
    secret = new_secret(NODE_SECRET_PREFIX)
    updated = Node.objects.filter(pk=node_id).update(pending_secret_hash=digest(secret))
    return secret if updated else None


def confirm_rotation(*, node_id: str) -> Node | None:
    """The agent holds the pending credential: it becomes the only one."""
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(pk=node_id).first()
        if node is None or not node.pending_secret_hash:
            return node
        node.secret_hash, node.pending_secret_hash = node.pending_secret_hash, ""
        node.credential_rotated_at = timezone.now()
        node.save(update_fields=["secret_hash", "pending_secret_hash", "credential_rotated_at"])
    log.info("node %s: credential rotated", node.name)
    return node


def touch_node(*, node: Node) -> None:
    node.last_seen = timezone.now()
    node.save(update_fields=["last_seen"])


def record_heartbeat(*, node_id: str, inventory: dict, roles: list | None = None) -> None:
    """An agent is alive: note when, what the box offers, bring the node online, pass on every role it runs."""
    record_liveness(node_id=node_id, inventory=inventory)
    if roles is not None:
        record_runtime(node_id=node_id, reports=roles, complete=True)


def record_liveness(*, node_id: str, inventory: dict) -> None:
    """A heartbeat's node part: when, what the box offers, online (a draining node stays draining).

    One UPDATE: heartbeats are the control plane's most frequent write.
    """
    inventory = clean_inventory(inventory)
    address = inventory.get("address", "")
    updates = {
        "last_seen": timezone.now(),
        "inventory": inventory,
        "status": Case(
            When(status=NodeStatus.DRAINING, then=Value(NodeStatus.DRAINING)), default=Value(NodeStatus.ONLINE)
        ),
    }
    if isinstance(address, str) and address:
        updates["address"] = address
    Node.objects.filter(pk=node_id).update(**updates)


def mark_connected(*, node_id: str) -> datetime:
    """The node's agent link came up (again): when, for the console and for ``mark_offline``."""
    now = timezone.now()
    Node.objects.filter(pk=node_id).update(connected_at=now)
    return now


def mark_offline(*, node_id: str, link_since: datetime | None = None) -> None:
    """The node's link closed. ``link_since``: when that link came up; if a newer link is up
    already (the agent reconnected before the old link's close was handled), nothing changes."""
    node = Node.objects.filter(pk=node_id)
    if link_since is not None and node.filter(connected_at__gt=link_since).exists():
        return
    node.exclude(status=NodeStatus.DRAINING).update(status=NodeStatus.OFFLINE)
    signals.nodes_went_offline.send(sender=Node, node_ids=[str(node_id)])


def record_runtime(*, node_id: str, reports: list, complete: bool) -> bool:
    """What the node's runtime roles are doing (``complete``: all of them); the deployments app acts
    on it. Whether every receiver found the node settled (nothing to do on the same report)."""
    answers = signals.runtime_reported.send(sender=Node, node_id=str(node_id), reports=reports, complete=complete)
    return all(answer is True for _, answer in answers)


def expire_silent_nodes(*, timeout_s: float) -> list[str]:
    """Turn offline every online node not heard from for ``timeout_s``; returns their names.

    When a node was last heard is the later of its entry in ``liveness`` (Redis) and its row's
    ``last_seen``; a node without an entry is judged by its row alone, which may lag its agent by
    ``liveness.ROW_REFRESH_S``, so that much longer is allowed."""
    now = timezone.now()
    cutoff = (now - timedelta(seconds=timeout_s)).timestamp()
    online = list(Node.objects.filter(status=NodeStatus.ONLINE).values_list("pk", "name", "last_seen"))
    heard = liveness.heard_at([str(pk) for pk, _, _ in online])
    found = []
    for pk, name, last_seen in online:
        row = last_seen.timestamp() if last_seen is not None else 0.0
        entry = heard.get(str(pk))
        last = max(entry, row) if entry is not None else row + liveness.ROW_REFRESH_S
        if last < cutoff:
            found.append((pk, name))
    Node.objects.filter(pk__in=[pk for pk, _ in found]).update(status=NodeStatus.OFFLINE)
    if found:
        signals.nodes_went_offline.send(sender=Node, node_ids=[str(pk) for pk, _ in found])
    return [name for _, name in found]


class NodeError(ValueError):
    """A change to a node that cannot be made; the message says why."""


def rename_node(*, node: Node, name: str) -> Node:
    if Node.objects.exclude(pk=node.pk).filter(name=name).exists():
        raise NodeError(f"a node named {name!r} already exists")
    node.name = name
    node.save(update_fields=["name"])
    return node


def drain_node(*, node: Node) -> Node:
    """Take the node out of new deployments; it stays enrolled and keeps its link."""
    node.status = NodeStatus.DRAINING
    node.save(update_fields=["status"])
    return node


def undrain_node(*, node: Node) -> Node:
    """Back into service: online if its agent was heard from within the timeout, else offline."""
    seen = selectors.last_heard([node])[str(node.pk)]
    recent = seen and (timezone.now() - seen).total_seconds() < settings.NODE_HEARTBEAT_TIMEOUT_S
    node.status = NodeStatus.ONLINE if recent else NodeStatus.OFFLINE
    node.save(update_fields=["status"])
    return node


@transaction.atomic
def remove_node(*, node: Node) -> None:
    """Forget the node: its credential stops working and its agent's link closes at once.

    Deployments it belongs to let go of it first (the deployments app listens to
    ``node_removing``): a running one is stopped, and none can start again without it.
    The box must enroll again to come back.
    """
    node_id = str(node.pk)
    signals.node_removing.send(sender=Node, node_id=node_id, name=node.name)
    node.delete()
    transaction.on_commit(lambda: close_agent_link(node_id=node_id))
    transaction.on_commit(lambda: liveness.forget(node_id))


def close_agent_link(*, node_id: str) -> None:
    """Close the node's agent websocket, if one is open (its credential no longer exists)."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    async_to_sync(get_channel_layer().group_send)(node_group(node_id), {"type": "agent.revoked"})


def send_command(*, node_id: str, command: dict) -> None:
    """Hand a command to the node's agent link (through the channel layer)."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    async_to_sync(get_channel_layer().group_send)(node_group(node_id), {"type": "agent.command", "command": command})


def request_fetch(*, node: Node, model_id: int, role: str) -> NodeTask:
    """Ask ``node``'s agent to download a role shard; progress comes back on the link."""
    from inference.wire.link import FetchShard

    if node.status != NodeStatus.ONLINE:
        raise NodeError(f"node {node.name} is {node.status}: its agent must be connected to fetch shards")
    task = NodeTask.objects.create(node=node, kind="fetch_shard", params={"model_id": model_id, "role": role})
    command = FetchShard(task_id=str(task.pk), model_id=model_id, role=role).to_json()
    transaction.on_commit(lambda: send_command(node_id=str(node.pk), command=command))
    return task


def record_task_progress(*, node_id: str, task_id: str, done: int, total: int) -> None:
    if not is_task_id(task_id) or not all(-(2**63) <= n < 2**63 for n in (done, total)):
        return  # no task of any node's, or figures no 64-bit column holds: nothing to record
    # Only the node's own tasks: a node's credential acts for that node alone.
    NodeTask.objects.filter(pk=task_id, node_id=node_id).exclude(state__in=[TaskState.DONE, TaskState.FAILED]).update(
        state=TaskState.RUNNING, done=done, total=total
    )


def record_task_done(*, node_id: str, task_id: str, ok: bool, detail: str) -> None:
    if not is_task_id(task_id):
        return
    NodeTask.objects.filter(pk=task_id, node_id=node_id).update(
        state=TaskState.DONE if ok else TaskState.FAILED, detail=storable_text(detail[:MAX_DETAIL_CHARS])
    )


def is_task_id(task_id: str) -> bool:
    """Whether ``task_id`` can name a task at all (a UUID): an agent's link may report any string."""
    try:
        uuid.UUID(task_id)
    except ValueError:
        return False
    return True
