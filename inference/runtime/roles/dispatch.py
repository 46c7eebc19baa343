"""Which class serves which role: the one table ``serve-role`` and the in-process launcher share."""

from __future__ import annotations

from inference.runtime.roles.main import MainRole
from inference.runtime.roles.shadow import ShadowRole
from inference.runtime.roles.worker import WorkerRole
from inference.runtime.spec import RoleSpec

ROLES: dict[str, type[MainRole] | type[ShadowRole] | type[WorkerRole]] = {
    "main": MainRole,
    "shadow": ShadowRole,
    "worker": WorkerRole,
}


def serve_role(spec: RoleSpec) -> None:
    """Run ``spec``'s role until it is told to stop."""
    ROLES[spec.role](spec).run()
