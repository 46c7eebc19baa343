"""What a node's agent reports about its roles, as the control plane keeps it, and the writes its
link holds until the database has them.

An agent's link is its node credential's to write with: a buggy or hostile agent can send
role reports with fields nobody reads, figures of any size, and frames as fast as the socket
takes them. ``clean_role_report`` keeps a report's known fields only, each within its size
(``metrics`` and ``memory`` by the names the runtime reports, ``inference.wire.link.RUNTIME_METRICS``
and ``MEMORY_FIGURES``), before anything of it is queued or stored. ``PendingWrites`` holds
what the link is to write: one write per kind (a node's roles report, one role's state, one
task's progress), the latest replacing an older one of its kind not written yet, so however
fast frames come the queue holds at most ``MAX_PENDING`` writes and the database gets at most
one write per kind for each it has finished.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from inference.wire.link import MEMORY_FIGURES, RUNTIME_METRICS

MAX_DETAIL_CHARS = 4000  # a role's or a task's reason, as the console shows it
MAX_FIGURE_BYTES = 8192  # one figure as JSON: recall per layer of a 94-layer model is about 2 KB
MAX_ROLE_REPORTS = 64  # roles one heartbeat reports: one per GPU of a box, and then some
MAX_NAME_CHARS = 100  # a deployment's runtime key or a role's name (worker-N)
MAX_PENDING = 256  # writes one link holds (distinct kinds: roles, tasks); past it new kinds are dropped
MAX_FIGURE = 2**63 - 1  # memory figures land in 64-bit integers


def _text(value: Any, limit: int) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _small(value: Any) -> bool:
    try:
        return len(json.dumps(value)) <= MAX_FIGURE_BYTES
    except (TypeError, ValueError, RecursionError):
        return False


def clean_metrics(metrics: Any) -> dict:
    """The runtime's figures of a report (``RUNTIME_METRICS``), each at most ``MAX_FIGURE_BYTES`` as JSON."""
    if not isinstance(metrics, dict):
        return {}
    return {name: metrics[name] for name in RUNTIME_METRICS if name in metrics and _small(metrics[name])}


def clean_memory(memory: Any) -> dict[str, int]:
    """The memory figures of a report (``MEMORY_FIGURES``): byte counts a 64-bit column holds."""
    if not isinstance(memory, dict):
        return {}
    return {
        name: value for name in MEMORY_FIGURES if type(value := memory.get(name)) is int and 0 <= value <= MAX_FIGURE
    }


def clean_role_report(report: Any) -> dict | None:
    """A ``RoleState`` as JSON (from the event or a heartbeat's list) with only its known fields,
    each within its size; None for what is not a report at all. A report without ``metrics``
    keeps none, so the role's last figures stay as they were."""
    if not isinstance(report, dict):
        return None
    cleaned = {
        "deployment": _text(report.get("deployment"), MAX_NAME_CHARS),
        "role": _text(report.get("role"), MAX_NAME_CHARS),
        "role_name": _text(report.get("role_name"), MAX_NAME_CHARS),
        "state": _text(report.get("state"), MAX_NAME_CHARS),
        "detail": _text(report.get("detail"), MAX_DETAIL_CHARS),
        "memory": clean_memory(report.get("memory")),
    }
    if isinstance(report.get("metrics"), dict):
        cleaned["metrics"] = clean_metrics(report["metrics"])
    return cleaned


def clean_role_reports(reports: Any) -> list[dict]:
    """A heartbeat's list of role reports, cleaned, at most ``MAX_ROLE_REPORTS`` of them."""
    if not isinstance(reports, list):
        return []
    cleaned = (clean_role_report(report) for report in reports[:MAX_ROLE_REPORTS])
    return [report for report in cleaned if report is not None]


class PendingWrites:
    """Writes waiting for the database, oldest first, one per key: a newer write of a key replaces
    the one waiting (and takes its turn after the others); a new key past ``limit`` is dropped."""

    def __init__(self, limit: int = MAX_PENDING) -> None:
        self.limit = limit
        self._writes: OrderedDict[tuple, tuple[Callable, dict]] = OrderedDict()
        self.dropped = 0

    def put(self, key: tuple, write: Callable, kwargs: dict) -> bool:
        """Queue ``write(**kwargs)`` under ``key``; False when it was dropped (the queue is full)."""
        if key in self._writes:
            del self._writes[key]
        elif len(self._writes) >= self.limit:
            self.dropped += 1
            return False
        self._writes[key] = (write, kwargs)
        return True

    def take(self) -> tuple[Callable, dict]:
        """The oldest write, out of the queue."""
        _, write = self._writes.popitem(last=False)
        return write

    def __len__(self) -> int:
        return len(self._writes)
