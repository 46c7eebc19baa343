"""How many tokens the shadow drafts for main's next pass under ``draft_policy="auto"`` (pure).

A pass that verifies k drafts yields, on average, 1 + a + a² + ... + aᵏ tokens when each draft is
kept with probability a given that those before it were (``expected_tokens``). It costs, at every
layer, the copies of the distinct experts its k + 1 positions route to (``distinct_experts``: fewer
than k + 1 times top-k, since neighbouring tokens often share experts) and main's compute of k + 1
positions; and before it, main's wait for the shadow to draft k tokens one forward after another
(none when the shadow drafted them ahead while main verified the pass before). ``choose_drafts``
picks the k from 0 to the deployment's ``draft_tokens`` with the most tokens per second of pass
under those costs, from what main has measured so far (``inference.runtime.engine.drafts.DraftTuner``
keeps the measurements).
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(agreement: float, drafts: int) -> float:
    """The mean tokens a pass of ``drafts`` drafts yields, each draft kept with probability
    ``agreement`` where every one before it was: its own token, then each draft kept in turn."""
    if not 0.0 <= agreement <= 1.0:
        raise ValueError(f"agreement is a probability, got {agreement}")
    return sum(agreement**i for i in range(drafts + 1))


def distinct_experts(positions: int, experts: int, top_k: int, effective: float) -> float:
    """The mean distinct experts ``positions`` positions route to at a layer: the union of ``top_k``
    experts each, as if drawn among ``effective`` equally likely ones (``experts`` where routing is
    independent between positions; fewer where neighbouring tokens repeat experts)."""
    if positions < 1:
        raise ValueError(f"a pass has at least one position, got {positions}")
    effective = min(max(effective, float(top_k)), float(experts))
    return min(float(experts), effective * (1.0 - (1.0 - top_k / effective) ** positions))


def fit_effective(positions: int, distinct: float, experts: int, top_k: int) -> float:
    """The ``effective`` expert count under which ``positions`` positions route to ``distinct``
    experts a layer on average (``distinct_experts`` solved for it; it grows with ``effective``),
    bounded to [top_k, experts]."""
    if positions <= 1 or distinct <= top_k:
        return float(top_k)
    low, high = float(top_k), float(experts)
    if distinct_experts(positions, experts, top_k, high) <= distinct:
        return high
    for _ in range(60):
        middle = (low + high) / 2
        if distinct_experts(positions, experts, top_k, middle) < distinct:
            low = middle
        else:
            high = middle
    return (low + high) / 2


@dataclass(frozen=True)
class PassCosts:
    """What a pass costs, as main measured it: per layer, each distinct expert it serves (the copy
    and the round trip it adds) and each position it computes itself (attention, norms, router);
    per pass, main's wait for each draft it asked the shadow for (its mean over passes)."""

    expert_s: float
    position_s: float
    draft_s: float = 0.0


def choose_drafts(*, agreement: float, most: int, experts: int, top_k: int, effective: float, costs: PassCosts) -> int:
    """The number of drafts, 0 to ``most``, whose pass yields the most tokens per second."""
    if most < 0:
        raise ValueError(f"the most drafts a pass may verify is at least 0, got {most}")

    def rate(k: int) -> float:
        copies = distinct_experts(k + 1, experts, top_k, effective) * costs.expert_s
        cost = copies + (k + 1) * costs.position_s + k * costs.draft_s
        return expected_tokens(agreement, k) / cost if cost > 0 else float(k)

    return max(range(most + 1), key=lambda k: (rate(k), -k))
