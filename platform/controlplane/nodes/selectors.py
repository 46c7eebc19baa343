"""Reads of the nodes app."""

from __future__ import annotations

from django.db.models import QuerySet

from .models import JoinToken, Node, NodeTask

SHARD_TASKS = ("fetch_shard", "start_role")  # the tasks that make a node fetch a shard


def node_list() -> QuerySet[Node]:
    return Node.objects.all()


def join_token_list() -> QuerySet[JoinToken]:
    return JoinToken.objects.select_related("created_by")


def node_was_sent_shard(*, node: Node, model_id: int, shard: str) -> bool:
    """Whether ``node`` was told to fetch shard ``shard`` of model ``model_id``.

    Every fetch the control plane asks for (a role it starts, an explicit fetch) is a
    ``NodeTask`` naming the model and the shard: a node downloads those and nothing else.
    """
    tasks = NodeTask.objects.filter(node=node, kind__in=SHARD_TASKS).values_list("params", flat=True)
    return any(
        isinstance(params, dict)
        and params.get("model_id") == model_id
        and params.get("shard", params.get("role")) == shard
        for params in tasks
    )
