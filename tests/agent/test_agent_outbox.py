"""A generation's events outlive a dropped agent link (``agent.outbox``): kept until the control plane
acknowledges them, sent again first on the next link, numbered, bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json

from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from agent.frames import encode
from agent.link import Uplink
from agent.outbox import GIVEN_UP, Outbox
from inference.wire.generation import Done, Failed, Token
from inference.wire.link import Acknowledge, RoleState


def token(index: int, request_id: str = "r1") -> Token:
    return Token(request_id=request_id, index=index, token_id=100 + index)


def kept(outbox: Outbox, event) -> object:
    event = outbox.number(event)
    return outbox.keep(event, encode(event))


def test_an_end_is_numbered_after_the_tokens_and_nothing_after_it_is_kept() -> None:
    outbox = Outbox()
    assert [kept(outbox, token(i)) for i in range(3)] == [token(0), token(1), token(2)]
    done = kept(outbox, Done(request_id="r1", token_ids=[100, 101, 102], finish_reason="length", metrics={}))
    assert isinstance(done, Done) and done.index == 3
    assert kept(outbox, token(3)) is None  # after the end: dropped
    failed = kept(outbox, Failed(request_id="r2", error="no main"))
    assert isinstance(failed, Failed) and failed.index == 0  # nothing before it
    assert [e.index for e, _ in outbox.pending()] == [0, 1, 2, 3, 0]


def test_acknowledged_events_are_forgotten_and_an_acknowledged_end_forgets_its_generation() -> None:
    outbox = Outbox()
    for i in range(4):
        kept(outbox, token(i))
    outbox.acknowledge("r1", 1)
    assert [e.index for e, _ in outbox.pending()] == [2, 3]
    assert outbox.bytes == sum(len(text) for _, text in outbox.pending())
    kept(outbox, Done(request_id="r1", token_ids=[], finish_reason="stop", metrics={}))
    outbox.acknowledge("r1", 3)
    assert len(outbox) == 1  # its end is still to be acknowledged
    outbox.acknowledge("r1", 4)
    outbox.acknowledge("unknown", 9)
    assert len(outbox) == 0 and outbox.bytes == 0 and outbox.pending() == []


def test_a_generation_past_the_bound_is_given_up_with_a_retryable_failure_in_place_of_its_events() -> None:
    one = len(encode(token(0)))
    outbox = Outbox(max_bytes=len(encode(token(0, "other"))) + one * 4 + one // 2)
    kept(outbox, token(0, "other"))
    for i in range(4):
        assert kept(outbox, token(i)) == token(i)
    given_up = kept(outbox, token(4))  # the sixth frame would pass the bound
    assert isinstance(given_up, Failed) and given_up.retryable and given_up.error == GIVEN_UP
    assert given_up.index == 4  # after the tokens before it, which its caller may have had
    assert kept(outbox, token(5)) is None
    assert [(e.request_id, type(e).__name__) for e, _ in outbox.pending()] == [("other", "Token"), ("r1", "Failed")]
    assert outbox.bytes == sum(len(text) for _, text in outbox.pending())


def test_what_the_link_did_not_acknowledge_goes_up_again_first_on_the_next_link() -> None:
    """A control plane that acknowledges the first two tokens and then drops the link; events sent
    while it is down are kept; the next link gets every unacknowledged event, in order, before a
    newer one, and nothing acknowledged again."""

    async def session() -> tuple[list[list[dict]], object]:
        links: list[list[dict]] = []
        first_two = asyncio.Event()

        async def take(ws) -> None:
            received: list[dict] = []
            links.append(received)
            with contextlib.suppress(ConnectionClosed):
                async for text in ws:
                    received.append(json.loads(text))
                    if len(links) == 1 and len(received) == 3:
                        await ws.send(json.dumps(Acknowledge(acks=[("r1", 1)]).to_json()))
                        first_two.set()

        async with serve(take, "127.0.0.1", 0) as server:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            uplink = Uplink()
            async with connect(url) as ws:
                await uplink.use(ws)
                for i in range(3):
                    await uplink.send(token(i))
                await asyncio.wait_for(first_two.wait(), 5)
                uplink.acknowledged(Acknowledge(acks=[("r1", 1)]))  # as the agent's listener does
            await uplink.use(None)
            sent_while_down = [
                await uplink.send(token(3)),
                await uplink.send(Done(request_id="r1", token_ids=[], finish_reason="length", metrics={})),
                await uplink.send(RoleState(deployment="d", role="main", state="ready")),  # not kept
            ]
            async with connect(url) as ws:
                await uplink.use(ws)
                await uplink.send(token(0, "r2"))
                await asyncio.sleep(0.3)
        return links, sent_while_down

    links, sent_while_down = asyncio.run(session())
    assert [type(e).__name__ if e else None for e in sent_while_down] == ["Token", "Done", None]
    assert [(m["request_id"], m.get("index")) for m in links[0]] == [("r1", 0), ("r1", 1), ("r1", 2)]
    assert [(m["type"], m["request_id"], m["index"]) for m in links[1]] == [
        ("generation_token", "r1", 2),
        ("generation_token", "r1", 3),
        ("generation_done", "r1", 4),
        ("generation_token", "r2", 0),
    ]
