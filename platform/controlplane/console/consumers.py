"""The console's websocket: staff only; sends the cluster's snapshot whenever it changes."""

from __future__ import annotations

import asyncio
import contextlib

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

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
        self.watcher = asyncio.create_task(self._watch())

    async def disconnect(self, code: int) -> None:
        watcher = getattr(self, "watcher", None)
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _watch(self) -> None:
        last = None
        while True:
            state = await database_sync_to_async(snapshot)()
            if state != last:
                await self.send_json({"type": "snapshot", **state})
                last = state
            await asyncio.sleep(EVERY_S)
