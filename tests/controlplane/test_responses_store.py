"""The Responses API's stored answers (``controlplane.serving.responses_store``): each user's own,
at most ``MAX_PER_USER`` of them (the oldest dropped), none past its expiry."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from controlplane.serving import responses_store
from controlplane.serving.models import StoredResponse

pytestmark = pytest.mark.django_db


def test_a_user_continues_only_their_own_stored_responses() -> None:
    alice, bob = (get_user_model().objects.create_user(name) for name in ("alice", "bob"))
    items = [{"role": "user", "content": "Hi"}, {"type": "message", "role": "assistant", "content": "Hello"}]
    responses_store.keep(alice.pk, "resp_a", items)
    assert responses_store.earlier_items(alice.pk, "resp_a") == items
    assert responses_store.earlier_items(bob.pk, "resp_a") is None  # another's: not found, as one never stored
    assert responses_store.earlier_items(alice.pk, "resp_b") is None


def test_a_user_keeps_the_newest_and_nothing_expired(monkeypatch: pytest.MonkeyPatch) -> None:
    alice, bob = (get_user_model().objects.create_user(name) for name in ("alice", "bob"))
    monkeypatch.setattr(responses_store, "MAX_PER_USER", 3)
    responses_store.keep(bob.pk, "resp_bob", [])
    for i in range(5):
        responses_store.keep(alice.pk, f"resp_{i}", [{"role": "user", "content": str(i)}])
    kept = set(StoredResponse.objects.filter(owner=alice).values_list("response_id", flat=True))
    assert kept == {"resp_2", "resp_3", "resp_4"}  # the newest 3; bob's untouched
    assert responses_store.earlier_items(bob.pk, "resp_bob") == []
    StoredResponse.objects.filter(response_id="resp_4").update(expires_at=timezone.now() - timedelta(seconds=1))
    assert responses_store.earlier_items(alice.pk, "resp_4") is None  # expired: not found
    responses_store.keep(bob.pk, "resp_6", [])  # and dropped at the next store, whoever's
    assert not StoredResponse.objects.filter(response_id="resp_4").exists()


def test_what_a_response_keeps_is_what_its_conversation_was_read_from() -> None:
    """Fields no reader takes are not kept: a stored conversation is what the bounds counted."""
    from controlplane.serving.responses_api import normalized
    from controlplane.serving.text import InputError

    given = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi", "pad": "x" * 1000}], "pad": "y" * 1000},
        {"type": "function_call", "call_id": "c1", "name": "pick", "arguments": "{}", "pad": ["z"] * 100},
        {"type": "function_call_output", "call_id": "c1", "output": "3", "pad": {}},
    ]
    assert normalized(given) == [
        {"type": "message", "role": "user", "content": "Hi"},
        {"type": "function_call", "call_id": "c1", "name": "pick", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
    ]
    assert normalized(normalized(given)) == normalized(given)
    with pytest.raises(InputError) as refused:
        normalized([{"type": "function_call", "call_id": "c1", "name": {"deep": 1}, "arguments": "{}"}])
    assert refused.value.param == "input[0].name"


def test_a_generated_nul_is_kept_as_the_replacement_character() -> None:
    """PostgreSQL's jsonb refuses ``\\u0000``: a sampled answer holding byte 0 failed its response
    with a 500 in CI (``/v1/responses``, temperature 1). It is kept as U+FFFD, as job outputs are."""
    alice = get_user_model().objects.create_user("alice")
    responses_store.keep(alice.pk, "resp_nul", [{"role": "assistant", "content": "a\x00b"}])
    assert responses_store.earlier_items(alice.pk, "resp_nul") == [{"role": "assistant", "content": "a\ufffdb"}]
