"""Main's expert requests as a worker reads them: their checks, their units of work, their timing.

Pure functions of a request and the worker's shape; nothing is loaded or computed here.
"""

from __future__ import annotations

import math

from inference.wire.runtime import ExpertRequest


def received_ms(ready_at: float, answered_at: float, now: float) -> float:
    """A request's time at this worker before its handling (ms, ``time.monotonic()`` seconds in):
    from when it was there (``ready_at``, `Received`) or, if later, when the worker sent its
    previous answer, to ``now``. The previous request's handling is in that answer's
    ``handled_ms``; counting it here again would count it twice in main's hops. 0 without a time."""
    if not ready_at:
        return 0.0
    return max(0.0, now - max(ready_at, answered_at)) * 1000


def malformed(msg: ExpertRequest, store_keys: frozenset[tuple[int, int]], hidden: int) -> str:
    """What is wrong with ``msg``, or "": checked before anything is loaded or computed."""
    n = len(msg.experts)
    if len(msg.counts) != n or len(msg.offsets) != n:
        return "experts, counts and offsets differ in length"
    missing = [e for e in msg.experts if (msg.layer, e) not in store_keys]
    if missing:
        return f"experts {missing} of layer {msg.layer} are not this worker's"
    if any(c < 1 for c in msg.counts) or any(o < 0 for o in msg.offsets):
        return "counts must be positive and offsets non-negative"
    if not math.isfinite(msg.previous_step_s) or msg.previous_step_s < 0:
        return f"the previous step's time is {msg.previous_step_s}, not a finite number of seconds"
    rows = sum(msg.counts)
    if n and (msg.rows is None or msg.weights is None):
        return "rows or weights are missing"
    if n and (msg.rows.dim() != 2 or msg.rows.shape[0] != rows or msg.rows.shape[1] != hidden):
        return f"rows are {tuple(msg.rows.shape)}, expected ({rows}, {hidden})"
    if n and tuple(msg.weights.shape) != (rows,):
        return f"weights are {tuple(msg.weights.shape)}, expected ({rows},)"
    return ""


def units_of(msg: ExpertRequest, batch_arithmetic: str) -> list[tuple[int, int]]:
    """(expert, rows) computed in one go: each segment (exact), or under ``fused`` batch
    arithmetic the consecutive segments of one expert (every sequence's rows) together."""
    segments = list(zip(msg.experts, msg.counts, strict=True))
    if batch_arithmetic != "fused":
        return segments
    units: list[tuple[int, int]] = []
    for expert, count in segments:
        if units and units[-1][0] == expert:
            units[-1] = (expert, units[-1][1] + count)
        else:
            units.append((expert, count))
    return units


def spans_of(units: list[tuple[int, int]]) -> list[slice]:
    """Each unit's rows of the request, in order."""
    spans = []
    start = 0
    for _, count in units:
        spans.append(slice(start, start + count))
        start += count
    return spans


def last_use(units: list[tuple[int, int]], i: int) -> bool:
    """Whether unit ``i`` is its expert's last in the request."""
    expert = units[i][0]
    return all(e != expert for e, _ in units[i + 1 :])
