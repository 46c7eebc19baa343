"""Continuous batching in main: what a layer's batch hands over, and how it is packed for workers.

Main's engine (``inference.runtime.engine``) runs every sequence of the batch in one thread, step by
step; at each MoE layer each sequence hands over its routed rows (a ``LayerCall``) and the
layer is served for all of them in one round of the workers, each expert loaded once for
every row routed to it. Here: the ``LayerCall``, and how one worker's segments (one
sequence's rows of one expert) are packed into requests. Who joins and who waits is the
engine's scheduler's (``inference.runtime.engine.scheduler``: ``admission``, ``next_to_join``,
``prefill_pieces``).

Why batching never changes a token: every sequence's attention, routers, sampling and cache
are exactly what its own single-sequence run computes (same operations on the same shapes
in the same order, only interleaved with other sequences'), and each sequence's rows of an
expert are computed as a segment of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerCall:
    """One sequence's rows of an MoE layer, handed to the exchange: its experts' input."""

    layer: int
    hidden_states: torch.Tensor  # [T, H]
    top_k_index: torch.Tensor  # [T, K]
    top_k_weights: torch.Tensor  # [T, K]


@dataclass(frozen=True)
class Segment:
    """One sequence's rows of one expert at a layer: the unit a worker computes on its own.

    ``offset`` is the first row in the layer's rows of that expert (every sequence's, one
    after another); ``count`` rows follow.
    """

    expert: int
    offset: int
    count: int


def pack_segments(segments: list[Segment], chunk: int) -> list[tuple[list[Segment], bool]]:
    """The requests one worker gets for a layer: (segments, final) pairs.

    Without a chunk (decode) every segment goes in one request. With one (a prefill is in
    the layer), each expert's segments go in requests of at most ``chunk`` rows (a segment
    is never split: it is what the worker computes in one go), expert after expert, with
    ``final`` on an expert's last one so the worker frees it at once.
    """
    if not segments:
        return []
    if chunk <= 0:
        return [(segments, True)]
    requests: list[tuple[list[Segment], bool]] = []
    by_expert: dict[int, list[Segment]] = {}
    for segment in segments:
        by_expert.setdefault(segment.expert, []).append(segment)
    for expert_segments in by_expert.values():
        current: list[Segment] = []
        rows = 0
        for segment in expert_segments:
            if current and rows + segment.count > chunk:
                requests.append((current, False))
                current, rows = [], 0
            current.append(segment)
            rows += segment.count
        requests.append((current, True))
    return requests
