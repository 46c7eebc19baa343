"""What the console shows, read from the database in one go: nodes, models, deployments, transfers,
and the latest pauses answers were carried across (``deployments.pauses``).

The console's websocket sends this whenever it changes; ``GET /console/state.json`` gives
the same for a first render or a script.
"""

from __future__ import annotations

from controlplane.artifacts.models import ModelArtifact
from controlplane.deployments import pauses
from controlplane.deployments.models import Deployment
from controlplane.nodes.inventory import clean_inventory, doctor_problems
from controlplane.nodes.models import Node, NodeTask, TaskState
from controlplane.nodes.selectors import last_heard
from inference import __version__
from inference.policies.strategies import get_strategy

RECENT_TASKS = 50


def snapshot() -> dict:
    nodes = list(Node.objects.all())
    heard = last_heard(nodes)
    return {
        "server_version": __version__,
        "nodes": [_node(n, heard) for n in nodes],
        "models": [_model(m) for m in ModelArtifact.objects.all()],
        "deployments": [_deployment(d) for d in Deployment.objects.prefetch_related("members__node")[:50]],
        "transfers": [_task(t) for t in NodeTask.objects.select_related("node")[:RECENT_TASKS]],
        "pauses": pauses.recent(),
    }


def _node(node: Node, heard: dict) -> dict:
    inventory = clean_inventory(node.inventory)
    last_seen = heard.get(str(node.pk))
    doctor = inventory.get("doctor") or {"checks": []}
    return {
        "id": str(node.pk),
        "name": node.name,
        "status": node.status,
        "address": node.address,
        "last_seen": last_seen.isoformat() if last_seen else None,
        "connected_at": node.connected_at.isoformat() if node.connected_at else None,
        "cpu_count": inventory.get("cpu_count"),
        "ram_bytes": inventory.get("ram_bytes"),
        "gpus": [{"name": g.get("name"), "memory_bytes": g.get("memory_bytes")} for g in inventory.get("gpus", [])],
        "agent_version": inventory.get("agent_version"),  # None: an agent older than the version report
        # What its doctor found at the agent's start: failures keep it out of every role.
        "problems": doctor_problems(inventory),
        "warnings": [f"{c.get('name')}: {c.get('detail')}" for c in doctor["checks"] if c.get("status") == "warn"],
    }


def _model(model: ModelArtifact) -> dict:
    return {
        "id": model.pk,
        "name": model.name,
        "path": model.path,
        "status": model.status,
        "repo_id": model.repo_id,
        "download_progress": model.download_progress,
        "error": model.error,
        "summary": model.summary,
        "total_bytes": model.total_bytes,
        "shard_status": model.shard_status,
        "shard_workers": model.shard_workers,
        "shard_expert_codec": model.shard_expert_codec,
        "shard_shadow_dtypes": model.shard_shadow_dtypes,
        "shard_progress": model.shard_progress,
        "shard_error": model.shard_error,
    }


# One key per line, alike _model's above by shape, on purpose: each entity's own snapshot.
def _deployment(deployment: Deployment) -> dict:
    return {
        "id": deployment.pk,
        "name": deployment.name,
        "runtime_key": deployment.runtime_key,
        "model": deployment.model_id,
        "status": deployment.status,
        "status_reason": deployment.status_reason,
        "shadow_dtype": deployment.shadow_dtype,
        "token_period": deployment.token_period,
        "kv_period": deployment.kv_period,
        "strategy": deployment.strategy,
        "approximate": not get_strategy(deployment.strategy).exact,
        "predictor": deployment.predictor,
        "max_batch": deployment.max_batch,
        "max_per_user": deployment.max_per_user,
        "expert_codec": deployment.expert_codec,
        "draft_tokens": deployment.draft_tokens,
        "draft_policy": deployment.draft_policy,
        "replay": deployment.replay,
        "max_migrations": deployment.max_migrations,
        "max_replay_tokens": deployment.max_replay_tokens,
        "members": [
            {
                "node": str(m.node_id),
                "node_name": m.node.name,
                "node_status": m.node.status,
                "role": m.role_name,
                "gpu": m.gpu,
                "state": m.state,
                "detail": m.detail[:300],
                "metrics": m.metrics,
                "memory": m.memory,
            }
            for m in deployment.members.all()
        ],
    }


def _task(task: NodeTask) -> dict:
    return {
        "id": str(task.pk),
        "node_name": task.node.name,
        "kind": task.kind,
        "role": task.params.get("role"),
        "deployment": task.params.get("deployment"),
        "state": task.state,
        "done": task.done,
        "total": task.total,
        "finished": task.state in (TaskState.DONE, TaskState.FAILED),
        "detail": task.detail[:300] if task.state == TaskState.FAILED else "",
    }
