"""Request rates: DRF throttles per user and per address, for the REST API, the OpenAI API and the chat.

``UserThrottle`` counts an authenticated user's API calls (an API key or a session),
``AnonThrottle`` anonymous ones by address; agents authenticate as nodes (their shard
downloads and enrollment come in bursts) and are counted by neither. DRF checks a call's
credential and the view's permissions before its throttles, so a call refused there (a made-up
key, no credential, a permission the user lacks) was never counted: ``exception_handler``
(``REST_FRAMEWORK["EXCEPTION_HANDLER"]``, so every DRF view) counts it then, once, a refused
credential as an anonymous call by address, and answers 429 past the rate. ``throttle_wait`` runs
the same throttles for the OpenAI API's views, which are not DRF's, so a user's calls to both
share one count; ``ChatMessageThrottle`` counts a user's chat messages. Counts live in
Django's cache: per process by default, in Redis in production. A count that cannot be read
because Redis is restarting lets the call through (logged once per outage): a second without a rate
costs less than failing every call and chat message meanwhile, which is what the unread count did
(under load, a Redis restart closed 4 chat sockets mid-message: ``load-restarts-3``). How many
generations a user has at once is no rate: main bounds it where they run
(``inference.runtime.batching.admission``).
"""

from __future__ import annotations

import logging

from django.http import HttpRequest
from rest_framework import exceptions
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.throttling import AnonRateThrottle, SimpleRateThrottle, UserRateThrottle

from controlplane.shared_redis import UNREACHABLE

log = logging.getLogger(__name__)

# Set on a request once the throttles counted it, so a refusal after that is not counted again.
COUNTED = "odmoe_throttles_counted"
# What DRF raises before its throttles run: a refused or missing credential, a permission refused.
REFUSED_BEFORE_THROTTLES = (exceptions.AuthenticationFailed, exceptions.NotAuthenticated, exceptions.PermissionDenied)


def _is_node(request) -> bool:
    from controlplane.nodes.models import Node

    return isinstance(getattr(request, "auth", None), Node)


class CountedUnlessRedisIsAway:
    """A throttle whose count Redis cannot give now lets the call through (see the module)."""

    _away = False  # this process could not read a count (one log line per outage)

    def allow_request(self, request, view) -> bool:
        try:
            allowed = super().allow_request(request, view)  # type: ignore[misc]
        except UNREACHABLE as exc:
            if not CountedUnlessRedisIsAway._away:
                log.warning("request rates cannot be counted (%s): calls go through uncounted", exc)
                CountedUnlessRedisIsAway._away = True
            return True
        CountedUnlessRedisIsAway._away = False
        return allowed


class UserThrottle(CountedUnlessRedisIsAway, UserRateThrottle):
    """DRF's, for authenticated users only: DRF's would count an anonymous call by its address
    at the user rate too, so an address's anonymous calls were held to the lower of the two rates
    (1,000 simulated boxes enrolling from one address were refused at 600 a minute with the anonymous
    rate set to 100,000)."""

    def allow_request(self, request, view) -> bool:
        setattr(request, COUNTED, True)
        user = getattr(request, "user", None)
        anonymous = not (user and user.is_authenticated)
        return _is_node(request) or anonymous or super().allow_request(request, view)


class AnonThrottle(CountedUnlessRedisIsAway, AnonRateThrottle):
    def allow_request(self, request, view) -> bool:
        setattr(request, COUNTED, True)
        return _is_node(request) or super().allow_request(request, view)


def exception_handler(exc: Exception, context: dict) -> Response | None:
    """DRF's, except that a call refused before the view's throttles ran is counted now, as what it
    authenticated as (a refused credential leaves it anonymous: counted by its address), and past
    the rate answered 429 with ``Retry-After`` instead of its 401 or 403: guessing keys is then
    throttled like any other anonymous call, as on the OpenAI API (``throttle_wait``)."""
    from rest_framework import views  # not at the top: its APIView reads this module's throttles as it loads

    view, request = context.get("view"), context.get("request")
    counted = request is None or getattr(request, COUNTED, False)
    if isinstance(exc, REFUSED_BEFORE_THROTTLES) and isinstance(view, views.APIView) and not counted:
        try:
            view.check_throttles(request)  # DRF's own check: the view's throttles, their wait
        except exceptions.Throttled as throttled:
            exc = throttled
    return views.exception_handler(exc, context)


class ChatMessageThrottle(CountedUnlessRedisIsAway, SimpleRateThrottle):
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
