"""The channel layer across a Redis restart (``controlplane.channel_layer``): a consumer's receive
waits for Redis to come back instead of ending the consumer (and its websocket), and gets what is
sent once Redis answers again; a send Redis refused is sent once it takes it, a send whose reply was
lost is not sent again unless it may be; a generation's listener joins its group again."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

import pytest
import redis

from controlplane.channel_layer import RedisChannelLayer, redis_did_not_run_it, waiting_for_redis
from controlplane.deployments import generation
from controlplane.ops.processes import ProcessGroup, python_env
from controlplane.shared_redis import UNREACHABLE
from deploy.prodcheck import free_port, start_redis
from inference.wire.generation import Token


def test_a_receive_waits_out_a_redis_restart_and_gets_what_comes_after(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path / "logs", python_env()) as group:
        url = start_redis(group, tmp_path)
        (server,) = group.children
        argv = list(server.process.args)

        async def across_a_restart() -> dict:
            layer = RedisChannelLayer(hosts=[url])
            channel = await layer.new_channel()
            await layer.send(channel, {"type": "before"})
            assert (await layer.receive(channel))["type"] == "before"
            receiving = asyncio.create_task(layer.receive(channel))  # a consumer's loop, waiting
            await asyncio.sleep(0.2)
            group.stop(server)
            await asyncio.sleep(1.0)
            assert not receiving.done()  # waiting for Redis, not ended
            group.start("redis", argv)
            for _ in range(100):  # until Redis answers a send again
                try:
                    await layer.send(channel, {"type": "after"})
                    break
                except UNREACHABLE:
                    await asyncio.sleep(0.1)
            message = await asyncio.wait_for(receiving, 15)
            await layer.flush()
            return message

        assert asyncio.run(across_a_restart())["type"] == "after"


def test_redis_refusing_is_told_apart_from_a_reply_lost(tmp_path: Path) -> None:
    """A refused connection is a send Redis never ran; a connection that closed under a command is
    not known to be one, and is raised at once unless the caller says a second delivery is harmless."""
    port = free_port()  # nothing listens there

    async def refused() -> BaseException:
        layer = RedisChannelLayer(hosts=[f"redis://127.0.0.1:{port}/0"])
        try:
            await layer.group_send("g", {"type": "x"})
        except UNREACHABLE as exc:
            return exc
        raise AssertionError("a send to a port nobody listens on went through")

    assert redis_did_not_run_it(asyncio.run(refused()))
    assert redis_did_not_run_it(redis.BusyLoadingError("Redis is loading the dataset in memory"))
    lost = redis.ConnectionError("Connection closed by server.")
    assert not redis_did_not_run_it(lost)

    calls: list[bool] = []

    async def closing_under_it() -> None:
        calls.append(True)
        raise lost

    with pytest.raises(redis.ConnectionError):
        asyncio.run(waiting_for_redis(closing_under_it))
    assert len(calls) == 1  # not sent again: it may have been delivered
    with pytest.raises(redis.ConnectionError):
        asyncio.run(waiting_for_redis(closing_under_it, repeatable=True, wait_s=0.5))
    assert len(calls) > 2  # repeatable: tried again until the wait ran out


def _restart(group: ProcessGroup, tmp_path: Path, *, keeping_data: bool):
    """Stop the Redis ``start_redis`` started; a function that starts it again, with its data (its
    append-only file) or without."""
    (server,) = group.children
    argv = list(server.process.args)
    group.stop(server)
    if not keeping_data:
        for entry in (tmp_path / "redis").iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    return lambda: group.start("redis", argv)


@pytest.mark.parametrize("keeping_data", [True, False], ids=["with-its-data", "empty"])
def test_a_send_and_a_generation_listener_across_a_redis_restart(tmp_path: Path, keeping_data: bool) -> None:
    """A send made while Redis is down goes once Redis takes it, exactly once. A generation's
    listener waits on when Redis kept its data, and gets what main's link sends its group after; when
    Redis came back empty (its group gone), it ends the generation as one to ask again."""
    with ProcessGroup(tmp_path / "logs", python_env()) as group:
        url = start_redis(group, tmp_path)

        async def across_a_restart() -> tuple[list[dict], object]:
            layer = RedisChannelLayer(hosts=[url])
            node_channel, listener_channel = await layer.new_channel(), await layer.new_channel()
            await layer.group_add("node", node_channel)
            await layer.group_add("generation", listener_channel)
            inbox: asyncio.Queue = asyncio.Queue()
            listening = asyncio.create_task(generation._from_layer(layer, listener_channel, "generation", inbox))
            await asyncio.sleep(0.2)
            start_again = _restart(group, tmp_path, keeping_data=keeping_data)
            sending = asyncio.create_task(waiting_for_redis(layer.send, node_channel, {"type": "generate"}))
            await asyncio.sleep(1.0)
            assert not sending.done() and not listening.done()  # both wait for Redis
            start_again()
            await asyncio.wait_for(sending, 15)
            received = [await asyncio.wait_for(layer.receive(node_channel), 5)]
            with contextlib.suppress(TimeoutError):  # nothing more: it was sent once
                received.append(await asyncio.wait_for(layer.receive(node_channel), 1))
            token = Token(request_id="r", token_id=7, index=0)
            await layer.group_send("generation", {"type": "generation.event", "event": token.to_json()})
            event = await asyncio.wait_for(inbox.get(), 15)
            await generation.stop_listening(layer, listener_channel, listening)
            await layer.flush()
            return received, event

        received, event = asyncio.run(across_a_restart())
    assert [m["type"] for m in received] == ["generate"]
    if keeping_data:
        assert isinstance(event, Token) and event.token_id == 7
    else:
        assert isinstance(event, generation.ClusterGenerationError) and event.retryable, event
        assert "restarted" in str(event)
