"""Deployments through the REST API: suggested or overridden roles, one active deployment per node."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from controlplane.artifacts.services import register_model
from controlplane.deployments.models import Deployment, DeploymentStatus
from controlplane.nodes.models import Node, NodeStatus
from controlplane.nodes.services import create_join_token, enroll_node

pytestmark = pytest.mark.django_db
GIB = 2**30


@pytest.fixture
def staff() -> APIClient:
    client = APIClient()
    client.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))
    return client


@pytest.fixture
def model(tiny_model: Path):
    return register_model(name="tiny", path=str(tiny_model))


def box(name: str, gpu_gib: int) -> Node:
    _, token = create_join_token(created_by=None)
    node, _ = enroll_node(token=token, name=name, inventory={"gpus": [{"memory_bytes": gpu_gib * GIB}]})
    return node


def ids(*nodes: Node) -> list[str]:
    return [str(n.pk) for n in nodes]


def test_suggested_roles_and_a_created_deployment(staff: APIClient, model) -> None:
    big, mid, w1, w2 = box("big", 48), box("mid", 24), box("w1", 12), box("w2", 12)
    suggested = staff.post(
        "/api/deployments/suggest", {"model": model.pk, "nodes": ids(w1, big, mid, w2)}, format="json"
    ).json()
    assert suggested == {"main": str(mid.pk), "shadow": str(big.pk), "workers": sorted(ids(w1, w2))}
    created = staff.post(
        "/api/deployments",
        {"name": "demo", "model": model.pk, "nodes": ids(big, mid, w1, w2), "shadow_dtype": "int8"},
        format="json",
    )
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["status"] == DeploymentStatus.DRAFT and body["shadow_dtype"] == "int8"
    assert body["strategy"] == "odmoe"  # the default
    roles = {m["node_name"]: (m["role"], m["worker_index"]) for m in body["members"]}
    assert roles["big"] == ("shadow", None) and roles["mid"] == ("main", None)
    assert sorted(roles[n] for n in ("w1", "w2")) == [("worker", 0), ("worker", 1)]


def test_roles_can_be_overridden_but_must_use_each_node_once(staff: APIClient, model) -> None:
    a, b, c = box("a", 8), box("b", 8), box("c", 8)
    body = {"name": "x", "model": model.pk, "nodes": ids(a, b, c)}
    override = {"main": str(c.pk), "shadow": str(a.pk), "workers": [str(b.pk)]}
    created = staff.post("/api/deployments", {**body, "roles": override}, format="json").json()
    assert {m["node_name"]: m["role"] for m in created["members"]} == {"a": "shadow", "b": "worker", "c": "main"}
    Deployment.objects.all().delete()
    twice = {"main": str(a.pk), "shadow": str(a.pk), "workers": [str(b.pk)]}
    refused = staff.post("/api/deployments", {**body, "roles": twice}, format="json")
    assert refused.status_code == 400 and "only one role" in refused.json()["detail"]
    assert Deployment.objects.count() == 0


def test_a_node_is_in_one_active_deployment_at_most(staff: APIClient, model) -> None:
    a, b, c, d = box("a", 8), box("b", 8), box("c", 8), box("d", 8)
    first = staff.post("/api/deployments", {"name": "one", "model": model.pk, "nodes": ids(a, b, c)}, format="json")
    busy = staff.post("/api/deployments", {"name": "two", "model": model.pk, "nodes": ids(a, b, d)}, format="json")
    assert busy.status_code == 400 and "already in active deployment one" in busy.json()["detail"]
    staff.post(f"/api/deployments/{first.json()['id']}/stop", format="json")
    again = staff.post("/api/deployments", {"name": "two", "model": model.pk, "nodes": ids(a, b, d)}, format="json")
    assert again.status_code == 201


def test_bad_input_is_refused_with_a_reason(staff: APIClient, model) -> None:
    a, b, c = box("a", 8), box("b", 8), box("c", 8)
    Node.objects.filter(pk=c.pk).update(status=NodeStatus.DRAINING)
    for body, reason in [
        ({"nodes": ids(a, b, c)}, "draining"),
        ({"nodes": [*ids(a, b), "00000000-0000-0000-0000-000000000000"]}, "unknown nodes"),
        ({"nodes": ids(a, b, a)}, "listed twice"),
        ({"nodes": ids(a, b, c), "token_period": -1}, "token_period"),
        ({"nodes": ids(a, b, c), "strategy": "belady"}, "strategy"),
    ]:
        response = staff.post("/api/deployments", {"name": "x", "model": model.pk, **body}, format="json")
        assert response.status_code == 400 and reason in str(response.json()), (body, response.json())
    assert Deployment.objects.count() == 0


def test_alignment_settings_change_until_stopped(staff: APIClient, model) -> None:
    a, b, c = box("a", 8), box("b", 8), box("c", 8)
    created = staff.post("/api/deployments", {"name": "d", "model": model.pk, "nodes": ids(a, b, c)}, format="json")
    url = f"/api/deployments/{created.json()['id']}"
    changed = staff.patch(f"{url}/settings", {"token_period": 1, "kv_period": 4}, format="json").json()
    assert (changed["token_period"], changed["kv_period"]) == (1, 4)
    staff.post(f"{url}/stop", format="json")
    late = staff.patch(f"{url}/settings", {"token_period": 2, "kv_period": 2}, format="json")
    assert late.status_code == 409 and "stopped" in late.json()["detail"]


def test_a_planned_deployment_gets_the_simulators_estimate(staff: APIClient, model) -> None:
    profiles = staff.get("/api/deployments/estimate").json()
    assert profiles["default"] == "3090-pcie4-1gbe"
    assert "3090-pcie4-1gbe" in {p["name"] for p in profiles["profiles"]}
    mixtral = staff.post("/api/deployments/estimate", {"workers": 8}, format="json")
    assert mixtral.status_code == 200, mixtral.content
    body = mixtral.json()
    assert body["model"]["layers"] == 32 and body["strategy"] == "odmoe"
    for kind in ("ideal", "adjusted"):
        assert body[kind]["decode_tok_s"] > 0 and body[kind]["ttft_ms"] > 0
    assert body["adjusted"]["decode_tok_s"] < body["ideal"]["decode_tok_s"]
    full = staff.post("/api/deployments/estimate", {"workers": 8, "strategy": "full-cache"}, format="json").json()
    assert full["adjusted"]["decode_tok_s"] > body["adjusted"]["decode_tok_s"]  # the ceiling
    tiny = staff.post(
        "/api/deployments/estimate", {"workers": 2, "model": model.pk, "shadow_dtype": "fp16"}, format="json"
    )
    assert tiny.status_code == 200 and tiny.json()["model"]["layers"] == 4
    for bad, reason in [
        ({"workers": 0}, "workers"),
        ({"workers": 8, "profile": "abacus"}, "profile"),
        ({"workers": 8, "shadow_dtype": "fp32"}, "shadow_dtype"),
    ]:
        refused = staff.post("/api/deployments/estimate", bad, format="json")
        assert refused.status_code == 400 and reason in str(refused.json()), (bad, refused.json())
