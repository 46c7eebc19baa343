"""An answer carried across main's restart (``agent.migration``): the continuation main is asked
for, how its events join the answer, and what is not carried."""

from __future__ import annotations

import pytest

from agent.migration import EXACT, Carried, ReplayDiverged, seeded
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


class Clock:
    """Seconds that pass only when a test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_continuation_re_reads_the_sent_tokens_and_its_events_join_the_answer() -> None:
    clock = Clock()
    carried = Carried(REQUEST, clock=clock)
    assert [carried.renumbered(token(i, 10 + i)) for i in range(2)] == [token(0, 10), token(1, 11)]
    clock.now += 1.5  # main exits 1.5 s after the last token it sent, and comes back
    following = carried.continuation()
    assert isinstance(following, Generate)
    assert following.prompt_ids == [1, 2, 3, 10, 11] and following.max_new_tokens == 4
    assert following.answered == 2  # the prompt's last 2 are the answer's: a grammar walks them, penalties count them
    assert following.request_id == "r1" and not following.prompt_logprobs  # the caller had them
    # The restarted main numbers from 0: the answer goes on at 2, its first token 2.25 s after the last.
    clock.now += 0.75
    assert carried.renumbered(token(0, 12)) == token(2, 12)
    clock.now += 9  # a later gap is no pause of the restart's
    done = carried.renumbered(Done(request_id="r1", token_ids=[12, 13], finish_reason="stop", metrics={"ttft_ms": 1}))
    assert done.token_ids == [10, 11, 12, 13] and done.finish_reason == "stop"
    restarts = {"count": 1, "resumed_at": [2], "paused_ms": [2250.0], "replay": "prefill"}
    assert done.metrics == {"ttft_ms": 1, "main_restarts": restarts}


def test_a_restart_whose_continuation_ends_at_once_pauses_until_that_end() -> None:
    clock = Clock()
    carried = Carried(REQUEST, clock=clock)
    clock.now += 0.5  # main exits before its first token: paused since the request came
    carried.continuation()
    clock.now += 1
    done = carried.renumbered(Done(request_id="r1", token_ids=[], finish_reason="stop", metrics={}))
    assert done.metrics["main_restarts"]["paused_ms"] == [1500.0]


def test_an_answer_is_carried_across_one_restart_and_fails_retryably_after_the_next() -> None:
    carried = Carried(REQUEST)
    carried.renumbered(token(0, 10))
    assert isinstance(carried.continuation(), Generate)
    carried.renumbered(token(0, 11))
    refused = carried.continuation()
    assert isinstance(refused, str) and "past the 1 restart(s) an answer is carried across" in refused
    failed = carried.failed(refused)
    assert isinstance(failed, Failed) and failed.retryable and failed.error.endswith("ask again shortly")


@pytest.mark.parametrize("changes", [{"grammar": "{}"}, {"frequency_penalty": 0.5}, {"presence_penalty": -1.0}])
def test_an_answer_under_a_grammar_or_penalties_is_carried_with_what_it_answered(changes: dict) -> None:
    import msgspec

    carried = Carried(msgspec.structs.replace(REQUEST, **changes))
    carried.renumbered(token(0, 10))
    carried.renumbered(token(1, 11))
    following = carried.continuation()
    assert isinstance(following, Generate)
    assert following == msgspec.structs.replace(
        REQUEST, **changes, prompt_ids=[1, 2, 3, 10, 11], answered=2, max_new_tokens=4, prompt_logprobs=False
    )


def test_past_the_deployments_longest_replay_or_with_no_migrations_the_answer_is_not_carried() -> None:
    carried = Carried(REQUEST, max_replay_tokens=2)
    for i in range(3):
        carried.renumbered(token(i, 10 + i))
    refused = carried.continuation()
    assert isinstance(refused, str) and "after 3 tokens, past the 2 a continuation re-reads" in refused
    carried = Carried(REQUEST, max_replay_tokens=3)
    carried.sent = [10, 11, 12]
    assert isinstance(carried.continuation(), Generate)  # at the bound: carried
    none = Carried(REQUEST, max_migrations=0)
    refused = none.continuation()
    assert isinstance(refused, str) and "past the 0 restart(s)" in refused


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
    clock = Clock()
    carried = Carried(grammared, mode=EXACT, clock=clock)
    for i in range(2):
        carried.renumbered(token(i, 10 + i))
    assert carried.continuation() is grammared  # from its start
    clock.now += 2
    assert [carried.renumbered(token(i, 10 + i)) for i in range(2)] == [None, None]  # checked, dropped
    clock.now += 0.5  # the replayed tokens are part of the pause: the caller sees none of them
    assert carried.renumbered(token(2, 12)) == token(2, 12)  # new: on as it is
    done = carried.renumbered(Done(request_id="r1", token_ids=[10, 11, 12], finish_reason="stop", metrics={}))
    assert done.token_ids == [10, 11, 12]
    assert done.metrics["main_restarts"] == {"count": 1, "resumed_at": [2], "paused_ms": [2500.0], "replay": "exact"}


def test_an_exact_replay_that_computes_another_token_is_refused() -> None:
    carried = Carried(REQUEST, mode=EXACT)
    carried.renumbered(token(0, 10))
    carried.continuation()
    with pytest.raises(ReplayDiverged, match="token 0 as 99, not the 10 sent"):
        carried.renumbered(token(0, 99))


def test_main_s_agent_carries_answers_as_its_deployment_s_settings_say() -> None:
    from types import SimpleNamespace

    from agent.runtime import RoleRunner

    runner = RoleRunner(None, None, None)  # type: ignore[arg-type]
    assert runner.main_work._carrying() == {"mode": "prefill"}  # no role yet: the defaults
    settings = {"replay": "exact", "max_migrations": 0, "max_replay_tokens": 7}
    runner.command = SimpleNamespace(spec={"role": "main", "settings": settings})  # type: ignore[assignment]
    carried = Carried(REQUEST, **runner.main_work._carrying())
    assert (carried.mode, carried.max_migrations, carried.max_replay_tokens) == ("exact", 0, 7)
    runner.command = SimpleNamespace(spec={"settings": {"replay": "?", "max_migrations": -1}})  # type: ignore[assignment]
    assert runner.main_work._carrying() == {"mode": "prefill"}  # what no deployment sends: the defaults


class MainThatExits:
    """Main's agent with a main that exits once ``sent`` tokens of the answer went up; what it sends."""

    def __init__(self, sent: int, *, state: str = "starting") -> None:
        import asyncio
        from types import SimpleNamespace

        from agent import generations, runtime
        from inference.wire.link import RoleState

        self.sent: list = []

        async def send(message):
            self.sent.append(message)
            return message

        runner = self.runner = runtime.RoleRunner(None, None, send)  # type: ignore[arg-type]
        runner.command = SimpleNamespace(deployment="d", spec={"role": "main", "settings": {}})  # type: ignore[assignment]
        runner.state = RoleState(deployment="d", role="main", state=state)
        runner.process = SimpleNamespace(returncode=None)  # type: ignore[assignment]
        work = self.work = runner.main_work
        work._main_client = lambda deployment: SimpleNamespace(close=lambda: None)  # type: ignore[method-assign]

        def stream(client, proc, request, carried, loop):
            for i in range(sent):
                asyncio.run_coroutine_threadsafe(send(carried.renumbered(token(i, 10 + i))), loop).result()
            return generations.MAIN_EXITED

        work._stream = stream  # type: ignore[method-assign]


