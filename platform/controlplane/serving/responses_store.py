"""The Responses API's stored answers: kept per user for ``previous_response_id``, bounded and expiring.

A response asked to be stored (``store``, true unless the request says false, as OpenAI's API
does) keeps its conversation: the earlier response's items it continued, its own input items and
its output items. A later request of the same user names it with ``previous_response_id`` and
continues that conversation; no other user can (an id of another user's is not found, whether or
not it exists). A user keeps at most ``MAX_PER_USER`` of them, the oldest dropped first, each for
``KEEP_FOR``; what one holds is bounded by the request bounds the conversation passed.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from controlplane.storable import storable_json

from .models import StoredResponse

MAX_PER_USER = 100
KEEP_FOR = timedelta(days=30)  # as OpenAI keeps a stored response


def earlier_items(user_id: int, response_id: str) -> list[dict] | None:
    """The conversation a stored response of ``user_id`` holds; None where it has none by that id
    (never stored, another user's, or expired)."""
    found = StoredResponse.objects.filter(
        response_id=response_id, owner_id=user_id, expires_at__gt=timezone.now()
    ).first()
    return None if found is None else list(found.items)


def keep(user_id: int, response_id: str, items: list[dict]) -> None:
    """Store a response's conversation for its user, dropping what expired and what is past the bound."""
    now = timezone.now()
    with transaction.atomic():
        # A sampled answer may hold a NUL (a byte-level tokenizer has a token for byte 0), which
        # PostgreSQL's jsonb refuses: kept as U+FFFD, as every generated text is (``storable``).
        items = storable_json(items)
        StoredResponse.objects.create(response_id=response_id, owner_id=user_id, items=items, expires_at=now + KEEP_FOR)
        StoredResponse.objects.filter(expires_at__lte=now).delete()  # anyone's: expired is gone
        mine = StoredResponse.objects.filter(owner_id=user_id)
        past = list(mine.order_by("-created_at", "-response_id").values_list("pk", flat=True)[MAX_PER_USER:])
        if past:
            StoredResponse.objects.filter(pk__in=past).delete()
