"""Which class serves which role: the one table ``serve-role`` and the in-process launcher share.

A role's class is imported when that role is served: a worker's process loads neither main's
model code nor Transformers (about 2 s of CPU here, in every worker a cluster starts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from inference.runtime.spec import RoleSpec

if TYPE_CHECKING:
    from inference.runtime.roles.main import MainRole
    from inference.runtime.roles.shadow import ShadowRole
    from inference.runtime.roles.worker import WorkerRole


def role_class(role: str) -> type[MainRole] | type[ShadowRole] | type[WorkerRole]:
    """The class that serves ``role`` (main, shadow or worker)."""
    if role == "main":
        from inference.runtime.roles.main import MainRole

        return MainRole
    if role == "shadow":
        from inference.runtime.roles.shadow import ShadowRole

        return ShadowRole
    if role == "worker":
        from inference.runtime.roles.worker import WorkerRole

        return WorkerRole
    raise KeyError(f"no role {role!r}: main, shadow or worker")


def serve_role(spec: RoleSpec) -> None:
    """Run ``spec``'s role until it is told to stop."""
    role_class(spec.role)(spec).run()
