"""The REST API's check of an API key's scopes (``scopes.py``), beside the user's own rights.

Every API view lists ``KeyScopes`` after its user check. A view whose writes are not
cluster changes says which scope they need with ``write_scope`` (jobs: ``inference``).
Requests that are not made with an API key (a browser session, an agent) pass untouched.
"""

from __future__ import annotations

from rest_framework.permissions import BasePermission

from .models import ApiKey
from .scopes import Scope, needed_scope


class KeyScopes(BasePermission):
    message = "this API key lacks the scope this request needs"

    def has_permission(self, request, view) -> bool:
        key = request.auth
        if not isinstance(key, ApiKey):
            return True
        scope = needed_scope(request.method, write_scope=getattr(view, "write_scope", Scope.ADMIN))
        if key.allows(scope):
            return True
        self.message = f"this API key lacks the '{scope}' scope (it has: {', '.join(key.scopes) or 'none'})"
        return False
