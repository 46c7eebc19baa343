"""What ``manage.py up`` sets up in the database: an admin, local nodes' join token, the demo deployment.

Each step is idempotent, so ``up`` can run again on the same var directory: an existing
admin is kept, agents that enrolled before reuse their credential (also when ``up`` now
serves on another port), and the demo deployment left by an earlier run is started again
under a new epoch.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError

from agent import credentials
from controlplane.artifacts.models import ModelArtifact
from controlplane.artifacts.services import register_model
from controlplane.deployments import lifecycle
from controlplane.deployments.models import RUNNING, Deployment
from controlplane.deployments.services import create_deployment
from controlplane.nodes.credentials import matches
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


KEEP, FOLLOW, FORGET = "keep", "follow", "forget"


def local_credential_action(state_dir: Path, server: str) -> str:
    """What ``up`` must do with one of its local agents' stored credential before starting it for ``server``.

    ``FORGET``: it names a node this database does not know (a fresh database), or is unreadable;
    the agent enrolls again. ``FOLLOW``: it is one of this database's nodes, its secret checks out
    against this database, but it names another URL (``up`` ran before on another port): it is
    this control plane's own credential, so it may follow the server to its new URL. ``KEEP``:
    nothing to do (no credential, or one for ``server`` already; or one that does not check out,
    which the agent then reports and refuses, as it must).

    Only ``up``'s own local agents get this: a real box's agent never sends its credential to
    a server other than the one it enrolled with (``agent.__main__.enroll_or_resume``).
    """
    try:
        stored = credentials.load(state_dir)
    except ValueError:
        return FORGET
    if stored is None:
        return KEEP
    try:
        node = Node.objects.filter(pk=stored.node_id).first()
    except (ValueError, TypeError, ValidationError):
        node = None
    if node is None:
        return FORGET
    if stored.server == server.rstrip("/"):
        return KEEP
    digests = [d for d in (node.secret_hash, node.pending_secret_hash) if d]
    ours = isinstance(stored.node_secret, str) and any(matches(stored.node_secret, d) for d in digests)
    return FOLLOW if ours else KEEP


def prepare_local_credential(state_dir: Path, server: str) -> str:
    """Apply ``local_credential_action``: drop the stored credential, point it at ``server``, or leave it."""
    action = local_credential_action(state_dir, server)
    if action == FORGET:
        (state_dir / credentials.FILE_NAME).unlink()
    elif action == FOLLOW:
        stored = credentials.load(state_dir)
        credentials.save(state_dir, replace(stored, server=server.rstrip("/")))  # atomic, mode 0600
    return action


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
