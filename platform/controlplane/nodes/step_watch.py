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

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import BaseCache
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

log = logging.getLogger(__name__)

WATCH_KEY = "console:watching-steps"
WATCH_TTL_S = 5  # a console marks every second (console.consumers.EVERY_S); this outlives a slow one
SHARED_CACHE = "shared"

_cache: BaseCache | None = None
_unmarked = False  # the last mark failed: said once, not every second of every open console


def _shared() -> BaseCache:
    """One client of the shared cache for the whole process (Redis' connection pool is
    thread-safe), made as ``caches`` makes one from the settings as they are now. ``caches[...]``
    keeps one per thread and per asyncio task, so each generation would open a Redis
    connection of its own."""
    global _cache
    if _cache is None:
        params = dict(settings.CACHES[SHARED_CACHE])
        backend = import_string(params.pop("BACKEND"))
        _cache = backend(params.pop("LOCATION", ""), params)
    return _cache


@receiver(setting_changed)
def _settings_changed(*, setting: str, **kwargs) -> None:
    global _cache
    if setting == "CACHES":
        _cache = None  # moved (a test, or `up` to its own Redis): the next call opens a client there


async def mark_watched() -> None:
    """A console watches now (called by each open console, every second)."""
    global _unmarked
    try:
        # Off the one thread that runs the consumers' synchronous calls (the cache's own aset
        # would queue there): a slow Redis must not hold up every console and agent link.
        await sync_to_async(_shared().set, thread_sensitive=False)(WATCH_KEY, True, timeout=WATCH_TTL_S)
        _unmarked = False
    except Exception as exc:  # Redis down: the console's view still refreshes; steps wait for it
        if not _unmarked:
            log.warning("could not mark the console's step view open (%s): no step reports until Redis answers", exc)
        _unmarked = True


async def watched() -> bool:
    """Whether a console marked its step view open within the last ``WATCH_TTL_S`` seconds."""
    try:
        return bool(await sync_to_async(_shared().get, thread_sensitive=False)(WATCH_KEY, False))
    except Exception as exc:
        log.debug("could not read whether a console watches (%s): no step reports", exc)
        return False
