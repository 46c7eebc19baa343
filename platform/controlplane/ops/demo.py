"""What ``manage.py up`` sets up in the database: an admin, local nodes' join token, the demo deployment.

Each step is idempotent, so ``up`` can run again on the same var directory: an existing
admin is kept, agents that enrolled before reuse their credential, and the demo deployment
left by an earlier run is started again under a new epoch.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from django.contrib.auth import get_user_model

from controlplane.artifacts.models import ModelArtifact
from controlplane.artifacts.services import register_model
from controlplane.deployments import lifecycle
from controlplane.deployments.models import RUNNING, Deployment
from controlplane.deployments.services import create_deployment
from controlplane.nodes.models import Node, NodeStatus
from controlplane.nodes.services import create_join_token

DEMO_NAME = "demo"
ADMIN_NAME = "admin"


def ensure_admin() -> str | None:
    """Create the admin account if there is no superuser yet; returns its new password, else None."""
    users = get_user_model().objects
    if users.filter(is_superuser=True).exists():
        return None
    password = secrets.token_urlsafe(12)
    users.create_superuser(ADMIN_NAME, email="", password=password)
    return password


def forget_connections() -> None:
    """Before the server starts no agent can be connected: statuses left by an earlier run are stale."""
    Node.objects.filter(status=NodeStatus.ONLINE).update(status=NodeStatus.OFFLINE)


def forget_stale_credential(state_dir: Path) -> None:
    """Drop a local agent's stored credential for a node this database does not know (a fresh DB)."""
    stored = state_dir / "node.json"
    if not stored.exists():
        return
    try:
        node_id = json.loads(stored.read_text())["node_id"]
        known = Node.objects.filter(pk=node_id).exists()
    except (ValueError, KeyError, TypeError):
        known = False
    if not known:
        stored.unlink()


def local_join_token(agents: int) -> str:
    _, clear = create_join_token(created_by=None, name="manage.py up", ttl_s=3600, max_uses=max(agents, 1))
    return clear


def ensure_model(path: Path) -> ModelArtifact:
    existing = ModelArtifact.objects.filter(name=DEMO_NAME).first()
    if existing is not None and Path(existing.path) == path.resolve():
        return existing
    if existing is not None:
        existing.name = f"{DEMO_NAME}-{existing.pk}"  # keep the old one (deployments may use it)
        existing.save(update_fields=["name"])
    return register_model(name=DEMO_NAME, path=str(path))


def start_demo(model: ModelArtifact, node_names: list[str]) -> Deployment:
    """The demo deployment on ``node_names``, (re)started."""
    node_ids = [str(pk) for pk in Node.objects.filter(name__in=node_names).values_list("pk", flat=True)]
    deployment = Deployment.objects.filter(name=DEMO_NAME).first()
    if deployment is not None:
        if deployment.status in RUNNING:
            lifecycle.stop_deployment(deployment=deployment)  # left running by an earlier run
        same = {str(n) for n in deployment.members.values_list("node_id", flat=True)} == set(node_ids)
        if not same or deployment.model_id != model.pk:
            deployment.delete()
            deployment = None
    if deployment is None:
        deployment = create_deployment(name=DEMO_NAME, model=model, node_ids=node_ids)
    return lifecycle.start_deployment(deployment=deployment)
