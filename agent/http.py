"""JSON over HTTP to the control plane, with the standard library only, through the server's trust (``agent.tls``)."""

from __future__ import annotations

import contextlib
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

from agent.tls import ServerTrust, TrustError


class ControlPlaneError(RuntimeError):
    """The control plane refused a request or could not be reached; the message says why."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status of a refusal; None when unreachable

    @property
    def unreachable(self) -> bool:
        return self.status is None


def request_json(
    method: str,
    url: str,
    body: dict | None = None,
    *,
    authorization: str = "",
    timeout_s: float = 30,
    trust: ServerTrust | None = None,
) -> dict:
    """``trust``: how the server is trusted (default: the system's certificate authorities for https)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Accept": "application/json"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    if authorization:
        headers["Authorization"] = authorization
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    with control_plane_errors(method, url), (trust or ServerTrust(url)).open(req, timeout_s=timeout_s) as response:
        return json.loads(response.read() or b"{}")


@contextlib.contextmanager
def control_plane_errors(
    method: str, url: str, unreachable: Callable[[str, BaseException], str] | None = None
) -> Iterator[None]:
    """A request's failures as ``ControlPlaneError``: a refusal with its status and the server's
    reason, a certificate the box does not trust, or the server out of reach (``unreachable``
    says so for a person; ``unreachable_message`` unless given)."""
    try:
        yield
    except urllib.error.HTTPError as exc:
        raise ControlPlaneError(f"{method} {url}: {exc.code} {_reason(exc)}", status=exc.code) from None
    except TrustError as exc:
        raise ControlPlaneError(str(exc)) from None
    except (urllib.error.URLError, OSError) as exc:
        raise ControlPlaneError((unreachable or unreachable_message)(url, exc)) from None


def unreachable_message(url: str, exc: BaseException) -> str:
    """Why ``url`` could not be used, for a person: a certificate this box does not trust says so."""
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, ssl.SSLCertVerificationError):
        return (
            f"{url}: the server's certificate is not trusted ({reason.verify_message}); a self-signed "
            "control plane is trusted by its pin: enroll with a join token from its console, or pass --pin"
        )
    return f"cannot reach the control plane at {url}: {reason}"


def _reason(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        return exc.reason
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return json.dumps(body)[:300]
