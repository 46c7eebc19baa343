"""What the agent sends up its link fits the frame the control plane takes (announced when the link
comes up): an event that would not fit is replaced by what fits, never sent to close the link."""

from __future__ import annotations

import asyncio
import contextlib
import json

from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from agent.frames import encode, fit
from agent.link import Uplink
from inference.wire.generation import Done, Failed, Token, TokenLogprob
from inference.wire.link import LEGACY_FRAME_LIMIT, SERVER_FRAME_LIMIT_HEADER, RoleState, frame_bytes

LIMIT = 64 * 1024
ALTERNATIVES = [(31000 + i, -2.3456788063049316 - i) for i in range(5)]


def echo_with_logprobs(prompt_tokens: int) -> Token:
    """A first token carrying the prompt's logprobs, 5 alternatives each (``echo`` with ``logprobs=5``)."""
    logprob = TokenLogprob(token_id=31999, logprob=-2.3456788063049316, top=ALTERNATIVES)
    return Token(request_id="r1", index=0, token_id=5, prompt_logprobs=[logprob] * prompt_tokens)


def long_result(steps: int) -> Done:
    per_step = [
        {"step": s, "ms": 12.5, "layers": [{"layer": i, "experts": [1, 2]} for i in range(32)]} for s in range(steps)
    ]
    return Done(
        request_id="r1", token_ids=[5] * steps, finish_reason="length", metrics={"ttft_ms": 4.0, "per_step": per_step}
    )


def test_an_event_that_fits_goes_up_as_it_is() -> None:
    token = Token(request_id="r1", index=0, token_id=5)
    assert fit(token, LIMIT) is token


def test_a_token_past_the_limit_fails_its_generation_with_both_sizes() -> None:
    token = echo_with_logprobs(1000)
    size = frame_bytes(encode(token))
    failed = fit(token, LIMIT)
    assert isinstance(failed, Failed) and failed.too_large and not failed.retryable and failed.request_id == "r1"
    assert f"takes {size} bytes" in failed.error and f"the {LIMIT} bytes the control plane takes" in failed.error
    assert 170 * 1000 < size < 190 * 1000  # about 180 bytes a prompt token: 16 MiB is some 93,000 tokens


def test_a_result_past_the_limit_keeps_its_summary_and_the_steps_that_fit() -> None:
    done = long_result(200)
    cut = fit(done, LIMIT)
    assert isinstance(cut, Done) and frame_bytes(encode(cut)) <= LIMIT < frame_bytes(encode(done))
    assert cut.metrics["ttft_ms"] == 4.0 and cut.token_ids == done.token_ids
    assert cut.metrics["per_step"] == done.metrics["per_step"][: len(cut.metrics["per_step"])]
    assert cut.metrics["per_step_omitted"] == 200 - len(cut.metrics["per_step"]) > 0


def test_other_events_past_the_limit_are_left_out_and_a_failure_is_shortened() -> None:
    role = RoleState(deployment="d", role="main", state="failed", detail="x" * LIMIT)
    assert fit(role, LIMIT) is None
    failed = fit(Failed(request_id="r1", error="e" * LIMIT), LIMIT)
    assert isinstance(failed, Failed) and len(failed.error) == 1000


def test_the_uplink_keeps_to_the_limit_the_control_plane_announced_and_the_link_stays_up() -> None:
    """A receiver that closes the link on a frame past its limit (as the control plane's edge does,
    with 1009), announcing it in its answer: before, the agent sent the frame and lost the link."""

    async def session() -> tuple[int, list[dict]]:
        received: list[dict] = []

        async def take(ws) -> None:
            with contextlib.suppress(ConnectionClosed):  # the test's end closes it
                async for text in ws:
                    received.append(json.loads(text))

        def announce(connection, request, response):
            response.headers[SERVER_FRAME_LIMIT_HEADER] = str(LIMIT)

        async with serve(take, "127.0.0.1", 0, max_size=LIMIT, process_response=announce) as server:
            port = server.sockets[0].getsockname()[1]
            uplink = Uplink()
            async with connect(f"ws://127.0.0.1:{port}") as ws:
                await uplink.use(ws)
                sent = [
                    await uplink.send(echo_with_logprobs(1000)),
                    await uplink.send(Token(request_id="r2", index=0, token_id=7)),
                ]
                await asyncio.sleep(0.2)
                assert ws.close_code is None  # still up
            limit = uplink.limit
        assert [type(s) for s in sent] == [Failed, Token]
        return limit, received

    limit, received = asyncio.run(session())
    assert limit == LIMIT
    assert [(r["type"], r["request_id"]) for r in received] == [("generation_failed", "r1"), ("generation_token", "r2")]


def test_a_control_plane_that_announces_no_limit_is_held_to_1_mib() -> None:
    async def session() -> int:
        async def take(ws) -> None:
            await ws.wait_closed()

        async with serve(take, "127.0.0.1", 0) as server:
            uplink = Uplink()
            async with connect(f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}") as ws:
                await uplink.use(ws)
                return uplink.limit

    assert asyncio.run(session()) == LEGACY_FRAME_LIMIT
