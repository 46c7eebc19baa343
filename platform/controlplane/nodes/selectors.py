"""Reads of the nodes app."""

from __future__ import annotations

from django.db.models import QuerySet

from .models import JoinToken, Node


def node_list() -> QuerySet[Node]:
    return Node.objects.all()


def join_token_list() -> QuerySet[JoinToken]:
    return JoinToken.objects.select_related("created_by")
