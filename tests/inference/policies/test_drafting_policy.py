"""``draft_policy="auto"``'s choice alone (``inference.policies.drafting``) and what main feeds it
(``DraftTuner``, which main and the simulators drive): the issue's own arithmetic, and a k that follows
the agreement and the costs measured."""

from __future__ import annotations

import pytest

from inference.policies.drafting import (
    DraftTuner,
    PassCosts,
    choose_drafts,
    distinct_experts,
    expected_tokens,
    fit_effective,
)

COPIES = PassCosts(expert_s=1.0, position_s=0.0)  # copy-bound: only the experts a pass copies count


def test_a_pass_yields_its_token_and_each_draft_kept_in_turn() -> None:
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 4) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="probability"):
        expected_tokens(1.5, 2)


def test_independent_routing_gives_the_issue_s_union_and_gain() -> None:
    """Issue 52: with 8 experts and top-2 chosen independently, 5 positions need about 6.1 distinct
    experts, and at 90 % agreement k = 4 gives about 1.34x the tokens per copied byte."""
    assert distinct_experts(1, 8, 2, 8) == pytest.approx(2)
    assert distinct_experts(5, 8, 2, 8) == pytest.approx(6.10, abs=0.01)
    gain = (expected_tokens(0.9, 4) / distinct_experts(5, 8, 2, 8)) / (1 / 2)
    assert gain == pytest.approx(1.34, abs=0.01)


@pytest.mark.parametrize("effective", [2.5, 4.0, 6.3, 8.0])
def test_the_effective_expert_count_is_recovered_from_the_union_it_gives(effective: float) -> None:
    union = distinct_experts(5, 8, 2, effective)
    assert fit_effective(5, union, 8, 2) == pytest.approx(effective, rel=1e-6)


def test_repeated_routing_makes_a_smaller_union() -> None:
    # The demo model's measured 4.63 distinct experts for 5 positions (issue 52) is an effective count under 8.
    effective = fit_effective(5, 4.63, 8, 2)
    assert 2 < effective < 8
    assert distinct_experts(9, 8, 2, effective) < distinct_experts(9, 8, 2, 8)


def test_auto_drafts_nothing_the_shadow_never_guesses_and_everything_it_always_does() -> None:
    common = dict(most=8, experts=8, top_k=2, effective=8.0, layers=1, costs=COPIES)
    assert choose_drafts(agreement=0.0, **common) == 0
    assert choose_drafts(agreement=1.0, **common) == 8
    # At 60 %: under independent routing each draft's new experts cost more copies than the drafts kept
    # save; where neighbouring tokens repeat experts, the union stays small and drafting pays.
    assert choose_drafts(agreement=0.6, **common) == 0
    assert choose_drafts(agreement=0.6, **(common | {"effective": 3.0})) == 8


def test_positions_that_cost_main_more_than_copies_save_draft_fewer() -> None:
    common = dict(agreement=0.9, most=8, experts=8, top_k=2, effective=4.0, layers=1)
    cheap = choose_drafts(costs=PassCosts(expert_s=1.0, position_s=0.01), **common)
    dear = choose_drafts(costs=PassCosts(expert_s=1.0, position_s=2.0), **common)
    assert dear < cheap


def test_the_fixed_policy_always_asks_for_the_most() -> None:
    tuner = DraftTuner(most=4, auto=False, experts=8, top_k=2, layers=1)
    tuner.note_verified(tested=4, kept=0)
    assert tuner.drafts() == 4


def test_auto_follows_the_agreement_main_measures() -> None:
    tuner = DraftTuner(most=6, auto=True, experts=8, top_k=2, layers=1)
    first = tuner.drafts()
    assert first > 0  # the prior: drafts kept often enough to be worth asking for
    for _ in range(100):  # the shadow's guesses are never main's tokens
        tuner.note_verified(tested=1, kept=0)
    assert tuner.agreement < 0.05 and tuner.drafts() == 0
    asked_again = 0
    while tuner.drafts() == 0:  # passes that test nothing bring the prior back, so the shadow is tried again
        tuner.note_verified(tested=0, kept=0)
        asked_again += 1
    assert 1 < asked_again < 100
    tuner.note_verified(tested=1, kept=0)  # ... and one rejection is enough to stop asking again
    assert tuner.drafts() == 0
    for _ in range(200):
        tuner.note_verified(tested=6, kept=6)
        tuner.note_pass(7, 2.5)  # neighbouring tokens share most experts
    assert tuner.agreement > 0.95 and tuner.effective < 4
    assert tuner.drafts() == 6
    # A timed step: 0.1 s of its 1.0 s in expert rounds serving 10 experts, 7 positions over 1 layer.
    tuner.note_step(step_s=1.0, experts_s=0.1, distinct=10, positions=7, layers=1)
    assert tuner.costs == PassCosts(expert_s=pytest.approx(0.01), position_s=pytest.approx(0.9 / 7))


def test_a_shadow_that_keeps_main_waiting_for_its_drafts_is_asked_for_fewer() -> None:
    """Main's wait for the shadow's forwards counts per draft: the paper testbed's simulator showed it
    outweighing the copies saved where the shadow drafts slowly (docs/benchmarks/drafts.md)."""
    common = dict(agreement=0.9, most=8, experts=8, top_k=2, effective=4.0, layers=1)
    prompt = choose_drafts(costs=PassCosts(expert_s=1.0, position_s=0.01, draft_s=0.0), **common)
    slow = choose_drafts(costs=PassCosts(expert_s=1.0, position_s=0.01, draft_s=3.0), **common)
    assert slow < prompt
    tuner = DraftTuner(most=6, auto=True, experts=8, top_k=2, layers=1)
    tuner.note_step(step_s=1.0, experts_s=0.1, distinct=10, positions=7, layers=1)
    for _ in range(200):
        tuner.note_wait(wait_s=0.6, asked=6)  # 0.1 s a draft
    assert tuner.costs.draft_s == pytest.approx(0.1, rel=1e-3)
    tuner.note_step(step_s=1.0, experts_s=0.1, distinct=10, positions=7, layers=1)
    assert tuner.costs.draft_s == pytest.approx(0.1, rel=1e-3)  # a timed step keeps the wait measured apart
    tuner.note_wait(wait_s=1.0, asked=0)  # a pass that asked for nothing teaches nothing
    assert tuner.costs.draft_s == pytest.approx(0.1, rel=1e-3)


def test_a_drafts_wait_is_weighed_once_a_pass_and_the_copies_once_a_layer() -> None:
    """The copies and main's positions cost at every layer, the wait for the shadow once before the pass:
    a deep model's pass spends its wait over more copies saved, so it drafts where a shallow one does not."""
    common = dict(agreement=0.9, most=8, experts=8, top_k=2, effective=4.0)
    costs = PassCosts(expert_s=1.0, position_s=0.01, draft_s=3.0)
    assert choose_drafts(layers=1, costs=costs, **common) == 0
    assert choose_drafts(layers=32, costs=costs, **common) == 8
    with pytest.raises(ValueError, match="layer"):
        choose_drafts(layers=0, costs=costs, **common)
