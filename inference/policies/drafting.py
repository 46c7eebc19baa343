"""How many tokens the shadow drafts for main's next pass under ``draft_policy="auto"`` (pure).

A pass that verifies k drafts yields, on average, 1 + a + a² + ... + aᵏ tokens when each draft is
kept with probability a given that those before it were (``expected_tokens``). It costs, at every
layer, the copies of the distinct experts its k + 1 positions route to (``distinct_experts``: fewer
than k + 1 times top-k, since neighbouring tokens often share experts) and main's compute of k + 1
positions; and before it, main's wait for the shadow to draft k tokens one forward after another
(none when the shadow drafted them ahead while main verified the pass before). ``choose_drafts``
picks the k from 0 to the deployment's ``draft_tokens`` with the most tokens per second of pass
under those costs; ``DraftTuner`` keeps running figures of what main measured and asks it, pass by
pass. The simulators (``inference.sim``) drive the same tuner with their simulated passes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# ``auto`` before it has measured anything: drafts kept this often, and the copies alone counting.
PRIOR_AGREEMENT = 0.8
PRIOR_WEIGHT = 4.0  # ... worth this many drafts tested
DECAY = 0.05  # each new observation's weight in the running figures (about the last 20 passes)


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


def choose_drafts(
    *, agreement: float, most: int, experts: int, top_k: int, effective: float, layers: int, costs: PassCosts
) -> int:
    """The number of drafts, 0 to ``most``, whose pass over ``layers`` layers yields the most tokens
    per second."""
    if most < 0:
        raise ValueError(f"the most drafts a pass may verify is at least 0, got {most}")
    if layers < 1:
        raise ValueError(f"a model has at least one layer, got {layers}")

    def rate(k: int) -> float:
        copies = distinct_experts(k + 1, experts, top_k, effective) * costs.expert_s
        cost = layers * (copies + (k + 1) * costs.position_s) + k * costs.draft_s
        return expected_tokens(agreement, k) / cost if cost > 0 else float(k)

    return max(range(most + 1), key=lambda k: (rate(k), -k))


class DraftTuner:
    """How many drafts main asks for: ``most`` (``draft_tokens``) under the ``fixed`` policy; under
    ``auto``, ``policies.drafting.choose_drafts`` on running figures of main's recent passes: the
    drafts kept of those tested, how the experts of a pass's positions overlap, and what a distinct
    expert and a position cost a layer, and main's wait for a draft."""

    def __init__(self, *, most: int, auto: bool, experts: int, top_k: int, layers: int) -> None:
        self.most, self.auto, self.experts, self.top_k, self.layers = most, auto, experts, top_k, layers
        self.kept = PRIOR_AGREEMENT * PRIOR_WEIGHT
        self.tested = PRIOR_WEIGHT
        self.effective = float(experts)  # independent routing until passes show otherwise
        self.costs = PassCosts(expert_s=1.0, position_s=0.0)  # copies alone, until a step is timed
        self.timed = False

    @property
    def agreement(self) -> float:
        return self.kept / self.tested

    def drafts(self) -> int:
        if not self.auto:
            return self.most
        return choose_drafts(
            agreement=self.agreement,
            most=self.most,
            experts=self.experts,
            top_k=self.top_k,
            effective=self.effective,
            layers=self.layers,
            costs=self.costs,
        )

    def note_verified(self, tested: int, kept: int) -> None:
        """A pass tested ``tested`` drafts (each one whose predecessors were all kept) and kept ``kept``.

        A decode pass that tested none (``auto`` asked for none, or none came) moves the figures toward
        ``PRIOR_WEIGHT`` drafts all kept: only drafts asked for are tested, so without that a shadow
        judged poor on a few passes would never be asked again, even where it has since become good
        (a new request, a shadow back after a loss). Optimism that a pass of drafts disproves: once
        untested passes raise the agreement to where drafting would pay, ``auto`` asks again, and a
        poor shadow's rejections bring it down at once.
        """
        if tested:
            self.kept = self.kept * (1 - DECAY) + kept
            self.tested = self.tested * (1 - DECAY) + tested
        else:
            self.kept += DECAY * (PRIOR_WEIGHT - self.kept)
            self.tested += DECAY * (PRIOR_WEIGHT - self.tested)

    def note_pass(self, positions: int, distinct: float) -> None:
        """A sequence's pass of ``positions`` positions used ``distinct`` experts a layer (its mean)."""
        if positions > 1:
            fitted = fit_effective(positions, distinct, self.experts, self.top_k)
            self.effective += DECAY * (fitted - self.effective)

    def note_timed_pass(
        self, *, drafts: int, positions: int, kept: int, wait_s: float, step_s: float, experts_s: float, distinct: int
    ) -> None:
        """One sequence's whole pass as a simulator times it: ``drafts`` asked for, ``positions``
        computed (drafts + 1, fewer at an answer's end), ``kept`` drafts kept, main's wait for them,
        the pass's time and its expert rounds' share, the distinct experts summed over its layers.
        The runtime notes each of these where it measures it."""
        self.note_wait(wait_s, drafts)
        self.note_step(step_s, experts_s, distinct, positions, self.layers)
        self.note_pass(positions, distinct / self.layers)
        self.note_verified(min(kept + 1, positions - 1), kept)

    def note_wait(self, wait_s: float, asked: int) -> None:
        """Main waited ``wait_s`` before a pass for the shadow's drafts, the most it asked of one
        sequence being ``asked`` (the shadow drafts a batch's sequences together, a forward a token)."""
        if asked < 1 or wait_s < 0:
            return
        draft_s = self.costs.draft_s + DECAY * (wait_s / asked - self.costs.draft_s)
        self.costs = dataclasses.replace(self.costs, draft_s=draft_s)

    def note_step(self, step_s: float, experts_s: float, distinct: int, positions: int, layers: int) -> None:
        """A timed step: ``experts_s`` of its ``step_s`` went to its layers' expert rounds, which served
        ``distinct`` experts over its ``layers`` layers; main computed ``positions`` positions a layer."""
        if distinct < 1 or positions < 1 or layers < 1:
            return
        measured = PassCosts(
            expert_s=experts_s / distinct,
            position_s=max(step_s - experts_s, 0.0) / (layers * positions),
            draft_s=self.costs.draft_s,  # measured apart (note_wait)
        )
        if not self.timed:
            self.costs, self.timed = measured, True
            return
        self.costs = PassCosts(
            expert_s=self.costs.expert_s + DECAY * (measured.expert_s - self.costs.expert_s),
            position_s=self.costs.position_s + DECAY * (measured.position_s - self.costs.position_s),
            draft_s=self.costs.draft_s,
        )
