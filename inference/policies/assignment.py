"""Who computes which expert: pure decisions of the OD-MoE runtime, free of sockets and threads.

What each worker of a layer's group prefetches from a prediction, which worker computes each
really-routed expert (in decode and in prefill), how one expert's prefill rows are split, and how
well a prediction named the routed experts (``recall``). The role loops call these and only move
bytes; the shadow's alignment to main is ``alignment``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from inference.policies.placement import Placement


def prefetch_assignment(predicted: Sequence[int], members: Sequence[int]) -> dict[int, list[int]]:
    """Deal the predicted experts (ascending) over the group's workers, round-robin.

    Workers and main both apply this rule, so main can send a real expert to the worker
    that was told to preload it.
    """
    plan: dict[int, list[int]] = {m: [] for m in members}
    for i, expert in enumerate(sorted(set(predicted))):
        plan[members[i % len(members)]].append(expert)
    return plan


def assign_experts(
    real: Iterable[int], predicted: Sequence[int] | None, members: Sequence[int]
) -> dict[int, list[int]]:
    """Give each really-routed expert to a worker of the layer's group.

    An expert that was predicted goes to the worker that preloaded it; the rest go to the
    least-loaded workers (ties by group order), so a wrong prediction costs a load on the
    critical path but never changes which experts are computed.
    """
    plan = prefetch_assignment(predicted or (), members)
    owner = {e: m for m, experts in plan.items() for e in experts}
    result: dict[int, list[int]] = {m: [] for m in members}
    leftovers: list[int] = []
    for expert in sorted(set(real)):
        if expert in owner:
            result[owner[expert]].append(expert)
        else:
            leftovers.append(expert)
    for expert in leftovers:
        target = min(members, key=lambda m: (len(result[m]), members.index(m)))
        result[target].append(expert)
    return result


def assign_prefill(real: Iterable[int], placement: Placement) -> dict[int, list[int]]:
    """During prefill every expert goes to its fixed prefill worker."""
    result: dict[int, list[int]] = {}
    for expert in sorted(set(real)):
        result.setdefault(placement.prefill_worker(expert), []).append(expert)
    return result


def prefill_candidates(placement: Placement) -> list[int]:
    """Workers that may hold a prefill prefetch (and so must hear about every layer)."""
    return sorted({placement.prefill_worker(e) for e in range(placement.n_experts)})


def prefill_prefetch_order(placement: Placement, worker: int) -> list[tuple[int, int]]:
    """(layer, expert) pairs ``worker`` computes during prefill, in the order needed."""
    return [
        (layer, expert)
        for layer in range(placement.n_layers)
        for expert in range(placement.n_experts)
        if placement.prefill_worker(expert) == worker
    ]


MIN_CHUNK_ROWS = 16


def chunk_sizes(rows: int, chunk: int) -> list[int]:
    """Split one expert's ``rows`` into prefill mini-batches of about ``chunk`` rows.

    Chunks are as even as possible and never smaller than ``MIN_CHUNK_ROWS`` (a GEMM over
    very few rows takes another kernel path, whose rounding would differ from the
    reference's single GEMM); ``chunk <= 0`` disables splitting.
    """
    if chunk <= 0 or rows < 2 * max(chunk, MIN_CHUNK_ROWS):
        return [rows] if rows else []
    n = rows // max(chunk, MIN_CHUNK_ROWS)
    base, extra = divmod(rows, n)
    return [base + 1] * extra + [base] * (n - extra)


def recall(predicted: Iterable[int] | None, real: Iterable[int]) -> float:
    """Share of the really-routed experts that the prediction named (0 without a prediction).

    A layer that routed nothing has nothing to miss and scores 1.
    """
    real_set = set(real)
    if not real_set:
        return 1.0
    return len(real_set & set(predicted or ())) / len(real_set)
