"""A request that meets the database away is answered 503 with ``Retry-After``, not 500.

While PostgreSQL restarts (connection refused, "the database system is shutting down", "... is
starting up", a session ended by its fast shutdown), every query raises Django's
``OperationalError`` or ``InterfaceError``. Unhandled, that is a server error, which an API client
takes for a bug; under load with PostgreSQL restarted, one ``GET /api/nodes`` got a 500
(``benchmarks/results/load-production-run9.json``). It is a moment's unavailability, which HTTP says
with 503 and when to ask again: the OpenAI client and the agent's HTTP calls retry it. Django
closes the broken connection at the request's end, so the next request connects afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2
MESSAGE = "the database cannot be reached right now (is it restarting?): try again shortly"
API_PREFIXES = ("/api/", "/v1/")


class DatabaseAwayMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not isinstance(exception, OperationalError | InterfaceError):
            return None
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
