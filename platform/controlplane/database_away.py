"""The database away (PostgreSQL restarting): a request is answered 503 with ``Retry-After``, not 500;
work in flight waits for it (``waiting_for_the_database``).

While PostgreSQL restarts (connection refused, "the database system is shutting down", "... is
starting up", a session ended by its fast shutdown), every query raises Django's
``OperationalError`` or ``InterfaceError``. Unhandled, that is a server error, which an API client
takes for a bug; under load with PostgreSQL restarted, one ``GET /api/nodes`` got a 500
(``benchmarks/results/load-production-run9.json``). It is a moment's unavailability, which HTTP says
with 503 and when to ask again: the OpenAI client and the agent's HTTP calls retry it. A view's
error is answered by the middleware; one raised elsewhere in Django's handling (another middleware,
a response rendered after the view) reaches the project's ``handler500``, ``server_error``, which
answers the same (Django's debug page answers it instead when ``DEBUG`` is on). Django closes the
broken connection at the request's end, so the next request connects afresh.

Work already under way (a chat answer's writer, a generation about to start) has no client to ask
again: it tries its query again while the database is away, up to ``DATABASE_WAIT_S`` (a restart
takes seconds: 4.5 s under load in that run), rather than failing the answer. A chat message, which
must not be stored twice, waits until the database takes a connection (``once_connected``):
under load with PostgreSQL restarted, 4 messages sent in its second away were refused
(``benchmarks/results/load-restarts-jobs-5.json``, counted lost then) where a wait answers them.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from channels.db import database_sync_to_async
from django.db import InterfaceError, OperationalError, close_old_connections, connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import defaults

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_AFTER_S = 2
DATABASE_WAIT_S = 30.0
AWAY = (OperationalError, InterfaceError)  # what a query raises while the database is away
MESSAGE = "the database cannot be reached right now (is it restarting?): try again shortly"
API_PREFIXES = ("/api/", "/v1/")


class DatabaseAwayMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not isinstance(exception, AWAY):
            return None
        return _away(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """The project's ``handler500``: the database away, raised outside a view (a middleware, a
    response's rendering), is the same 503; any other error is Django's own 500 page."""
    exception = sys.exception()
    if isinstance(exception, AWAY):
        return _away(request, exception)
    return defaults.server_error(request)


def _away(request: HttpRequest, exception: Exception) -> HttpResponse:
    """The 503 that says the database is away, in the shape of the API the path belongs to."""
    log.warning("%s %s: the database is away (%s)", request.method, request.path, exception)
    if request.path.startswith("/v1/"):  # the OpenAI API's error shape
        body = {"error": {"message": MESSAGE, "type": "database_unavailable", "param": None, "code": None}}
        response: HttpResponse = JsonResponse(body, status=503)
    elif request.path.startswith(API_PREFIXES):
        response = JsonResponse({"detail": MESSAGE}, status=503)
    else:
        response = HttpResponse(MESSAGE, status=503, content_type="text/plain; charset=utf-8")
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response


async def waiting_for_the_database(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call(*args, **kwargs)`` on the database (in a thread), tried again while the database is away,
    for up to ``DATABASE_WAIT_S``; then its error is raised. ``call`` must be safe to try twice (a try
    whose reply was lost may have been done)."""
    in_thread = database_sync_to_async(call, thread_sensitive=False)  # closes a broken connection first
    for pause in _pauses():
        try:
            return await in_thread(*args, **kwargs)
        except AWAY as exc:
            log.warning("%s: the database is away (%s); trying again", getattr(call, "__name__", call), exc)
        await asyncio.sleep(pause)
    return await in_thread(*args, **kwargs)  # the last try: its error is raised


async def once_connected(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call(*args, **kwargs)`` on the database (on the thread Django's synchronous work shares), run
    once the database takes a connection: while connecting fails, nothing of ``call`` has run, and it
    is tried again for up to ``DATABASE_WAIT_S``; an error of ``call``'s own queries is raised, never
    tried again. For work that must not run twice (a chat message, stored once: a try whose reply was
    lost may have stored it). No query is added: ``call`` connects first either way."""
    in_thread = database_sync_to_async(_connected_then)  # closes a broken connection first
    for pause in _pauses():
        try:
            return await in_thread(call, args, kwargs)
        except _NotConnected as exc:
            log.warning("%s: the database is away (%s); trying again", getattr(call, "__name__", call), exc.__cause__)
        await asyncio.sleep(pause)
    try:
        return await in_thread(call, args, kwargs)  # the last try
    except _NotConnected as exc:
        raise exc.__cause__ from None  # the database's own error


class _NotConnected(Exception):
    """The database took no connection: nothing of the work ran (its error is the ``__cause__``)."""


def _connected_then(call: Callable[..., T], args: tuple, kwargs: dict) -> T:
    try:
        connection.ensure_connection()
    except AWAY as exc:
        raise _NotConnected from exc
    return call(*args, **kwargs)


def waited_for_the_database(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``waiting_for_the_database`` for synchronous work (a Celery task): the thread's broken connection
    is closed between tries (Django's ``close_old_connections``), so the next try opens another."""
    for pause in _pauses():
        try:
            return call(*args, **kwargs)
        except AWAY as exc:
            log.warning("%s: the database is away (%s); trying again", getattr(call, "__name__", call), exc)
        close_old_connections()
        time.sleep(pause)
    close_old_connections()
    return call(*args, **kwargs)  # the last try: its error is raised


def _pauses() -> Iterator[float]:
    """The pauses between tries while the database is away: 0.2 s, doubling up to 2 s, as long as the
    next try comes within ``DATABASE_WAIT_S`` of the first."""
    deadline, pause = time.monotonic() + DATABASE_WAIT_S, 0.2
    while time.monotonic() + pause <= deadline:
        yield pause
        pause = min(pause * 2, 2.0)
