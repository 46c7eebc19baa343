"""The edge of the control plane: a cap on request bodies and websocket frames, before any view.

``BodyLimit`` wraps the whole ASGI application (``config/asgi.py``). Django's ASGI handler
reads a request's whole body into a spooled file before it resolves the URL, so without a
cap in front of it an anonymous client could make the server read hundreds of megabytes
for a URL that does not exist. Here a request whose ``Content-Length`` is past the cap is
answered 413 at once, its body never read; a body without one (chunked) is counted as it
arrives and refused the moment it passes the cap, the rest left unread (the 413 closes the
connection). Nothing of Django runs for a refused request. A websocket frame past the cap
closes the socket with 1009 (message too big) before a consumer sees it; ``manage.py up``
also tells uvicorn the cap (``--ws-max-size``), so such a frame is not even buffered.

The 413 speaks the caller's dialect: OpenAI's error shape under ``/v1``, DRF's
``{"detail": ...}`` elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

CLOSE_TOO_BIG = 1009  # RFC 6455: a message too big to process


def declared_length(scope: Scope) -> int | None:
    """The request's ``Content-Length`` as a number, or None when it has none (or one that is not a number)."""
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-length":
            text = value.strip()
            return int(text) if text.isdigit() and len(text) <= 20 else None
    return None


def too_large_body(path: str, limit: int) -> dict:
    """The body of the 413: OpenAI's error shape under ``/v1``, ``{"detail"}`` elsewhere."""
    message = f"the request body is larger than {limit} bytes, the most this server takes"
    if path == "/v1" or path.startswith("/v1/"):
        return {
            "error": {"message": message, "type": "invalid_request_error", "param": None, "code": "request_too_large"}
        }
    return {"detail": message}


def frame_too_big(message: Message, limit: int) -> bool:
    """Whether a websocket frame holds more than ``limit`` bytes (text as UTF-8, encoded only
    when its characters alone do not decide it: a character takes 1 to 4 bytes)."""
    if message.get("bytes") is not None:
        return len(message["bytes"]) > limit
    text = message.get("text") or ""
    if len(text) > limit or 4 * len(text) <= limit:
        return len(text) > limit
    return len(text.encode(errors="surrogatepass")) > limit


class BodyLimit:
    """ASGI middleware: at most ``max_bytes`` of request body per HTTP request, and per websocket frame."""

    def __init__(self, app: App, *, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"the request body cap must be at least 1 byte, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = declared_length(scope)
        if length is not None and length > self.max_bytes:
            await self._refuse(scope, send)  # before a byte of the body is read
            return
        received = 0
        refused = False
        started = False

        async def counted() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # The app hears that the client went away (Django stops reading and answers
                    # nothing); the 413 is sent below.
                    refused = True
                    return {"type": "http.disconnect"}
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, counted, watched)
        if refused and not started:
            await self._refuse(scope, send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        body = json.dumps(too_large_body(scope.get("path", ""), self.max_bytes)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            # What is left of the body is not read: the connection cannot carry another request.
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        closed = False

        async def capped() -> Message:
            nonlocal closed
            if closed:
                return {"type": "websocket.disconnect", "code": CLOSE_TOO_BIG}
            message = await receive()
            if message["type"] == "websocket.receive" and frame_too_big(message, self.max_bytes):
                closed = True
                await send({"type": "websocket.close", "code": CLOSE_TOO_BIG})
                return {"type": "websocket.disconnect", "code": CLOSE_TOO_BIG}
            return message

        async def guarded(message: Message) -> None:
            if not closed:  # the socket is closed: what the app still sends goes nowhere
                await send(message)

        await self.app(scope, capped, guarded)
