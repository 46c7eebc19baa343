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
from rest_framework.throttling import AnonRateThrottle, UserRateThrottle

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


class TooManyGenerations(Exception):
    """The user already runs the most generations one user may run at once."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"at most {limit} generations at once per user; wait for one to finish")
        self.limit = limit


def _take(key: str, limit: int) -> bool:
    cache.add(key, 0, SLOT_TTL_S)
    if cache.incr(key) <= limit:
        return True
    cache.decr(key)
    return False


def _give_back(key: str) -> None:
    with contextlib.suppress(ValueError):  # expired meanwhile: nothing to give back
        if cache.decr(key) < 0:  # expired and counted afresh since: never below zero
            cache.set(key, 0, SLOT_TTL_S)


class GenerationSlot:
    """One of a user's concurrent generations, held from ``take`` until ``release`` (idempotent)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.held = True

    @classmethod
    async def take(cls, user_id: object) -> GenerationSlot:
        """A free slot of the user's, or ``TooManyGenerations``."""
        limit = settings.MAX_GENERATIONS_PER_USER
        key = f"generation-slots:{user_id}"
        if not await sync_to_async(_take)(key, limit):
            raise TooManyGenerations(limit)
        return cls(key)

    async def release(self) -> None:
        if self.held:
            self.held = False
            await sync_to_async(_give_back)(self.key)


@contextlib.asynccontextmanager
async def generation_slot(user_id: object) -> AsyncIterator[None]:
    """Hold one of the user's concurrent generations for the block; ``TooManyGenerations`` if none is free."""
    slot = await GenerationSlot.take(user_id)
    try:
        yield
    finally:
        await slot.release()
