"""Request rates: DRF throttles per user and per address, and a cap on one user's generations at once.

``UserThrottle`` counts an authenticated user's API calls (an API key or a session),
``AnonThrottle`` anonymous ones by address; agents authenticate as nodes (their shard
downloads and enrollment come in bursts) and are counted by neither. ``generation_slot``
holds one of a user's ``MAX_GENERATIONS_PER_USER`` concurrent generations for the OpenAI API
and the chat; a request past the cap is refused (429) rather than queued behind the others.
Counts live in Django's cache: per process by default, in Redis in production.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest
from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.throttling import AnonRateThrottle, SimpleRateThrottle, UserRateThrottle

SLOT_TTL_S = 3600  # a slot a dead process never gave back expires after this long


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


class TooManyGenerations(Exception):
    """The user already runs the most generations one user may run at once."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"at most {limit} generations at once per user; wait for one to finish")
        self.limit = limit


def _take(key: str, limit: int, count: int) -> bool:
    cache.add(key, 0, SLOT_TTL_S)
    if cache.incr(key, count) <= limit:
        return True
    cache.decr(key, count)
    return False


def _give_back(key: str, count: int) -> None:
    with contextlib.suppress(ValueError):  # expired meanwhile: nothing to give back
        if cache.decr(key, count) < 0:  # expired and counted afresh since: never below zero
            cache.set(key, 0, SLOT_TTL_S)


class GenerationSlot:
    """``count`` of a user's concurrent generations (a response with several choices holds one per
    choice), held from ``take`` until ``release`` (idempotent)."""

    def __init__(self, key: str, count: int = 1) -> None:
        self.key = key
        self.count = count
        self.held = True

    @classmethod
    async def take(cls, user_id: object, *, count: int = 1) -> GenerationSlot:
        """``count`` free slots of the user's, all or none, or ``TooManyGenerations``."""
        limit = settings.MAX_GENERATIONS_PER_USER
        key = f"generation-slots:{user_id}"
        if not await sync_to_async(_take)(key, limit, count):
            raise TooManyGenerations(limit)
        return cls(key, count)

    async def release(self) -> None:
        if self.held:
            self.held = False
            await sync_to_async(_give_back)(self.key, self.count)


@contextlib.asynccontextmanager
async def generation_slot(user_id: object) -> AsyncIterator[None]:
    """Hold one of the user's concurrent generations for the block; ``TooManyGenerations`` if none is free."""
    slot = await GenerationSlot.take(user_id)
    try:
        yield
    finally:
        await slot.release()
