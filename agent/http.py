"""JSON over HTTP to the control plane, with the standard library only."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


class ControlPlaneError(RuntimeError):
    """The control plane refused a request or could not be reached; the message says why."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status of a refusal; None when unreachable

    @property
    def unreachable(self) -> bool:
        return self.status is None


def request_json(
    method: str, url: str, body: dict | None = None, *, authorization: str = "", timeout_s: float = 30
) -> dict:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Accept": "application/json"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    if authorization:
        headers["Authorization"] = authorization
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raise ControlPlaneError(f"{method} {url}: {exc.code} {_reason(exc)}", status=exc.code) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ControlPlaneError(f"cannot reach the control plane at {url}: {reason}") from None


def _reason(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        return exc.reason
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return json.dumps(body)[:300]
