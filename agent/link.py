"""The agent's side of the agent link: one websocket to the control plane, kept up.

Connects with the node credential, sends a heartbeat at once and then every few seconds,
answers commands, and reconnects with backoff whenever the link drops (a control-plane
restart, a network blip). A refused credential is final: the agent stops with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from agent import inventory
from agent.backoff import reconnect_delay
from agent.credentials import NodeCredential
from agent.messages import COMMANDS, LINK_PATH, Heartbeat, MessageError, Ping, Pong, parse

log = logging.getLogger(__name__)

CLOSE_UNAUTHENTICATED = 4401


class LinkRefused(RuntimeError):
    """The control plane refused this node's credential."""


def link_url(server: str) -> str:
    parsed = urlparse(server)
    scheme = "wss" if parsed.scheme == "https" else "ws"
    return f"{scheme}://{parsed.netloc}{parsed.path.rstrip('/')}{LINK_PATH}"


async def run_link(
    credential: NodeCredential,
    state_dir: Path,
    *,
    heartbeat_s: float = 5.0,
    stop: asyncio.Event | None = None,
    on_connect: Callable[[], None] | None = None,
) -> None:
    """Keep the link up until ``stop`` is set; raises LinkRefused if the credential is refused."""
    stop = stop or asyncio.Event()
    host = urlparse(credential.server).hostname or "127.0.0.1"
    attempt = 0
    while not stop.is_set():
        try:
            async with connect(
                link_url(credential.server),
                additional_headers={"Authorization": credential.authorization},
                open_timeout=10,
                proxy=None,
            ) as ws:
                attempt = 0
                log.info("link to %s is up", credential.server)
                if on_connect is not None:
                    on_connect()
                await _serve(ws, state_dir, host, heartbeat_s, stop)
        except InvalidStatus as exc:
            if exc.response.status_code in (401, 403):
                raise LinkRefused("the control plane refused this node's credential") from None
            log.warning("link refused with HTTP %s; retrying", exc.response.status_code)
        except ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == CLOSE_UNAUTHENTICATED:
                raise LinkRefused("the control plane refused this node's credential; enroll again") from None
            log.warning("link closed (%s); reconnecting", exc)
        except OSError as exc:
            log.warning("cannot reach %s (%s); retrying", credential.server, exc)
        if stop.is_set():
            break
        delay = reconnect_delay(attempt)
        attempt += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=delay)


async def _serve(ws: ClientConnection, state_dir: Path, host: str, heartbeat_s: float, stop: asyncio.Event) -> None:
    async def beat() -> None:
        while True:
            await ws.send(json.dumps(Heartbeat(inventory=inventory.collect(state_dir, host)).to_json()))
            await asyncio.sleep(heartbeat_s)

    async def listen() -> None:
        async for raw in ws:
            try:
                command = parse(json.loads(raw), allowed=COMMANDS)
            except (MessageError, ValueError) as exc:
                log.warning("ignored a bad command: %s", exc)
                continue
            if isinstance(command, Ping):
                await ws.send(json.dumps(Pong(nonce=command.nonce).to_json()))

    tasks = [asyncio.create_task(beat()), asyncio.create_task(listen()), asyncio.create_task(stop.wait())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # re-raise ConnectionClosed and friends
    finally:
        for task in tasks:
            task.cancel()
