"""What a job output keeps of a generation: a bounded summary of its metrics, and the bytes it stores.

A generation's metrics hold the runtime's summary figures (TTFT, token rates, recall, expert
loads, medians of a decode layer's parts, one entry per worker or layer at most) and the
per-step record (``per_step``: every step's layers, experts and times), which grows with the
answer: about 450 bytes a layer a token, up to the agent's 4 MiB (``agent.generations``). Kept for
every output, a Mixtral-size job of 100 prompts stored some 400 MB and its detail answered as
much JSON. An output keeps the summary only, held to ``MAX_OUTPUT_METRICS_BYTES``; the
per-step record is for benchmarks and the runtime's own client (``python -m inference``).

Why 16 KiB: a Mixtral-8x7B summary (32 layers, 8 workers, a shadow) is about 2.5 KB; 16 KiB
leaves room for models of four times the layers and workers, and 100 outputs' summaries take at
most 1.6 MiB. A summary past it (a figure per layer of a very deep model, a long log of alignment
changes) loses its largest figures first, whose names ``omitted_metrics`` lists.

Why this way: pure functions of the values, used where an output is written (``jobs``), so the
stored bound holds whatever a runtime sends.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

MAX_OUTPUT_METRICS_BYTES = 16 * 2**10
PER_STEP_KEYS = ("per_step", "per_step_omitted")  # the per-step record, and the agent's count of steps it cut
OMITTED = "omitted_metrics"


def json_bytes(value: Any) -> int:
    """How many bytes ``value`` takes as compact JSON text (ASCII: every byte a character)."""
    return len(json.dumps(value, separators=(",", ":")))


def metrics_summary(metrics: Any, max_bytes: int = MAX_OUTPUT_METRICS_BYTES) -> dict:
    """``metrics`` without the per-step record, at most ``max_bytes`` as JSON: past it, its largest
    figures are left out (the rest kept whole) and named, sorted, under ``omitted_metrics``
    (``["*"]`` when even their names would not fit)."""
    if not isinstance(metrics, Mapping):
        return {}
    summary = {key: value for key, value in metrics.items() if key not in PER_STEP_KEYS}
    total = json_bytes(summary)
    if total <= max_bytes:
        return summary
    # Each figure's share of the JSON (its key, value and a comma), measured once: a runtime's
    # metrics may hold many figures, and measuring the whole again per one left out is quadratic.
    sizes = {key: json_bytes({key: value}) - 1 for key, value in summary.items()}
    names = json_bytes({OMITTED: []}) - 1
    omitted: list[str] = []
    for key in sorted(sizes, key=sizes.__getitem__, reverse=True):
        omitted.append(key)
        total -= sizes[key]
        names += json_bytes(key) + 1
        if total + names <= max_bytes:
            break
        if names > max_bytes:
            return {OMITTED: ["*"]}
    left_out = set(omitted)
    bounded = {key: value for key, value in summary.items() if key not in left_out}
    bounded[OMITTED] = sorted(omitted)
    return bounded if json_bytes(bounded) <= max_bytes else {OMITTED: ["*"]}


def stored_bytes(*, prompt: str, text: str = "", token_ids: Any = (), metrics: Any = None) -> int:
    """The bytes an output stores for its user's quota: its prompt and text (UTF-8), its token ids
    and its metrics (JSON)."""
    return (
        len(prompt.encode(errors="replace"))
        + len(text.encode(errors="replace"))
        + (json_bytes(list(token_ids)) if token_ids else 0)
        + (json_bytes(metrics) if metrics else 0)
    )