def test_a_cancel_while_main_is_down_ends_the_answer_with_what_was_sent() -> None:
    import asyncio

    from inference.wire.link import CancelGeneration

    main = MainThatExits(2)

    async def session() -> None:
        answering = asyncio.create_task(main.work.generate(REQUEST))
        await asyncio.sleep(0.3)  # main is being started again
        await main.work.cancel(CancelGeneration(request_id="r1"))
        await asyncio.wait_for(answering, 5)

    asyncio.run(session())
    *tokens, done = main.sent
    assert [t.token_id for t in tokens] == [10, 11]
    assert isinstance(done, Done) and done.finish_reason == "cancelled" and done.token_ids == [10, 11]
    assert main.work._cancelled == set()


def test_a_main_stopped_while_the_answer_waits_for_it_ends_the_answer_at_once_and_retryably() -> None:
    import asyncio
    import time

    from inference.wire.link import RoleState

    main = MainThatExits(1)

    async def session() -> float:
        started = time.monotonic()
        answering = asyncio.create_task(main.work.generate(REQUEST))
        await asyncio.sleep(0.3)
        main.runner.state = RoleState(deployment="d", role="main", state="stopped")  # StopRole
        await asyncio.wait_for(answering, 5)
        return time.monotonic() - started

    assert asyncio.run(session()) < 3  # not the 45 s a restart may take
    failed = main.sent[-1]
    assert isinstance(failed, Failed) and failed.retryable and "was not back" in failed.error


def test_an_answer_whose_budget_was_spent_when_main_exited_ends_whole() -> None:
    import asyncio

    main = MainThatExits(REQUEST.max_new_tokens)
    asyncio.run(main.work.generate(REQUEST))
    done = main.sent[-1]
    assert isinstance(done, Done) and done.finish_reason == "length" and done.token_ids == list(range(10, 16))
