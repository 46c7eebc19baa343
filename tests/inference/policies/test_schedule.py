"""The pure scheduling decisions: prefetch dealing, expert assignment, alignment, recall.

Hypothesis is not installed in the venv, so the properties run over seeded random cases.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from inference.policies import alignment, assignment
from inference.policies.placement import placement


def _random_cases(seed: int, n: int = 300):
    rng = random.Random(seed)
    for _ in range(n):
        n_experts = rng.randint(1, 10)
        n_members = rng.randint(1, 6)
        members = tuple(rng.sample(range(20), n_members))
        k = rng.randint(1, n_experts)
        real = rng.sample(range(n_experts), k)
        yield rng, n_experts, members, real


def _flatten(plan: dict[int, list[int]]) -> list[int]:
    return [e for experts in plan.values() for e in experts]


def test_prefetch_assignment_deals_sorted_round_robin() -> None:
    assert assignment.prefetch_assignment([5, 1, 3], [4, 7]) == {4: [1, 5], 7: [3]}
    assert assignment.prefetch_assignment([6, 2, 2, 0, 6], [9, 8, 7]) == {9: [0], 8: [2], 7: [6]}
    assert assignment.prefetch_assignment([], [0, 1]) == {0: [], 1: []}
    assert assignment.prefetch_assignment([3, 2, 1, 0], [5]) == {5: [0, 1, 2, 3]}


def test_prefetch_assignment_properties() -> None:
    for _, _, members, predicted in _random_cases(0):
        plan = assignment.prefetch_assignment(predicted, members)
        assert list(plan) == list(members)
        assert sorted(_flatten(plan)) == sorted(set(predicted))
        ordered = sorted(set(predicted))
        for i, expert in enumerate(ordered):
            assert expert in plan[members[i % len(members)]]
        loads = [len(v) for v in plan.values()]
        assert max(loads) - min(loads) <= 1


def test_perfect_prediction_goes_to_the_prefetching_worker() -> None:
    for _, _, members, real in _random_cases(1):
        plan = assignment.prefetch_assignment(real, members)
        result = assignment.assign_experts(real, real, members)
        assert result == plan


def test_wrong_or_missing_prediction_still_assigns_every_expert_once() -> None:
    for rng, n_experts, members, real in _random_cases(2):
        options = [None, [], rng.sample(range(n_experts), rng.randint(1, n_experts))]
        # A prediction that shares nothing with the real routing.
        options.append([e + n_experts for e in real])
        for predicted in options:
            result = assignment.assign_experts(real, predicted, members)
            assert list(result) == list(members)
            assert sorted(_flatten(result)) == sorted(real)
            loads = [len(v) for v in result.values()]
            plan = assignment.prefetch_assignment(predicted or (), members)
            owner = {e: m for m, es in plan.items() for e in es}
            hits = {m: [e for e in real if owner.get(e) == m] for m in members}
            for m in members:
                assert set(hits[m]) <= set(result[m])  # a predicted expert stays with its owner
            if not any(hits.values()):
                assert max(loads) - min(loads) <= 1, (real, predicted, members, result)
            # Leftovers fill the least-loaded workers (water-filling).
            bound = max(max(len(h) for h in hits.values()), math.ceil(len(real) / len(members)))
            assert max(loads) <= bound, (real, predicted, members, result)


def test_leftovers_prefer_least_loaded_then_group_order() -> None:
    # Experts 1 and 3 are predicted for worker 10; 5 and 6 were not predicted.
    assert assignment.assign_experts([1, 3, 5, 6], [1, 2, 3, 4], [10, 11]) == {10: [1, 3], 11: [5, 6]}
    assert assignment.assign_experts([0, 1, 2], None, [3, 1, 2]) == {3: [0], 1: [1], 2: [2]}
    assert assignment.assign_experts([0, 1, 2, 4], None, [3, 1]) == {3: [0, 2], 1: [1, 4]}


def test_one_worker_gets_everything() -> None:
    for predicted in (None, [], [0, 1], [5, 6]):
        assert assignment.assign_experts([3, 0, 1], predicted, [4]) == {4: sorted([3, 0, 1])}


@pytest.mark.parametrize(
    "shape",
    [(32, 8, 2, 8), (3, 6, 3, 3), (4, 8, 2, 3), (2, 4, 1, 10), (5, 7, 2, 1), (6, 8, 3, 5)],
)
def test_prefill_helpers_follow_the_placement(shape: tuple[int, int, int, int]) -> None:
    p = placement(*shape)
    n_layers, n_experts, _, n_workers = shape
    for k in range(1, n_experts + 1):
        for real in itertools.islice(itertools.combinations(range(n_experts), k), 20):
            result = assignment.assign_prefill(real, p)
            assert sorted(_flatten(result)) == sorted(real)
            for worker, experts in result.items():
                assert experts == sorted(experts)
                assert all(p.prefill_worker(e) == worker for e in experts)
    candidates = assignment.prefill_candidates(p)
    assert candidates == list(range(min(n_workers, n_experts)))
    seen: list[tuple[int, int]] = []
    for worker in range(n_workers):
        order = assignment.prefill_prefetch_order(p, worker)
        assert order == sorted(order)  # in (layer, expert) order: the order prefill needs them
        assert all(p.prefill_worker(e) == worker for _, e in order)
        assert set(order) <= p.owned(worker)
        assert bool(order) == (worker in candidates)
        seen.extend(order)
    assert sorted(seen) == sorted(itertools.product(range(n_layers), range(n_experts)))


@pytest.mark.parametrize(
    ("token_period", "kv_period", "expected_token_steps", "expected_kv_steps"),
    [
        (1, 1, [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]),
        (2, 4, [2, 4, 6, 8], [4, 8]),
        (4, 2, [4, 8], [2, 4, 6, 8]),
        (0, 1, [], [1, 2, 3, 4, 5, 6, 7, 8]),
        (1, 0, [1, 2, 3, 4, 5, 6, 7, 8], []),
        (0, 0, [], []),
    ],
)
def test_alignment_due(
    token_period: int, kv_period: int, expected_token_steps: list[int], expected_kv_steps: list[int]
) -> None:
    due = {step: alignment.alignment_due(step, token_period, kv_period) for step in range(1, 9)}
    assert [s for s, (tok, _) in due.items() if tok] == expected_token_steps
    assert [s for s, (_, kv) in due.items() if kv] == expected_kv_steps
    # Step 0 is prefill: never aligned.
    assert alignment.alignment_due(0, token_period, kv_period) == (False, False)
    assert alignment.alignment_due(-1, token_period, kv_period) == (False, False)


@pytest.mark.parametrize("good", [(0, 0), (1, 1), (3, 0), (0, 7)])
def test_validate_periods_accepts_non_negative_ints(good: tuple[int, int]) -> None:
    alignment.validate_periods(*good)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ((-1, 1), "token period"),
        ((1, -2), "KV period"),
        ((True, 1), "token period"),
        ((1, False), "KV period"),
        ((1.0, 1), "token period"),
        ((1, 2.5), "KV period"),
        (("1", 1), "token period"),
        ((None, 1), "token period"),
    ],
)
def test_validate_periods_rejects(bad: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        alignment.validate_periods(*bad)


@pytest.mark.parametrize(
    ("predicted", "real", "expected"),
    [
        ([1, 2], [1, 2], 1.0),
        ([2, 1], [1, 2], 1.0),
        ([1, 3], [1, 2], 0.5),
        ([3, 4], [1, 2], 0.0),
        (None, [1, 2], 0.0),
        ([], [1, 2], 0.0),
        ([0, 1, 2, 3], [1, 2], 1.0),
        ([1, 1], [1, 2, 3, 4], 0.25),
        ([1], [], 1.0),
        (None, [], 1.0),
    ],
)
def test_recall(predicted: list[int] | None, real: list[int], expected: float) -> None:
    assert assignment.recall(predicted, real) == expected


@pytest.mark.parametrize("rows", [0, 1, 15, 16, 31, 32, 33, 64, 70, 200, 1000])
@pytest.mark.parametrize("chunk", [0, 8, 16, 32, 64])
def test_prefill_chunks_cover_the_rows_and_are_never_tiny(rows: int, chunk: int) -> None:
    sizes = assignment.chunk_sizes(rows, chunk)
    assert sum(sizes) == rows
    assert all(size > 0 for size in sizes)
    if len(sizes) > 1:
        assert min(sizes) >= assignment.MIN_CHUNK_ROWS
        assert max(sizes) - min(sizes) <= 1
    if chunk <= 0:
        assert len(sizes) <= 1
