"""An answer carried across main's restart (``agent.migration``): the continuation main is asked
for, how its events join the answer, and what is not carried."""

from __future__ import annotations

import pytest

from agent.migration import EXACT, MAX_REPLAY_TOKENS, Carried, ReplayDiverged, seeded
from inference.wire.generation import Done, Failed, Generate, Token

REQUEST = Generate(request_id="r1", deployment="d", prompt_ids=[1, 2, 3], max_new_tokens=6, prompt_logprobs=True)


def token(index: int, token_id: int) -> Token:
    return Token(request_id="r1", index=index, token_id=token_id)


def test_a_request_that_samples_without_a_seed_gets_one_and_no_other_changes() -> None:
    sampled = Generate(request_id="r1", deployment="d", prompt_ids=[1], max_new_tokens=2, do_sample=True)
    assert seeded(sampled).seed is not None and seeded(sampled).seed != seeded(sampled).seed  # drawn each time
    assert seeded(REQUEST) is REQUEST  # greedy: no seed needed
    chosen = Generate(request_id="r1", deployment="d", prompt_ids=[1], max_new_tokens=2, do_sample=True, seed=7)
    assert seeded(chosen).seed == 7


def test_the_continuation_re_reads_the_sent_tokens_and_its_events_join_the_answer() -> None:
    carried = Carried(REQUEST)
    assert [carried.renumbered(token(i, 10 + i)) for i in range(2)] == [token(0, 10), token(1, 11)]
    following = carried.continuation()
    assert isinstance(following, Generate)
    assert following.prompt_ids == [1, 2, 3, 10, 11] and following.max_new_tokens == 4
    assert following.request_id == "r1" and not following.prompt_logprobs  # the caller had them
    # The restarted main numbers from 0: the answer goes on at 2.
    assert carried.renumbered(token(0, 12)) == token(2, 12)
    done = carried.renumbered(Done(request_id="r1", token_ids=[12, 13], finish_reason="stop", metrics={"ttft_ms": 1}))
    assert done.token_ids == [10, 11, 12, 13] and done.finish_reason == "stop"
    assert done.metrics == {"ttft_ms": 1, "main_restarts": {"count": 1, "resumed_at": [2], "replay": "prefill"}}


def test_an_answer_is_carried_across_one_restart_and_fails_retryably_after_the_next() -> None:
    carried = Carried(REQUEST)
    carried.renumbered(token(0, 10))
    assert isinstance(carried.continuation(), Generate)
    carried.renumbered(token(0, 11))
    refused = carried.continuation()
    assert isinstance(refused, str) and "after 1 restart(s)" in refused
    failed = carried.failed(refused)
    assert isinstance(failed, Failed) and failed.retryable and failed.error.endswith("ask again shortly")


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"grammar": "{}"}, "under a grammar"),
        ({"frequency_penalty": 0.5}, "frequency or presence penalty"),
        ({"presence_penalty": -1.0}, "frequency or presence penalty"),
    ],
)
def test_what_a_continuation_would_change_is_not_carried(changes: dict, why: str) -> None:
    import msgspec

    carried = Carried(msgspec.structs.replace(REQUEST, **changes))
    carried.renumbered(token(0, 10))
    refused = carried.continuation()
    assert isinstance(refused, str) and why in refused


def test_past_the_longest_replay_the_answer_is_not_carried() -> None:
    import msgspec

    carried = Carried(msgspec.structs.replace(REQUEST, max_new_tokens=MAX_REPLAY_TOKENS + 10))
    carried.sent = list(range(MAX_REPLAY_TOKENS + 1))
    refused = carried.continuation()
    assert isinstance(refused, str) and f"past the {MAX_REPLAY_TOKENS}" in refused


def test_an_answer_whose_budget_was_spent_ends_without_asking_main_again() -> None:
    carried = Carried(REQUEST)
    for i in range(6):
        carried.renumbered(token(i, 10 + i))
    assert carried.spent
    done = carried.finished()
    assert done.token_ids == [10, 11, 12, 13, 14, 15] and done.finish_reason == "length"


def test_an_exact_replay_asks_for_the_request_again_and_drops_what_it_computes_again_after_checking() -> None:
    import msgspec

    grammared = msgspec.structs.replace(REQUEST, grammar="{}", frequency_penalty=0.5)  # carried too, exactly
    carried = Carried(grammared, mode=EXACT)
    for i in range(2):
        carried.renumbered(token(i, 10 + i))
    assert carried.continuation() is grammared  # from its start
    assert [carried.renumbered(token(i, 10 + i)) for i in range(2)] == [None, None]  # checked, dropped
    assert carried.renumbered(token(2, 12)) == token(2, 12)  # new: on as it is
    done = carried.renumbered(Done(request_id="r1", token_ids=[10, 11, 12], finish_reason="stop", metrics={}))
    assert done.token_ids == [10, 11, 12]
    assert done.metrics["main_restarts"] == {"count": 1, "resumed_at": [2], "replay": "exact"}


def test_an_exact_replay_that_computes_another_token_is_refused() -> None:
    carried = Carried(REQUEST, mode=EXACT)
    carried.renumbered(token(0, 10))
    carried.continuation()
    with pytest.raises(ReplayDiverged, match="token 0 as 99, not the 10 sent"):
        carried.renumbered(token(0, 99))
