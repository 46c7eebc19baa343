"""Drafted decoding's decisions alone (``inference.runtime.engine.drafts``): how many drafts a pass
may verify, which of a pass's tokens are kept, what a sequence remembers of its asks, and a cache
trimmed back to the positions kept equal to one that never held the rest."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, MixtralConfig

from inference.runtime.engine.drafts import Drafting, draft_length, trim_cache, verify
from inference.runtime.engine.grammar import GrammarError
from inference.wire.runtime import Drafts


@pytest.mark.parametrize(
    ("asked", "generated", "limit", "expected"),
    [(4, 1, 100, 4), (4, 96, 100, 3), (4, 99, 100, 0), (0, 1, 100, 0), (8, 50, 52, 1)],
)
def test_a_pass_never_drafts_past_the_answer_s_limit(asked: int, generated: int, limit: int, expected: int) -> None:
    assert draft_length(asked, generated, limit) == expected
    assert generated + expected + 1 <= limit or expected == 0


def _sampler(tokens: list[int]):
    """A "sampler" that takes the given tokens in turn and records what it was shown."""
    calls: list[list[int]] = []

    def next_token(kept: list[int], row: torch.Tensor) -> int:
        calls.append(list(kept))
        return tokens[len(calls) - 1]

    return next_token, calls


ROWS = [torch.zeros(1, 4) for _ in range(5)]


@pytest.mark.parametrize(
    ("sampled", "drafts", "kept"),
    [
        ([7, 8, 9, 10, 11], (7, 8, 9, 10), [7, 8, 9, 10, 11]),  # all kept, and the token after them
        ([7, 5, 9, 10, 11], (7, 8, 9, 10), [7, 5]),  # the first difference is main's own token
        ([3, 8, 9, 10, 11], (7, 8, 9, 10), [3]),  # none kept
        ([7, 8, 9, 10, 11], (), [7]),  # no drafts: a decode step
    ],
)
def test_drafts_are_kept_while_they_equal_main_s_own_tokens(sampled, drafts, kept) -> None:
    next_token, calls = _sampler(sampled)
    got, error = verify(next_token, ROWS[: len(drafts) + 1], drafts, lambda token: False)
    assert (got, error) == (kept, None)
    # One draw per position sampled, each given exactly the tokens kept before it.
    assert calls == [kept[:i] for i in range(len(kept))]


def test_an_end_of_sequence_ends_the_pass_even_where_it_was_drafted() -> None:
    next_token, calls = _sampler([7, 2, 9])
    got, _ = verify(next_token, ROWS[:3], (7, 2), lambda token: token == 2)
    assert got == [7, 2] and len(calls) == 2


def test_a_grammar_error_keeps_the_tokens_before_it() -> None:
    def next_token(kept: list[int], row: torch.Tensor) -> int:
        if len(kept) == 2:
            raise GrammarError("no token is allowed here")
        return [4, 5][len(kept)]

    assert verify(next_token, ROWS[:4], (4, 5, 6), lambda token: False) == ([4, 5], "no token is allowed here")


def test_a_sequence_takes_only_the_drafts_of_the_pass_it_asked_for() -> None:
    drafting = Drafting()
    drafting.ask(step=3, position=7, tokens=2)
    assert drafting.waiting(3) and not drafting.waiting(4)
    drafting.answer(Drafts(request_id="r", step=2, position=6, tokens=[1, 2]))  # an older pass's: dropped
    assert drafting.waiting(3)
    drafting.answer(Drafts(request_id="r", step=3, position=7, tokens=[5, 6]))
    assert not drafting.waiting(3)
    assert drafting.take(3) == (5, 6)
    assert drafting.take(3) == ()  # taken once
    drafting.ask(step=4, position=9, tokens=2)
    assert drafting.take(4) == ()  # the shadow did not answer in time: counted
    drafting.accepted += 1
    assert drafting.metrics() == {"passes": 1, "drafted": 2, "accepted": 1, "unanswered": 1, "agreement": 0.5}


def _filled(config: MixtralConfig, keys: torch.Tensor, *, record: bool) -> DynamicCache:
    cache = DynamicCache(config=config)
    if record:
        cache.activate_past_recording()
    for position in range(keys.shape[2]):  # one position a step, as decoding fills it
        for layer in range(config.num_hidden_layers):
            cache.update(keys[:, :, position : position + 1], keys[:, :, position : position + 1] + 1, layer)
    return cache


@pytest.mark.parametrize("window", [None, 4])
def test_a_trimmed_cache_equals_one_that_never_held_the_rejected_positions(window: int | None) -> None:
    config = MixtralConfig(num_hidden_layers=2, num_key_value_heads=1, hidden_size=8, num_attention_heads=1)
    config.sliding_window = window
    keys = torch.arange(10 * 2, dtype=torch.float32).reshape(1, 1, 10, 2)
    drafted = _filled(config, keys, record=True)  # 10 positions: the last 3 rejected
    trim_cache(drafted, 7)
    plain = _filled(config, keys[:, :, :7], record=False)
    assert drafted.get_seq_length() == plain.get_seq_length() == 7
    for ours, theirs in zip(drafted.layers, plain.layers, strict=True):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
