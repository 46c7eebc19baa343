"""Drafted decoding in main: what to ask the shadow for, and which of a pass's tokens are kept.

With ``draft_tokens`` set, main asks the shadow (``DraftAsk``) after each pass of a sequence for its
guesses of the sequence's next tokens, and computes the sequence's last token and each guess as the
positions of one pass (``runner.Lane``): every position exactly as its own decode step computes it,
the positions sharing only the experts' copies. ``verify`` then samples position by position, as
decoding without drafts does, one draw per position and in order: a guess is kept while it equals
the token main samples there, and the first that differs is replaced by main's own token, which ends
the pass. So the tokens, the generator's draws and the grammar's state stand exactly where decoding
without drafts leaves them, and ``trim_cache`` keeps the positions whose inputs were kept.
``inference.policies.drafting.DraftTuner`` chooses how many drafts to ask for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from inference.runtime.engine.grammar import GrammarError
from inference.wire.runtime import Drafts


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
