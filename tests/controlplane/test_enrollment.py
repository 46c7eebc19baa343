"""Join tokens and enrollment through the REST API, on a real database."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.nodes.credentials import digest
from controlplane.nodes.models import JoinToken, Node

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff() -> APIClient:
    user = get_user_model().objects.create_user("admin", password="x" * 12, is_staff=True)
    client = APIClient()
    client.force_authenticate(user)
    return client


def new_token(staff: APIClient, **body) -> dict:
    response = staff.post("/api/join-tokens", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def enroll(token: str, name: str = "box-1", **extra) -> tuple[int, dict]:
    response = APIClient().post(
        "/api/agents/enroll", {"token": token, "name": name, "inventory": {"cpu_count": 2}, **extra}, format="json"
    )
    return response.status_code, response.json()


def test_a_join_token_is_shown_once_and_stored_hashed(staff: APIClient) -> None:
    body = new_token(staff, name="rack A")
    clear = body["token"]
    assert clear.startswith("odmoe-join-")
    assert body["agent_command"].startswith(f"ODMOE_JOIN_TOKEN={clear} python -m agent --server ")  # not in ps
    stored = JoinToken.objects.get()
    assert stored.token_hash == digest(clear) and clear not in stored.token_hash
    listed = staff.get("/api/join-tokens").json()
    assert clear not in str(listed)


def test_enrollment_gives_a_node_credential_that_is_stored_hashed(staff: APIClient) -> None:
    token = new_token(staff)["token"]
    status, body = enroll(token, address="10.0.0.7")
    assert status == 201
    node = Node.objects.get(pk=body["node_id"])
    assert node.name == "box-1" and node.address == "10.0.0.7" and node.inventory == {"cpu_count": 2}
    assert node.secret_hash == digest(body["node_secret"])
    me = APIClient().get("/api/agents/me", HTTP_AUTHORIZATION=f"Node {node.id}:{body['node_secret']}")
    assert me.status_code == 200 and me.json()["name"] == "box-1"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(uses=1), "already used"),
        (dict(expires_at=timezone.now() - timedelta(seconds=1)), "expired"),
        (dict(revoked=True), "revoked"),
    ],
)
def test_a_spent_expired_or_revoked_token_is_refused_and_changes_nothing(staff, change, reason) -> None:
    token = new_token(staff)["token"]
    JoinToken.objects.update(**change)
    status, body = enroll(token)
    assert status == 400 and reason in body["detail"]
    assert Node.objects.count() == 0


def test_an_unknown_token_and_bad_input_are_refused(staff: APIClient) -> None:
    assert enroll("odmoe-join-made-up")[0] == 400
    token = new_token(staff)["token"]
    status, body = enroll(token, name="no spaces allowed")
    assert status == 400 and "name" in body
    assert JoinToken.objects.get().uses == 0


def test_a_token_with_several_uses_enrolls_that_many_nodes(staff: APIClient) -> None:
    token = new_token(staff, max_uses=2)["token"]
    assert enroll(token, "a")[0] == 201
    status, body = enroll(token, "a")
    assert status == 400 and "already enrolled" in body["detail"]
    assert enroll(token, "b")[0] == 201
    assert enroll(token, "c")[0] == 400
    assert sorted(Node.objects.values_list("name", flat=True)) == ["a", "b"]


def test_a_forged_node_credential_is_refused(staff: APIClient) -> None:
    token = new_token(staff)["token"]
    _, body = enroll(token)
    forged = APIClient().get("/api/agents/me", HTTP_AUTHORIZATION=f"Node {body['node_id']}:odmoe-node-forged")
    assert forged.status_code == 401


def test_only_staff_manage_tokens_and_see_nodes() -> None:
    user = get_user_model().objects.create_user("alice", password="x" * 12)
    client = APIClient()
    assert client.post("/api/join-tokens", {}, format="json").status_code == 401  # who are you?
    client.force_authenticate(user)
    assert client.post("/api/join-tokens", {}, format="json").status_code == 403
    assert client.get("/api/nodes").status_code == 403
    assert JoinToken.objects.count() == 0


def test_a_node_credential_is_not_a_staff_login(staff: APIClient) -> None:
    token = new_token(staff)["token"]
    _, body = enroll(token)
    as_node = APIClient()
    as_node.credentials(HTTP_AUTHORIZATION=f"Node {body['node_id']}:{body['node_secret']}")
    assert as_node.get("/api/nodes").status_code in (401, 403)
    assert as_node.post("/api/join-tokens", {}, format="json").status_code in (401, 403)


def test_production_settings_refuse_debug_and_the_development_key(monkeypatch) -> None:
    import importlib

    from django.core.exceptions import ImproperlyConfigured

    monkeypatch.setenv("DJANGO_DEBUG", "0")
    monkeypatch.delenv("DJANGO_SECRET_KEY", raising=False)
    import controlplane.config.settings.base as base

    importlib.reload(base)
    with pytest.raises(ImproperlyConfigured, match="DJANGO_SECRET_KEY"):
        importlib.import_module("controlplane.config.settings.production")
    monkeypatch.setenv("DJANGO_DEBUG", "1")
    monkeypatch.setenv("DJANGO_SECRET_KEY", "k" * 40)
    importlib.reload(base)
    with pytest.raises(ImproperlyConfigured, match="DEBUG"):
        importlib.import_module("controlplane.config.settings.production")
    monkeypatch.setenv("DJANGO_DEBUG", "0")
    importlib.reload(base)
    importlib.import_module("controlplane.config.settings.production")
    # The example environment file's secret is long enough for a length check: refused by name.
    monkeypatch.setenv("DJANGO_SECRET_KEY", "replace-with-64-random-characters")
    importlib.reload(base)
    with pytest.raises(ImproperlyConfigured, match="not the example's"):
        importlib.reload(importlib.import_module("controlplane.config.settings.production"))


def test_local_settings_keep_debug_off_and_make_this_installs_own_secret(monkeypatch, tmp_path) -> None:
    import importlib

    monkeypatch.delenv("DJANGO_DEBUG", raising=False)
    monkeypatch.delenv("DJANGO_SECRET_KEY", raising=False)
    monkeypatch.setenv("ODMOE_VAR_DIR", str(tmp_path / "var"))
    import controlplane.config.settings.base as base

    importlib.reload(base)
    local = importlib.reload(importlib.import_module("controlplane.config.settings.local"))
    secret_file = tmp_path / "var" / "secret_key"
    assert local.DEBUG is False
    assert secret_file.read_text().strip() == local.SECRET_KEY and len(local.SECRET_KEY) >= 48
    assert local.SECRET_KEY != base.INSECURE_DEV_SECRET
    assert secret_file.stat().st_mode & 0o777 == 0o600
    assert importlib.reload(local).SECRET_KEY == local.SECRET_KEY  # made once, then kept
