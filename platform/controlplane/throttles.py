"""Request rates: DRF throttles per user and per address, for the REST API, the OpenAI API and the chat.

``UserThrottle`` counts an authenticated user's API calls (an API key or a session),
``AnonThrottle`` anonymous ones by address; agents authenticate as nodes (their shard
downloads and enrollment come in bursts) and are counted by neither. ``throttle_wait`` runs
the same throttles for the OpenAI API's views, which are not DRF's, so a user's calls to both
share one count; ``ChatMessageThrottle`` counts a user's chat messages. Counts live in
Django's cache: per process by default, in Redis in production. How many generations a user
has at once is no rate: main bounds it where they run (``inference.runtime.batching.admission``).
"""

from __future__ import annotations

from django.http import HttpRequest
from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.throttling import AnonRateThrottle, SimpleRateThrottle, UserRateThrottle


def _is_node(request) -> bool:
    from controlplane.nodes.models import Node

    return isinstance(getattr(request, "auth", None), Node)


class UserThrottle(UserRateThrottle):
    def allow_request(self, request, view) -> bool:
        return _is_node(request) or super().allow_request(request, view)


class AnonThrottle(AnonRateThrottle):
    def allow_request(self, request, view) -> bool:
        return _is_node(request) or super().allow_request(request, view)


class ChatMessageThrottle(SimpleRateThrottle):
    """Messages one user sends the chat (``DEFAULT_THROTTLE_RATES["chat"]``): DRF's counting,
    keyed by the user, for a websocket message that has no HTTP request (``allow_request(user, None)``)."""

    scope = "chat"

    def get_cache_key(self, request, view) -> str:  # ``request`` is the user
        return self.cache_format % {"scope": self.scope, "ident": request.pk}


def chat_message_wait(user) -> float | None:
    """None when ``user`` may send the chat another message now, else the seconds until they may."""
    throttle = ChatMessageThrottle()
    return None if throttle.allow_request(user, None) else (throttle.wait() or 0.0)


def throttle_wait(request: HttpRequest, user, auth=None) -> float | None:
    """The REST API's throttles (``DEFAULT_THROTTLE_CLASSES``: the same rates, the same counts) for
    a call that ``user`` makes outside DRF (the OpenAI API) with ``auth`` (its API key, or None):
    None when it is allowed, else the seconds to wait before the next one is."""
    call = Request(request)
    call.user, call.auth = user, auth  # both: a request without them would authenticate itself
    waits = []
    for throttle_class in api_settings.DEFAULT_THROTTLE_CLASSES:
        throttle = throttle_class()
        if not throttle.allow_request(call, None):
            waits.append(throttle.wait())
    if not waits:
        return None
    return max((wait for wait in waits if wait is not None), default=0.0)
