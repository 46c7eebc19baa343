"""Node management and API keys through the REST API."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from controlplane.accounts.models import ApiKey
from controlplane.nodes.credentials import digest
from controlplane.nodes.models import Node, NodeStatus
from controlplane.nodes.services import create_join_token, enroll_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff() -> APIClient:
    client = APIClient()
    client.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))
    return client


def enrolled(name: str) -> tuple[Node, str]:
    _, token = create_join_token(created_by=None)
    return enroll_node(token=token, name=name, inventory={})


def test_rename_drain_and_remove_a_node(staff: APIClient) -> None:
    node, secret = enrolled("box-1")
    enrolled("box-2")
    assert staff.patch(f"/api/nodes/{node.pk}", {"name": "gpu-a"}, format="json").json()["name"] == "gpu-a"
    taken = staff.patch(f"/api/nodes/{node.pk}", {"name": "box-2"}, format="json")
    assert taken.status_code == 400 and "already exists" in taken.json()["detail"]
    bad = staff.patch(f"/api/nodes/{node.pk}", {"name": "no spaces"}, format="json")
    assert bad.status_code == 400 and "letters, digits" in str(bad.json())
    assert staff.post(f"/api/nodes/{node.pk}/drain", {}, format="json").json()["status"] == NodeStatus.DRAINING
    undrained = staff.post(f"/api/nodes/{node.pk}/drain", {"drain": False}, format="json").json()
    assert undrained["status"] == NodeStatus.OFFLINE  # never heard from: not online
    assert staff.delete(f"/api/nodes/{node.pk}").status_code == 204
    as_removed = APIClient().get("/api/agents/me", HTTP_AUTHORIZATION=f"Node {node.pk}:{secret}")
    assert as_removed.status_code == 401
    assert staff.get(f"/api/nodes/{node.pk}").status_code == 404
    assert list(Node.objects.values_list("name", flat=True)) == ["box-2"]


def test_non_staff_cannot_change_nodes() -> None:
    node, _ = enrolled("box-1")
    client = APIClient()
    client.force_authenticate(get_user_model().objects.create_user("alice"))
    assert client.patch(f"/api/nodes/{node.pk}", {"name": "x"}, format="json").status_code == 403
    assert client.post(f"/api/nodes/{node.pk}/drain", {}, format="json").status_code == 403
    assert client.delete(f"/api/nodes/{node.pk}").status_code == 403
    assert Node.objects.get(pk=node.pk).name == "box-1"


def test_create_api_key_prints_a_key_that_authenticates_and_is_stored_hashed(capsys) -> None:
    get_user_model().objects.create_user("ops", is_staff=True)
    call_command("create_api_key", "ops", "--name", "ci")
    clear = capsys.readouterr().out.strip()
    assert clear.startswith("odmoe-key-")
    stored = ApiKey.objects.get()
    assert stored.key_hash == digest(clear) and stored.name == "ci"
    client = APIClient()
    assert client.get("/api/nodes", HTTP_AUTHORIZATION=f"Bearer {clear}").status_code == 200
    assert client.get("/api/nodes", HTTP_AUTHORIZATION="Bearer odmoe-key-wrong").status_code == 401
    ApiKey.objects.update(revoked=True)
    assert client.get("/api/nodes", HTTP_AUTHORIZATION=f"Bearer {clear}").status_code == 401


def test_create_api_key_for_an_unknown_user_is_a_clear_error() -> None:
    with pytest.raises(CommandError, match="no user named 'ghost'"):
        call_command("create_api_key", "ghost")
    assert ApiKey.objects.count() == 0


def test_lists_are_paginated(staff: APIClient) -> None:
    for i in range(5):
        enrolled(f"box-{i}")
    page = staff.get("/api/nodes?limit=2&offset=2").json()
    assert page["count"] == 5
    assert [n["name"] for n in page["results"]] == ["box-2", "box-3"]
    assert "offset=4" in page["next"]


def test_rotating_the_credential_of_a_node_whose_agent_is_away_is_a_clear_conflict(staff: APIClient) -> None:
    node, _ = enrolled("box-away")
    refused = staff.post(f"/api/nodes/{node.pk}/rotate-credential")
    assert refused.status_code == 409 and "must be connected" in refused.json()["detail"]
    assert not Node.objects.get(pk=node.pk).rotation_pending  # nothing changed
