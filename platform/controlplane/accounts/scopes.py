"""What an API key may do: its scopes, and which scope each kind of request needs.

A key acts for its user and never beyond them: a scope only narrows what the user may do.
``inference`` generates (the OpenAI-compatible API, jobs, a deployment's generate call);
``read`` reads the REST API; ``metrics`` reads ``/metrics``; ``admin`` changes the cluster
(nodes, models, deployments, other keys). Staff users may hold every scope, other users
``inference`` and ``read``. A browser session is not a key and is limited only by its user.
"""

from __future__ import annotations

from django.db import models


class Scope(models.TextChoices):
    INFERENCE = "inference", "generate text"
    READ = "read", "read the REST API"
    METRICS = "metrics", "read /metrics"
    ADMIN = "admin", "change nodes, models, deployments and keys"


ALL_SCOPES: tuple[str, ...] = tuple(Scope.values)
USER_SCOPES: tuple[str, ...] = (Scope.INFERENCE, Scope.READ)

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


class ScopeError(ValueError):
    """Scopes that do not exist or that the user may not hold."""


def allowed_scopes(user) -> tuple[str, ...]:
    """Every scope ``user`` may give a key."""
    return ALL_SCOPES if user.is_staff else USER_SCOPES


def check_scopes(scopes: list[str] | tuple[str, ...], *, user, within: tuple[str, ...] | None = None) -> list[str]:
    """``scopes`` in a fixed order, or ScopeError: unknown, beyond the user, or beyond ``within``
    (the scopes of the key that asks: a key never makes a key that can do more than itself)."""
    unknown = sorted(set(scopes) - set(ALL_SCOPES))
    if unknown:
        raise ScopeError(f"unknown scope {', '.join(unknown)}; scopes are {', '.join(ALL_SCOPES)}")
    if not scopes:
        raise ScopeError(f"give at least one scope of {', '.join(ALL_SCOPES)}")
    beyond = sorted(set(scopes) - set(allowed_scopes(user)))
    if beyond:
        raise ScopeError(f"user {user.get_username()!r} may not hold scope {', '.join(beyond)}")
    if within is not None:
        wider = sorted(set(scopes) - set(within))
        if wider:
            raise ScopeError(f"this key cannot give scope {', '.join(wider)}, which it does not hold")
    return [s for s in ALL_SCOPES if s in scopes]


def needed_scope(method: str, *, write_scope: str = Scope.ADMIN) -> str:
    """The scope a request with ``method`` needs: reads need ``read``, writes ``write_scope``."""
    return Scope.READ if method.upper() in SAFE_METHODS else write_scope
