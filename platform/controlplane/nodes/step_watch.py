"""Whether a console watches the cluster's generation steps, so that main reports them.

Main can send each token with its step's report (``Token.step``: the layers, the experts
routed and predicted, where the time went), and only the console's live view reads it past
main's agent link (``cluster.step``). A report is most of a token's bytes, and every hop pays
for it: main builds it, the agent encodes it, the web process decodes it and hands it to
Redis. So a generation asks for reports (``Generate.step_reports``) only while a console
watches: each open console marks it every second from its refresh loop
(``console.consumers``), the mark lasting ``WATCH_TTL_S``, and ``deployments.generation.astream``
reads it as the generation goes out. A console opened mid-generation shows the steps of the
generations that start after it opened.

The mark is in Redis (the ``shared`` cache), so that consoles and generations in any web
process or Celery worker see the same one. Where Redis cannot be read, no reports are asked
for: the generation itself does not depend on them.
"""

from __future__ import annotations

import logging

from django.core.cache import BaseCache, caches
from django.core.signals import setting_changed
from django.dispatch import receiver

log = logging.getLogger(__name__)

WATCH_KEY = "console:watching-steps"
WATCH_TTL_S = 5  # a console marks every second (console.consumers.EVERY_S); this outlives a slow one
SHARED_CACHE = "shared"

_cache: BaseCache | None = None


def _shared() -> BaseCache:
    """One client of the shared cache for the whole process (Redis' connection pool is
    thread-safe). ``caches[...]`` keeps one per thread and per asyncio task, so each generation
    would open a Redis connection of its own."""
    global _cache
    if _cache is None:
        _cache = caches.create_connection(SHARED_CACHE)
    return _cache


@receiver(setting_changed)
def _settings_changed(*, setting: str, **kwargs) -> None:
    global _cache
    if setting == "CACHES":
        _cache = None  # a test moved the shared cache: the next call opens a client to where it is now


async def mark_watched() -> None:
    """A console watches now (called by each open console, every second)."""
    try:
        await _shared().aset(WATCH_KEY, True, timeout=WATCH_TTL_S)
    except Exception as exc:  # Redis down: the console's view still refreshes; steps wait for it
        log.warning("could not mark the console's step view as open (%s)", exc)


async def watched() -> bool:
    """Whether a console marked its step view open within the last ``WATCH_TTL_S`` seconds."""
    try:
        return bool(await _shared().aget(WATCH_KEY, False))
    except Exception as exc:
        log.debug("could not read whether a console watches (%s): no step reports", exc)
        return False
