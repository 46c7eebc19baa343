"""How an agent proves which node it is: ``Authorization: Node <node id>:<credential>``.

A request authenticated this way carries the Node as ``request.auth`` and acts for that
node only; it is never a user and can never pass a staff check.
"""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from rest_framework import authentication, exceptions, permissions

from .models import Node
from .services import authenticate_node

SCHEME = "Node"


class NodeCredentialAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request) -> tuple[AnonymousUser, Node] | None:
        header = authentication.get_authorization_header(request).decode(errors="replace")
        scheme, _, value = header.partition(" ")
        if scheme != SCHEME:
            return None
        node_id, _, secret = value.strip().partition(":")
        node = authenticate_node(node_id=node_id, secret=secret) if node_id and secret else None
        if node is None:
            raise exceptions.AuthenticationFailed("unknown node or wrong node credential")
        return AnonymousUser(), node

    def authenticate_header(self, request) -> str:
        return SCHEME


class IsNode(permissions.BasePermission):
    message = "this endpoint is for enrolled agents (Authorization: Node <id>:<credential>)"

    def has_permission(self, request, view) -> bool:
        return isinstance(request.auth, Node)
