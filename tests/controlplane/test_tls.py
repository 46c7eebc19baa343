"""TLS, the control plane's side: the pin of its certificate in join tokens, in the one-liner the
console and the API print and in the install script; the proxy's word that a request came over
https. ``test_tls_e2e`` runs it all with real processes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.test import Client
from rest_framework.test import APIClient

from agent.tls import split_join_token
from controlplane.nodes.credentials import digest
from controlplane.nodes.models import JoinToken, Node
from tests.certificates import ServerIdentity, server_identity

PROXY_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")  # production's SECURE_PROXY_SSL_HEADER


@pytest.fixture
def identity(tmp_path: Path, settings) -> ServerIdentity:
    """The certificate the TLS proxy presents, named by ODMOE_TLS_CERT_FILE."""
    identity = server_identity(tmp_path / "tls", "proxy")
    settings.TLS_CERT_FILE = str(identity.cert_path)
    return identity


@pytest.fixture
def staff() -> APIClient:
    client = APIClient()
    client.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))
    return client


@pytest.mark.django_db
def test_a_join_token_made_behind_the_proxy_carries_the_pin_and_its_one_liner_pins_curl(
    identity: ServerIdentity, staff: APIClient, settings
) -> None:
    settings.SECURE_PROXY_SSL_HEADER = PROXY_HEADER
    settings.ALLOWED_HOSTS = ["cp.example", "testserver"]
    made = staff.post("/api/join-tokens", {}, format="json", HTTP_HOST="cp.example", HTTP_X_FORWARDED_PROTO="https")
    assert made.status_code == 201, made.content
    body = made.json()
    token = body["token"]
    secret, pin = split_join_token(token)
    assert pin == identity.pin and JoinToken.objects.get().token_hash == digest(secret)  # the pin is not stored
    assert body["install_command"] == (
        f"curl -fsSL --pinnedpubkey '{identity.pin}' -k https://cp.example/agent/install.sh"
        f" | ODMOE_JOIN_TOKEN={token} sh -s -- --server https://cp.example"
    )
    assert body["agent_command"] == f"ODMOE_JOIN_TOKEN={token} python -m agent --server https://cp.example"
    assert body["warning"] == ""
    # The whole token enrolls, as the agent sends it; a damaged pin part is refused and spends nothing.
    damaged = APIClient().post("/api/agents/enroll", {"token": token[:-3], "name": "box"}, format="json")
    assert damaged.status_code == 400 and "copy the token whole" in damaged.json()["detail"]
    enrolled = APIClient().post("/api/agents/enroll", {"token": token, "name": "box"}, format="json")
    assert enrolled.status_code == 201 and JoinToken.objects.get().uses == 1 and Node.objects.count() == 1


@pytest.mark.django_db
def test_without_a_certificate_file_tokens_carry_no_pin_and_plain_http_off_loopback_is_flagged(
    staff: APIClient, settings
) -> None:
    settings.ALLOWED_HOSTS = ["cp.example", "127.0.0.1"]
    loopback = staff.post("/api/join-tokens", {}, format="json", HTTP_HOST="127.0.0.1:8000").json()
    assert "." not in loopback["token"] and loopback["warning"] == ""
    assert loopback["install_command"].startswith("curl -fsSL http://127.0.0.1:8000/agent/install.sh | ")
    lab = staff.post("/api/join-tokens", {}, format="json", HTTP_HOST="cp.example").json()
    assert "agents refuse a plain http server" in lab["warning"] and "--insecure" in lab["warning"]


@pytest.mark.django_db
def test_the_install_script_facts_and_console_give_the_pin_to_curl(identity: ServerIdentity, settings) -> None:
    settings.ALLOWED_HOSTS = ["cp.example"]
    https = {"HTTP_HOST": "cp.example", "secure": True}
    script = Client().get("/agent/install.sh", **https).content.decode()
    assert f'PIN="{identity.pin}"' in script and 'SERVER="https://cp.example"' in script
    upgrade = f"curl -fsSL --pinnedpubkey '{identity.pin}' -k https://cp.example/agent/install.sh | sh"
    assert Client().get("/agent/facts", **https).json()["install_command"] == upgrade
    browser = Client()
    browser.force_login(get_user_model().objects.create_user("boss", is_staff=True))
    page = browser.get("/console/", **https).content.decode()
    shown = re.search(r'<script id="upgrade-command" type="application/json">(.*?)</script>', page)
    assert shown is not None and json.loads(shown.group(1)) == upgrade
    assert 'id="token-warning"' in page


def test_a_certificate_file_that_is_not_one_fails_the_system_check(tmp_path: Path, settings) -> None:
    settings.TLS_CERT_FILE = str(tmp_path / "missing.pem")
    with pytest.raises(SystemCheckError, match=r"ODMOE_TLS_CERT_FILE=.*missing\.pem"):
        call_command("check")
    (tmp_path / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\nnot a certificate\n-----END PRIVATE KEY-----\n")
    settings.TLS_CERT_FILE = str(tmp_path / "key.pem")
    with pytest.raises(SystemCheckError, match="is not a PEM certificate"):
        call_command("check")


def test_production_takes_the_proxys_word_that_a_request_came_over_https(monkeypatch) -> None:
    import importlib

    monkeypatch.setenv("DJANGO_DEBUG", "0")
    monkeypatch.setenv("DJANGO_SECRET_KEY", "k" * 40)
    import controlplane.config.settings.base as base

    importlib.reload(base)
    production = importlib.reload(importlib.import_module("controlplane.config.settings.production"))
    assert production.SECURE_PROXY_SSL_HEADER == PROXY_HEADER


@pytest.mark.django_db
def test_a_script_gets_a_fresh_token_and_its_one_liner_from_manage_py(identity: ServerIdentity) -> None:
    from io import StringIO

    out, err = StringIO(), StringIO()
    call_command("join_token", "--server", "https://cp.example/", "--max-uses", "3", "--json", stdout=out, stderr=err)
    made = json.loads(out.getvalue())
    assert split_join_token(made["token"])[1] == identity.pin and JoinToken.objects.get().max_uses == 3
    assert made["install_command"].startswith(f"curl -fsSL --pinnedpubkey '{identity.pin}' -k https://cp.example/")
    assert made["warning"] == "" and err.getvalue() == ""
    out = StringIO()
    call_command("join_token", "--server", "http://10.0.0.1:8000", stdout=out, stderr=err)
    assert out.getvalue().startswith("curl -fsSL http://10.0.0.1:8000/agent/install.sh | ODMOE_JOIN_TOKEN=")
    assert "--insecure" in err.getvalue()  # agents refuse it without
    for bad in (["--server", "ftp://x"], ["--server", "https://cp", "--ttl-s", "5"]):
        with pytest.raises(CommandError):
            call_command("join_token", *bad, stdout=StringIO())
    assert JoinToken.objects.count() == 2  # nothing made by a refused call
