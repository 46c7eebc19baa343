"""Reads of the nodes app."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from django.db.models import QuerySet

from . import liveness
from .models import JoinToken, Node, NodeTask

SHARD_TASKS = ("fetch_shard", "start_role")  # the tasks that make a node fetch a shard


def node_list() -> QuerySet[Node]:
    return Node.objects.all()


def last_heard(nodes: Iterable[Node]) -> dict[str, datetime | None]:
    """When each node's agent was last heard: the later of its row's ``last_seen`` (written at most
    every ``liveness.ROW_REFRESH_S``) and its moment in ``liveness`` (every heartbeat), by node id."""
    nodes = list(nodes)
    heard = liveness.heard_at([str(node.pk) for node in nodes])
    found = {}
    for node in nodes:
        at, row = heard.get(str(node.pk)), node.last_seen
        moment = datetime.fromtimestamp(at, tz=UTC) if at is not None else None
        found[str(node.pk)] = max((m for m in (row, moment) if m is not None), default=None)
    return found


def join_token_list() -> QuerySet[JoinToken]:
    return JoinToken.objects.select_related("created_by")


def shard_sent_to_node(*, node: Node, model_id: int, shard: str) -> dict | None:
    """The params of the newest task that told ``node`` to fetch shard ``shard`` of model ``model_id``,
    or None if none did.

    Every fetch the control plane asks for (a role it starts, an explicit fetch) is a
    ``NodeTask`` naming the model and the shard: a node downloads those and nothing else, and
    from the shard set the task names (``shard_set``) where it names one.
    """
    tasks = NodeTask.objects.filter(node=node, kind__in=SHARD_TASKS).order_by("-created_at")
    for params in tasks.values_list("params", flat=True):
        if (
            isinstance(params, dict)
            and params.get("model_id") == model_id
            and params.get("shard", params.get("role")) == shard
        ):
            return params
    return None
