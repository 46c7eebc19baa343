"""Drafted decoding in main: what to ask the shadow for, and which of a pass's tokens are kept.

With ``draft_tokens`` set, main asks the shadow (``DraftAsk``) after each pass of a sequence for its
guesses of the sequence's next tokens, and computes the sequence's last token and each guess as the
positions of one pass (``runner.Lane``): every position exactly as its own decode step computes it,
the positions sharing only the experts' copies. ``verify`` then samples position by position, as
decoding without drafts does, one draw per position and in order: a guess is kept while it equals
the token main samples there, and the first that differs is replaced by main's own token, which ends
the pass. So the tokens, the generator's draws and the grammar's state stand exactly where decoding
without drafts leaves them, and ``trim_cache`` keeps the positions whose inputs were kept.
``DraftTuner`` measures what ``draft_policy="auto"`` chooses from (``inference.policies.drafting``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from inference.policies.drafting import PassCosts, choose_drafts, fit_effective
from inference.runtime.engine.grammar import GrammarError
from inference.wire.runtime import Drafts

# ``auto`` before it has measured anything: drafts kept this often, and the copies alone counting.
PRIOR_AGREEMENT = 0.8
PRIOR_WEIGHT = 4.0  # ... worth this many drafts tested
DECAY = 0.05  # each new observation's weight in the running figures (about the last 20 passes)


def draft_length(asked: int, generated: int, max_new_tokens: int) -> int:
    """How many drafts a sequence's next pass may verify: ``asked``, less what would take its answer
    past ``max_new_tokens`` (a pass yields at most its drafts and one more)."""
    return max(0, min(asked, max_new_tokens - generated - 1))


@dataclass
class Drafting:
    """One sequence's drafts: the pass it asked the shadow for, the answer, and its counts."""

    step: int = -1  # the pass asked for (the sequence's step)
    position: int = 0  # the generated index of the first token asked for
    asked: int = 0  # tokens asked for (0: the routing of the pass's one position only)
    tokens: tuple[int, ...] | None = None  # the shadow's answer, None until it comes
    passes: int = 0  # decode passes that carried drafts
    drafted: int = 0  # drafts verified
    accepted: int = 0  # ... of which main kept (each equal to its own token)
    unanswered: int = 0  # passes that ran without the drafts asked for (the shadow late or gone)

    def ask(self, step: int, position: int, tokens: int) -> None:
        self.step, self.position, self.asked, self.tokens = step, position, tokens, None

    def answer(self, msg: Drafts) -> None:
        """The shadow's drafts, kept when they answer the pass asked for (a late one is dropped)."""
        if (msg.step, msg.position) == (self.step, self.position) and self.tokens is None:
            self.tokens = tuple(msg.tokens[: self.asked])

    def waiting(self, step: int) -> bool:
        """Whether pass ``step`` still waits for drafts it asked for."""
        return self.step == step and self.asked > 0 and self.tokens is None

    def take(self, step: int) -> tuple[int, ...]:
        """The drafts for pass ``step`` (none where none were asked for or came); counted."""
        if self.step != step or not self.asked:
            return ()
        if self.tokens is None:
            self.unanswered += 1
            return ()
        drafts, self.tokens = self.tokens, ()
        if drafts:
            self.passes += 1
            self.drafted += len(drafts)
        return drafts

    def metrics(self) -> dict[str, float | int]:
        return {
            "passes": self.passes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "unanswered": self.unanswered,
            "agreement": self.accepted / self.drafted if self.drafted else 0.0,
        }


def verify(
    next_token: Callable[[list[int], torch.Tensor], int],
    logits: list[torch.Tensor],
    drafts: tuple[int, ...],
    ends: Callable[[int], bool],
) -> tuple[list[int], str | None]:
    """The tokens a pass yields, and the grammar's error if sampling hit one.

    ``logits[i]`` is position i's (0: after the sequence's last token, i: after draft i - 1);
    ``next_token(kept, row)`` samples a position given the tokens kept before it. Position i is
    sampled only when every draft before it was kept, so the generator draws once per token kept.
    """
    kept: list[int] = []
    for i, row in enumerate(logits):
        try:
            token = next_token(kept, row)
        except GrammarError as exc:
            return kept, str(exc)
        kept.append(token)
        if i >= len(drafts) or token != drafts[i] or ends(token):
            break
    return kept, None


def trim_cache(cache: DynamicCache, length: int) -> None:
    """Keep a cache's first ``length`` positions in every layer: a pass's rejected drafts dropped.

    A sliding-window layer records its past while drafts run (``DynamicCache.activate_past_recording``,
    set when the sequence joins), so it can drop positions past its window; cropping it by nothing
    restricts it back to its window, as a decode step leaves it.
    """
    extra = cache.get_seq_length() - length
    for layer in cache.layers:
        if extra > 0:
            layer.crop(-extra)
        elif getattr(layer, "record_past", False):
            layer.crop(0)


class DraftTuner:
    """How many drafts main asks for: ``most`` (``draft_tokens``) under the ``fixed`` policy; under
    ``auto``, ``policies.drafting.choose_drafts`` on running figures of main's recent passes: the
    drafts kept of those tested, how the experts of a pass's positions overlap, and what a distinct
    expert and a position cost a layer."""

    def __init__(self, *, most: int, auto: bool, experts: int, top_k: int) -> None:
        self.most, self.auto, self.experts, self.top_k = most, auto, experts, top_k
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
            costs=self.costs,
        )

    def note_verified(self, tested: int, kept: int) -> None:
        """A pass tested ``tested`` drafts (each one whose predecessors were all kept) and kept ``kept``."""
        if tested:
            self.kept = self.kept * (1 - DECAY) + kept
            self.tested = self.tested * (1 - DECAY) + tested

    def note_pass(self, positions: int, distinct: float) -> None:
        """A sequence's pass of ``positions`` positions used ``distinct`` experts a layer (its mean)."""
        if positions > 1:
            fitted = fit_effective(positions, distinct, self.experts, self.top_k)
            self.effective += DECAY * (fitted - self.effective)

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
