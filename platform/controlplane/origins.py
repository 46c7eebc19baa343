"""Browser websockets (the chat, the console) only from a page of this very site: scheme, host and port.

A browser sends its session cookie with a websocket handshake to this site whatever page opened
it, so a page elsewhere could otherwise chat or watch the console as the logged-in user. The
handshake's ``Origin`` must be the site the request itself reached: its scheme (``https`` when the
connection or the TLS proxy says so, as Django's ``request.is_secure``), and its host and port
(``Host``, checked against ``ALLOWED_HOSTS``, as Django's ``request.get_host``), or one of
``CSRF_TRUSTED_ORIGINS`` (``https://*.example.com`` for every subdomain). That is the check Django's
CSRF middleware makes of a form's ``Origin``.

Why not Channels' ``AllowedHostsOriginValidator``: it compares the origin's host name with
``ALLOWED_HOSTS`` and nothing else, so ``http://127.0.0.1:9999`` (anything else a user runs on
that machine) was taken by a server on port 8000, and an ``http`` page by an ``https`` site.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest
from django.utils.http import is_same_domain

DEFAULT_PORTS = {"http": 80, "https": 443}


def _site(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin such as ``https://example.com:8443``; None for anything else."""
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.path or parts.query or parts.fragment:
        return None
    return parts.scheme, parts.hostname, port if port is not None else DEFAULT_PORTS[parts.scheme]


def same_origin(origin: str | None, *, host: str, secure: bool, trusted: Iterable[str] = ()) -> bool:
    """Whether a handshake from page ``origin`` may go on, for a request that reached ``host`` (its
    ``Host``, with its port if it names one) over https when ``secure``, given the ``trusted`` origins."""
    if not origin:
        return False
    own = _site(f"{'https' if secure else 'http'}://{host}")
    seen = _site(origin)
    if seen is None:
        return False
    if seen == own:
        return True
    for pattern in trusted:
        if "*" not in pattern:
            if seen == _site(pattern):
                return True
        else:  # https://*.example.com: that scheme, any subdomain (the netloc, port included, as Django's)
            allowed = urlsplit(pattern)
            if allowed.scheme == seen[0] and is_same_domain(
                urlsplit(origin).netloc.lower(), allowed.netloc.lstrip("*")
            ):
                return True
    return False


class Handshake(HttpRequest):
    """A websocket handshake as Django reads a request's host and scheme (``get_host``, ``is_secure``)."""

    def __init__(self, scope: dict[str, Any]) -> None:
        super().__init__()
        for name, value in scope.get("headers", []):
            key = "HTTP_" + name.decode("latin1").upper().replace("-", "_")
            self.META[key] = value.decode("latin1")
        server = scope.get("server") or ("unknown", 0)
        self.META["SERVER_NAME"], self.META["SERVER_PORT"] = str(server[0]), str(server[1])
        self._secure_scheme = scope.get("scheme") in ("wss", "https")

    def _get_scheme(self) -> str:
        return "https" if self._secure_scheme else "http"

    @property
    def origin(self) -> str | None:
        return self.META.get("HTTP_ORIGIN")


class SameOriginValidator:
    """ASGI middleware: a websocket whose ``Origin`` is not this site's (``same_origin``) is refused at
    its handshake (403), before the consumer runs."""

    def __init__(self, application) -> None:
        self.application = application

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "websocket":
            raise ValueError("SameOriginValidator guards websockets only")
        handshake = Handshake(scope)
        try:
            host = handshake.get_host()  # ALLOWED_HOSTS, and X-Forwarded-Host where it is trusted
        except DisallowedHost:
            host = None
        trusted = settings.CSRF_TRUSTED_ORIGINS
        if host is not None and same_origin(handshake.origin, host=host, secure=handshake.is_secure(), trusted=trusted):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)
