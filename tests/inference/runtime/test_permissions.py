"""Who may say what to whom on the data plane (``inference.runtime.permissions``): the table and its check."""

from __future__ import annotations

import subprocess
import sys

import pytest

from inference.runtime import permissions
from inference.runtime.permissions import (
    CLIENT,
    INBOX,
    LINK,
    MAIN,
    RULES,
    SHADOW,
    WORKER,
    PrincipalError,
    admitted_kinds,
    client_name,
    correspondents,
    permitted,
    principal_kind,
    refusal,
    sender_fits,
    sender_kind,
)
from tests.paths import REPO


def test_every_message_type_in_the_table_is_one_of_the_protocols_and_each_has_a_sender() -> None:
    from inference.runtime.protocol import _REGISTRY

    named = set().union(*RULES.values())
    assert named <= set(_REGISTRY), named - set(_REGISTRY)
    assert set(_REGISTRY) <= named, f"no rule lets anyone send {set(_REGISTRY) - named}"


@pytest.mark.parametrize(
    ("name", "kind"),
    [("main", MAIN), ("shadow", SHADOW), ("worker-0", WORKER), ("worker-15", WORKER), ("client", CLIENT)],
)
def test_principals_are_main_shadow_workers_and_the_client(name: str, kind: str) -> None:
    assert principal_kind(name) == kind


@pytest.mark.parametrize(
    "name", ["", "Main", "worker", "worker-", "worker-01", "worker--1", "worker-1x", "client:a", 3]
)
def test_anything_else_is_no_principal(name) -> None:
    with pytest.raises(PrincipalError, match="is not a principal"):
        principal_kind(name)


def test_a_client_holder_names_its_sockets_client_colon_suffix() -> None:
    assert client_name("agent-probe-worker-3") == "client:agent-probe-worker-3"
    assert sender_kind("client:1a2b") == CLIENT and sender_kind("worker-2") == WORKER
    for bad in ("", "a b", "x" * 65, "../x", "a:b"):
        with pytest.raises(PrincipalError, match="client's name"):
            client_name(bad)


def test_the_sender_rule_roles_exactly_a_client_as_client_or_client_colon_suffix() -> None:
    assert sender_fits("main", "main") and sender_fits("worker-3", "worker-3")
    assert not sender_fits("shadow", "main") and not sender_fits("worker-3", "worker-30")
    assert not sender_fits("main", "main:x")  # no suffix for a role
    assert sender_fits("client", "client") and sender_fits("client", "client:agent-probe-main")
    assert not sender_fits("client", "client:") and not sender_fits("client", "clientx")
    assert not sender_fits("client", "main")
    assert not sender_fits(None, "main")  # delivered by no admitted key


def test_a_worker_cannot_speak_to_the_shadow_as_main_nor_shut_anyone_down() -> None:
    # Its key is not admitted at the shadow's inbox, nor at main's, nor at another worker's.
    for role in (SHADOW, MAIN, WORKER):
        assert WORKER not in admitted_kinds(role)
    # On main's link to it, the only place it speaks, it may only answer.
    assert permitted(MAIN, WORKER, LINK) == {"pong", "expert_result", "worker_stats"}
    assert refusal("worker-1", "worker-1", "shutdown", permitted(MAIN, WORKER, LINK)) == "worker-1 may not send it here"
    assert "came with the key of worker-1" in refusal("worker-1", "main", "align", permitted(SHADOW, MAIN, INBOX))


def test_the_shadow_takes_alignment_only_from_main_and_main_takes_generations_only_from_its_client() -> None:
    for message in ("shadow_begin", "align", "set_alignment", "end"):
        senders = {s for (r, s, _), types in RULES.items() if r == SHADOW and message in types}
        assert senders == {MAIN}, (message, senders)
    for message in ("generate", "cancel", "set_alignment", "shutdown"):
        senders = {s for (r, s, _), types in RULES.items() if r == MAIN and message in types}
        assert senders == {CLIENT}, (message, senders)
    shutdowns = {(r, s) for (r, s, _), types in RULES.items() if "shutdown" in types}
    assert shutdowns == {(MAIN, CLIENT), (SHADOW, MAIN), (WORKER, MAIN)}


def test_what_each_inbox_admits() -> None:
    assert admitted_kinds(MAIN) == {SHADOW, CLIENT}
    assert admitted_kinds(SHADOW) == {MAIN, CLIENT}
    assert admitted_kinds(WORKER) == {MAIN, SHADOW, CLIENT}
    assert admitted_kinds(CLIENT) == set()  # a client has no inbox


def test_a_message_passes_only_from_its_principal_and_when_permitted() -> None:
    allowed = permitted(WORKER, SHADOW, INBOX)
    assert refusal("shadow", "shadow", "prediction", allowed) == ""
    assert refusal("shadow", "shadow", "expert_request", allowed) == "shadow may not send it here"
    assert "'main' but came with the key of shadow" in refusal("shadow", "main", "expert_request", allowed)
    assert "no principal" in refusal(None, "main", "ping", permitted(WORKER, MAIN, INBOX))
    assert refusal("client", "client:agent", "ping", permitted(WORKER, CLIENT, INBOX)) == ""
    assert refusal("client", "client:agent", "shutdown", permitted(WORKER, CLIENT, INBOX)) != ""


def test_each_role_gets_the_keys_of_those_it_talks_with_only() -> None:
    roles = ["main", "shadow", "worker-0", "worker-1"]
    assert correspondents("main", roles) == ["shadow", "worker-0", "worker-1"]
    assert correspondents("shadow", roles) == ["main", "worker-0", "worker-1"]
    assert correspondents("worker-1", roles) == ["main", "shadow"]


def test_the_table_is_pure_python() -> None:
    """The control plane derives keys from it: importing it pulls in neither torch nor zmq."""
    code = "import sys, inference.runtime.permissions; print(sorted({'torch', 'zmq'} & set(sys.modules)))"
    root = REPO
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60, cwd=root)
    assert out.stdout.strip() == "[]"


def test_the_security_page_shows_the_table_as_the_code_has_it() -> None:
    page = REPO / "docs" / "data-plane-security.md"
    assert permissions.markdown_table() in page.read_text()
