"""Which function serves which role: the one table ``serve-role`` and the in-process launcher share."""

from __future__ import annotations

from collections.abc import Callable

from inference.runtime.roles import main, shadow, worker
from inference.runtime.spec import RoleSpec

SERVE: dict[str, Callable[[RoleSpec], None]] = {
    "main": main.serve,
    "shadow": shadow.serve,
    "worker": worker.serve,
}


def serve_role(spec: RoleSpec) -> None:
    """Run ``spec``'s role until it is told to stop."""
    SERVE[spec.role](spec)
