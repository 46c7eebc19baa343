"""The channel layer across a Redis restart (``controlplane.channel_layer``): a consumer's receive
waits for Redis to come back instead of ending the consumer (and its websocket), and gets what is
sent once Redis answers again."""

from __future__ import annotations

import asyncio
from pathlib import Path

from controlplane.channel_layer import RedisChannelLayer
from controlplane.ops.processes import ProcessGroup, python_env
from controlplane.shared_redis import UNREACHABLE
from deploy.prodcheck import start_redis


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
