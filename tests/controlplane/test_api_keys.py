"""API keys: scopes narrow what a key may do, expiry and revocation stop it at once, keys are
managed through the API (a key never makes a wider key) and on the API keys page, and only staff
grant one a shared prefix-cache namespace."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone
from rest_framework.permissions import AllowAny
from rest_framework.test import APIClient
from rest_framework.views import APIView

from controlplane.accounts.models import ApiKey
from controlplane.accounts.permissions import KeyScopes
from controlplane.accounts.selectors import caller_of
from controlplane.accounts.services import create_api_key
from controlplane.accounts.usage import Caller
from controlplane.nodes.authentication import IsNode

pytestmark = pytest.mark.django_db(transaction=True)  # the OpenAI views are async: other threads


def client_for(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


@pytest.fixture
def staff():
    return get_user_model().objects.create_user("admin", is_staff=True)


@pytest.fixture
def alice():
    return get_user_model().objects.create_user("alice", password="a-long-test-password")


def test_a_key_does_what_its_scopes_allow_and_nothing_else(staff) -> None:
    _, read = create_api_key(user=staff, scopes=["read"])
    _, inference = create_api_key(user=staff, scopes=["inference"])
    _, metrics = create_api_key(user=staff, scopes=["metrics"])
    _, admin = create_api_key(user=staff, scopes=["admin", "read"])

    assert client_for(read).get("/api/nodes").status_code == 200
    refused = client_for(read).post("/api/join-tokens", {}, format="json")
    assert refused.status_code == 403 and "'admin' scope" in refused.json()["detail"]
    assert client_for(read).post("/api/deployments/estimate", {"workers": 2}, format="json").status_code == 200
    assert client_for(admin).post("/api/join-tokens", {}, format="json").status_code == 201

    assert client_for(inference).get("/api/nodes").status_code == 403
    job = client_for(inference).post("/api/jobs", {"model": "none", "prompt": "x"}, format="json")
    assert job.status_code == 404  # past the scope check: there is no such model
    assert client_for(read).post("/api/jobs", {"model": "none", "prompt": "x"}, format="json").status_code == 403

    assert client_for(inference).get("/v1/models").status_code == 200
    denied = client_for(read).get("/v1/models")
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "insufficient_scope"
    missing = client_for(inference).get("/v1/models/none")  # one model: none is ready here
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert client_for(read).get("/v1/models/none").status_code == 403

    assert client_for(metrics).get("/metrics").status_code == 200
    assert client_for(read).get("/metrics").status_code == 401
    assert client_for(metrics).get("/api/nodes").status_code == 403
    assert client_for(metrics).get("/v1/models").status_code == 403


def test_scopes_never_exceed_the_user(alice, staff) -> None:
    _, key = create_api_key(user=alice)
    assert ApiKey.objects.get(user=alice).scopes == ["inference", "read"]  # the default: all a user may hold
    assert client_for(key).get("/api/nodes").status_code == 403  # read scope, but not staff
    wider = client_for(key).post("/api/keys", {"scopes": ["metrics"]}, format="json")
    assert wider.status_code == 403  # managing keys with a key needs admin, which alice cannot hold
    with pytest.raises(CommandError, match="may not hold scope admin, metrics"):
        call_command("create_api_key", "alice", "--scope", "metrics", "--scope", "admin")
    # A staff key with admin makes keys, never wider than itself.
    _, admin = create_api_key(user=staff, scopes=["admin", "read"])
    made = client_for(admin).post("/api/keys", {"name": "ci", "scopes": ["read"]}, format="json")
    assert made.status_code == 201 and made.json()["scopes"] == ["read"] and made.json()["key"].startswith("odmoe-key-")
    assert client_for(made.json()["key"]).get("/api/nodes").status_code == 200
    escalate = client_for(admin).post("/api/keys", {"scopes": ["metrics"]}, format="json")
    assert escalate.status_code == 400 and "does not hold" in escalate.json()["scopes"][0]
    unknown = client_for(admin).post("/api/keys", {"scopes": ["root"]}, format="json")
    assert unknown.status_code == 400
    assert ApiKey.objects.filter(user=staff).count() == 2  # the refused ones made nothing


def test_expired_and_revoked_keys_stop_at_once(alice, staff) -> None:
    key, clear = create_api_key(user=alice, expires_at=timezone.now() + timedelta(days=1))
    assert client_for(clear).get("/api/jobs").status_code == 200
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert client_for(clear).get("/api/jobs").status_code == 401
    assert client_for(clear).get("/v1/models").status_code == 401
    with pytest.raises(ValueError, match="future"):
        create_api_key(user=alice, expires_at=timezone.now())

    # Revocation through the API: alice revokes her own key from a browser session; not bob's.
    key, clear = create_api_key(user=alice)
    bob_key, _ = create_api_key(user=get_user_model().objects.create_user("bob"))
    browser = APIClient()
    browser.force_authenticate(alice)
    listed = browser.get("/api/keys").json()
    assert [k["id"] for k in listed["results"]] == [key.pk, ApiKey.objects.filter(user=alice).last().pk]
    assert browser.delete(f"/api/keys/{bob_key.pk}").status_code == 404
    revoked = browser.delete(f"/api/keys/{key.pk}")
    assert revoked.status_code == 200 and revoked.json()["state"] == "revoked" and revoked.json()["revoked_at"]
    assert client_for(clear).get("/api/jobs").status_code == 401
    assert browser.delete(f"/api/keys/{key.pk}").json()["state"] == "revoked"  # twice is harmless
    # Staff revoke anyone's key (a leaked one) with an admin key.
    _, admin = create_api_key(user=staff)
    assert client_for(admin).delete(f"/api/keys/{bob_key.pk}").json()["state"] == "revoked"


def test_only_staff_grant_a_key_a_shared_prefix_namespace_which_its_generations_then_carry(alice) -> None:
    call_command("create_api_key", "alice", "--name", "bot", "--prefix-namespace", "support-bot", stdout=io.StringIO())
    granted = ApiKey.objects.get(user=alice, name="bot")
    assert caller_of(alice.pk, granted) == Caller(alice.pk, granted.pk, prefix_namespace="support-bot")
    assert caller_of(alice.pk, None).prefix_namespace == ""  # a browser session: alice's own namespace
    with pytest.raises(CommandError, match="prefix namespace must be"):
        call_command("create_api_key", "alice", "--prefix-namespace", "../other", stdout=io.StringIO())
    # Alice cannot grant herself one (the API takes no such field); she sees what staff granted.
    browser = APIClient()
    browser.force_authenticate(alice)
    made = browser.post("/api/keys", {"name": "mine", "prefix_namespace": "support-bot"}, format="json")
    assert made.status_code == 201 and made.json()["prefix_namespace"] == ""
    shown = {k["name"]: k["prefix_namespace"] for k in browser.get("/api/keys").json()["results"]}
    assert shown == {"bot": "support-bot", "mine": ""}


def test_the_api_keys_page_creates_shows_once_and_revokes(alice) -> None:
    browser = Client()
    browser.force_login(alice)
    page = browser.get("/keys/")
    assert page.status_code == 200 and b"No keys yet." in page.content
    assert b'value="metrics"' not in page.content  # only the scopes alice may hold are offered
    made = browser.post("/keys/", {"name": "laptop", "scopes": ["inference"], "expires_in_days": "30"})
    clear = made.context["created"]
    assert clear.startswith("odmoe-key-") and clear.encode() in made.content
    key = ApiKey.objects.get(user=alice)
    assert key.scopes == ["inference"] and key.expires_at > timezone.now() + timedelta(days=29)
    assert clear.encode() not in browser.get("/keys/").content  # never shown again
    assert client_for(clear).get("/v1/models").status_code == 200
    refused = browser.post("/keys/", {"scopes": ["admin"]})
    assert refused.status_code == 200 and ApiKey.objects.filter(user=alice).count() == 1
    assert browser.post("/keys/", {"revoke": str(key.pk)}).status_code == 302
    assert ApiKey.objects.get(pk=key.pk).state == "revoked"
    assert client_for(clear).get("/v1/models").status_code == 401
    assert Client().get("/keys/").status_code == 302  # to the login page


def _views(patterns, prefix=""):
    for entry in patterns:
        if isinstance(entry, URLResolver):
            yield from _views(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            yield prefix + str(entry.pattern), getattr(entry.callback, "cls", None)


def test_every_api_view_for_users_checks_key_scopes() -> None:
    """A view added later without KeyScopes would let any key do anything its user may."""
    checked = []
    for route, view in _views(get_resolver().url_patterns):
        if view is None or not issubclass(view, APIView) or route.startswith("api/schema"):
            continue
        permissions = list(view.permission_classes)
        if permissions in ([AllowAny], [IsNode]):
            continue  # enrollment, and the agents' own endpoints (node credentials, never keys)
        assert KeyScopes in permissions, f"{route} ({view.__name__}) does not check the API key's scopes"
        checked.append(route)
    assert len(checked) >= 15


def test_the_openai_api_authenticates_by_the_rest_apis_own_classes() -> None:
    """/v1 runs the REST API's authentication classes itself (``openai_api._identify``: an API key,
    else a session held to its CSRF token): the ones DRF is configured with, in its order."""
    from rest_framework.authentication import SessionAuthentication
    from rest_framework.settings import api_settings

    from controlplane.accounts.authentication import ApiKeyAuthentication

    assert [ApiKeyAuthentication, SessionAuthentication] == api_settings.DEFAULT_AUTHENTICATION_CLASSES
