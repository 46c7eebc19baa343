"""The console's websocket: staff only; sends the cluster's snapshot whenever it changes, and
every generation step as it happens (``{"type": "step", ...}``) for the live pipeline view: while
one is open, generations ask main for their step reports (``nodes.step_watch``)."""

from __future__ import annotations

import asyncio
import contextlib

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.nodes import step_watch
from controlplane.nodes.consumers import STEPS_GROUP

from .snapshot import snapshot

CLOSE_FORBIDDEN = 4403
EVERY_S = 1.0


class ConsoleConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_staff:
            await self.close(code=CLOSE_FORBIDDEN)
            return
        await self.accept()
        await self.channel_layer.group_add(STEPS_GROUP, self.channel_name)
        self.watcher = asyncio.create_task(self._watch())

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(STEPS_GROUP, self.channel_name)
        watcher = getattr(self, "watcher", None)
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        """Nothing the browser sends is read: Channels' JSON consumer would decode every frame first,
        and raise on one that is not JSON, closing the socket as a server error."""

    async def cluster_step(self, event: dict) -> None:
        """A step of a generation somewhere in the cluster (from an agent link)."""
        await self.send_json({**event, "type": "step"})

    async def _watch(self) -> None:
        last = None
        while True:
            await step_watch.mark_watched()  # generations report their steps while a console is open
            state = await database_sync_to_async(snapshot)()
            if state != last:
                await self.send_json({"type": "snapshot", **state})
                last = state
            await asyncio.sleep(EVERY_S)
