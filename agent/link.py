"""The agent's side of the agent link: one websocket to the control plane, kept up.

Connects with the node credential, sends a heartbeat at once and then every few seconds,
answers commands, and reconnects with backoff whenever the link drops (a control-plane
restart, a network blip). A refused credential is final: the agent stops with the reason.
Over https the websocket goes through the agent's trust in the server (``agent.tls``): a
pinned server's certificate alone; one renewed with the same key is taken, another key is
refused and retried with backoff (saying what to do), never sent the credential. Plain http
off the box (``--insecure``) is logged as a warning each time the link comes up.
The runtime roles (``agent.roles.Roles``, one ``RoleRunner`` each) live across reconnections. A
generation's events are kept until the control plane acknowledges them (``agent.outbox``) and go
up again, first, when the link is back: a dropped link costs an answer a pause, never a token.
Anything else sent while the link is down is dropped, and the next heartbeat carries every role's
state again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from agent import credentials, frames, inventory, tls
from agent.backoff import reconnect_delay
from agent.credentials import NodeCredential
from agent.outbox import Outbox
from agent.roles import Roles
from agent.runtime import fetch_with_progress, shard_dir
from agent.spawn import RoleSpawner
from agent.tls import ServerTrust, TrustError
from inference import __version__
from inference.wire.base import WireStruct
from inference.wire.generation import GENERATION_EVENTS, Generate
from inference.wire.link import (
    AGENT_PROTOCOL,
    CLOSE_PROTOCOL_MISMATCH,
    CLOSE_UNAUTHENTICATED,
    COMMANDS,
    FRAME_LIMIT_HEADER,
    LEGACY_FRAME_LIMIT,
    LINK_PATH,
    PROTOCOL_HEADER,
    SERVER_FRAME_LIMIT_HEADER,
    VERSION_HEADER,
    Acknowledge,
    ApplyAlignment,
    CancelGeneration,
    CredentialSaved,
    FetchShard,
    Heartbeat,
    LinkPing,
    LinkPong,
    MessageError,
    RotateCredential,
    StartRole,
    StopRole,
    TaskDone,
    frame_bytes,
    frame_limit,
    loads,
    parse,
)

log = logging.getLogger(__name__)

RECHECK_EVERY_S = 600.0  # how often the doctor runs again while the link stays up
# The most bytes one command frame may hold (websockets' ``max_size``), announced to the control
# plane, which sends nothing bigger: a command that would not fit fails alone there. Without it
# websockets' default, 1 MiB, applied, and a ``Generate`` carrying a 1.5 MB schema closed the link
# (1009) and every generation on it. A ``Generate`` is about the size of the request it comes from
# (a prompt's token ids in JSON take about the bytes of its text; a schema travels in its grammar),
# and the control plane takes requests up to its own cap, ODMOE_MAX_REQUEST_BYTES: 16 MiB by
# default, so this is the same. Not more: websockets may hold 16 frames (``max_queue``) the agent
# has not read yet, so this bounds what the link can make it hold to 256 MiB.
MAX_FRAME_BYTES = 16 * 2**20
# What a node credential looks like (controlplane/nodes/credentials.py): anything else is refused.
NODE_SECRET = re.compile(r"odmoe-node-[A-Za-z0-9_-]{32,128}")


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
    facts: dict | None = None,
    recheck: Callable[[], dict] | None = None,
    trust: ServerTrust | None = None,
    spawner: RoleSpawner | None = None,
) -> None:
    """Keep the link up until ``stop`` is set; raises LinkRefused if the credential is refused.

    ``facts`` go up with every heartbeat's inventory (the agent's version, the doctor's report);
    ``recheck`` gives the doctor's report again, asked each time the link comes up and every
    ``RECHECK_EVERY_S`` while it stays up (a box whose server, clock or disk was not ready
    when the agent started is not held to that first report). ``trust``: the agent's trust in the
    server, shared with every download (default: one from the credential's pin and ``state_dir``).
    ``spawner``: how the roles' processes start (``agent.spawn``; default: each a fresh process).
    """
    trust = trust or ServerTrust(credential.server, credential.pin, state_dir)
    uplink = Uplink()
    link = Link(
        credential=credential,
        state_dir=state_dir,
        host=urlparse(credential.server).hostname or "127.0.0.1",
        heartbeat_s=heartbeat_s,
        stop=stop or asyncio.Event(),
        uplink=uplink,
        roles=Roles(credential, state_dir, uplink.send, trust, spawner),
        trust=trust,
        facts=facts or {},
        recheck=recheck,
    )
    try:
        await _keep_up(link, on_connect)
    finally:
        for task in link.generations:
            task.cancel()
        await link.roles.close()


class Uplink:
    """Sends events on whichever websocket is up now. A generation's events are kept until they are
    acknowledged (``outbox``) and sent again, before anything else, on the next websocket; any other
    event is dropped while none is up. Each frame fits the control plane's frame limit (``limit``,
    which it announced on connect): an event that would not is replaced by what fits
    (``agent.frames.fit``), or left out."""

    def __init__(self, outbox: Outbox | None = None) -> None:
        self.ws: ClientConnection | None = None
        self.limit = LEGACY_FRAME_LIMIT
        self.outbox = outbox or Outbox()
        self._order = asyncio.Lock()  # what is kept goes up again before any newer frame

    async def use(self, ws: ClientConnection | None) -> None:
        """Send on ``ws`` from now on (None: the link is down), within the frame limit it announced,
        starting with every generation event not yet acknowledged."""
        async with self._order:
            self.ws = ws
            if ws is None:
                return
            announced = ws.response.headers.get(SERVER_FRAME_LIMIT_HEADER) if ws.response is not None else None
            try:
                self.limit = frame_limit(announced)
            except MessageError as exc:  # a server that says nothing usable: what every server takes
                log.warning("the control plane announced no usable frame limit (%s): frames stay within 1 MiB", exc)
                self.limit = LEGACY_FRAME_LIMIT
            kept = self.outbox.pending()
            if kept:
                log.info("sending %d generation events again, kept while the link was down", len(kept))
            with contextlib.suppress(ConnectionClosed, OSError):  # kept: it goes again on the next link
                for event, text in kept:
                    fitted = self._fitted(event, text)
                    if fitted is not None:
                        await ws.send(fitted[1])

    def acknowledged(self, command: Acknowledge) -> None:
        for request_id, index in command.acks:
            self.outbox.acknowledge(request_id, index)

    async def send(self, message: WireStruct) -> WireStruct | None:
        """Send ``message``, or what fits in its place; returns what was sent (None: nothing). A
        generation's event is kept (and so counts as sent) while the link is down."""
        async with self._order:
            generation = isinstance(message, GENERATION_EVENTS)
            if generation:
                message = self.outbox.number(message)
            elif self.ws is None:
                log.debug("link down: dropped %s", message.TYPE)
                return None
            fitted = self._fitted(message, frames.encode(message))
            if fitted is None:
                return None
            message, text = fitted
            if generation:
                kept = self.outbox.keep(message, text)
                if kept is None:  # its generation ended already
                    return None
                if kept is not message:  # the generation was given up: its Failed goes instead
                    message, text = kept, frames.encode(kept)
            if self.ws is not None:
                with contextlib.suppress(ConnectionClosed, OSError):  # a generation's event goes again on the next link
                    await self.ws.send(text)
            return message

    def _fitted(self, message: WireStruct, text: str) -> tuple[WireStruct, str] | None:
        """``message`` and its frame, or what fits the limit in its place (None: nothing does)."""
        if frame_bytes(text) <= self.limit:
            return message, text
        fitted = frames.fit(message, self.limit)
        log.warning(
            "a %s event of %d bytes is past the control plane's %d: %s",
            message.TAG,
            frame_bytes(text),
            self.limit,
            f"sent as {fitted.TAG}" if fitted is not None else "left out",
        )
        if fitted is None:
            return None
        if isinstance(fitted, GENERATION_EVENTS):
            fitted = self.outbox.number(fitted)  # a token's Failed(too_large) takes its place
        return fitted, frames.encode(fitted)


@dataclass
class Link:
    """What the link needs across reconnections."""

    credential: NodeCredential
    state_dir: Path
    host: str  # the control plane's host: the inventory reports the local address that routes to it
    heartbeat_s: float
    stop: asyncio.Event
    uplink: Uplink
    roles: Roles
    trust: ServerTrust  # how the server is trusted (agent.tls), shared with every download
    facts: dict = dataclasses.field(default_factory=dict)  # sent with every inventory
    recheck: Callable[[], dict] | None = None  # the doctor's report, asked again
    # Generations being carried to main: they outlive the link they came on (their events are kept
    # for the next one), and end with the agent.
    generations: set[asyncio.Task] = dataclasses.field(default_factory=set)


async def _keep_up(link: Link, on_connect: Callable[[], None] | None) -> None:
    stop = link.stop
    attempt = 0
    trust = link.trust
    while not stop.is_set():
        credential = link.credential  # the newest: a rotation may have replaced it
        context = None
        try:
            context = await asyncio.to_thread(trust.context)  # may learn a pinned certificate: a handshake
            async with connect(
                link_url(credential.server),
                additional_headers={
                    "Authorization": credential.authorization,
                    PROTOCOL_HEADER: str(AGENT_PROTOCOL),
                    VERSION_HEADER: __version__,
                    FRAME_LIMIT_HEADER: str(MAX_FRAME_BYTES),
                },
                max_size=MAX_FRAME_BYTES,
                open_timeout=10,
                proxy=None,
                **({"ssl": context} if context is not None else {}),
            ) as ws:
                attempt = 0
                log.info("link to %s is up", credential.server)
                if tls.in_clear_off_the_box(credential.server):
                    log.warning("%s", tls.clear_text_warning(credential.server))
                if on_connect is not None:
                    on_connect()
                await link.uplink.use(ws)
                try:
                    await _serve(ws, link)
                finally:
                    await link.uplink.use(None)
        except InvalidStatus as exc:
            if exc.response.status_code in (401, 403):
                raise LinkRefused("the control plane refused this node's credential") from None
            log.warning("link refused with HTTP %s; retrying", exc.response.status_code)
        except InvalidHandshake as exc:  # no websocket answer: a proxy between, a server still starting
            log.warning("the link's handshake failed (%s); retrying", exc)
        except ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == CLOSE_UNAUTHENTICATED:
                raise LinkRefused("the control plane refused this node's credential; enroll again") from None
            if exc.rcvd is not None and exc.rcvd.code == CLOSE_PROTOCOL_MISMATCH:
                upgrade = tls.install_command(credential.server, credential.pin)
                raise LinkRefused(f"the control plane turned this agent away ({exc.rcvd.reason}): {upgrade}") from None
            log.warning("link closed (%s); reconnecting", exc)
        except ssl.SSLCertVerificationError as exc:
            try:
                await asyncio.to_thread(trust.renew, context, exc.verify_message)
                continue  # the same key in a renewed certificate: connect again at once
            except TrustError as refused:
                log.error("%s", refused)
            except OSError as probe_failed:
                log.warning("cannot reach %s (%s); retrying", credential.server, probe_failed)
        except TrustError as exc:
            log.error("%s", exc)
        except OSError as exc:
            log.warning("cannot reach %s (%s); retrying", credential.server, exc)
        if stop.is_set():
            break
        delay = reconnect_delay(attempt)
        attempt += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=delay)


async def _serve(ws: ClientConnection, link: Link) -> None:
    await _Session(ws, link).run()


class _Session:
    """One connection of the link: heartbeats up, commands down, until either side ends it.

    A shard fetch, an alignment change and a cancel run in the background and end with the
    connection; a generation goes on if the link drops (its answer waits in the outbox).
    """

    def __init__(self, ws: ClientConnection, link: Link) -> None:
        self.ws, self.link = ws, link
        self.roles, self.send = link.roles, link.uplink.send
        self.running: set[str] = set()  # task ids in progress: a repeated command is not run twice
        self.background: set[asyncio.Task] = set()

    async def run(self) -> None:
        self.spawn(self.check_again())
        tasks = [asyncio.create_task(self.beat()), asyncio.create_task(self.listen())]
        tasks.append(asyncio.create_task(self.link.stop.wait()))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise ConnectionClosed and friends
        finally:
            for task in [*tasks, *self.background]:
                task.cancel()

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def check_again(self) -> None:
        while self.link.recheck is not None:
            try:
                self.link.facts["doctor"] = await asyncio.to_thread(self.link.recheck)
            except Exception:
                log.exception("the doctor could not run; its last report stands")
            await asyncio.sleep(RECHECK_EVERY_S)

    async def beat(self) -> None:
        while True:
            found = {**inventory.collect(self.link.state_dir, self.link.host), **self.link.facts}
            await self.send(Heartbeat(inventory=found, roles=self.roles.snapshot()))
            await asyncio.sleep(self.link.heartbeat_s)

    async def listen(self) -> None:
        async for raw in self.ws:
            try:
                command = parse(loads(raw), allowed=COMMANDS)
            except (MessageError, ValueError) as exc:
                log.warning("ignored a bad command: %s", exc)
                continue
            await self.obey(command)

    async def obey(self, command: WireStruct) -> None:
        roles = self.roles
        if isinstance(command, LinkPing):
            await self.send(LinkPong(nonce=command.nonce))
        elif isinstance(command, RotateCredential):
            await self.rotate(command)
        elif isinstance(command, FetchShard) and command.task_id not in self.running:
            self.running.add(command.task_id)
            self.spawn(self.fetch(command))
        elif isinstance(command, StartRole):
            await roles.start(command)
        elif isinstance(command, StopRole):
            await roles.stop(command.deployment, command.role_name)
        elif isinstance(command, ApplyAlignment):
            self.spawn(roles.apply_alignment(command))
        elif isinstance(command, Generate):  # goes on if this link drops
            task = asyncio.create_task(roles.generate(command))
            self.link.generations.add(task)
            task.add_done_callback(self.link.generations.discard)
        elif isinstance(command, CancelGeneration):
            self.spawn(roles.cancel(command))
        elif isinstance(command, Acknowledge):
            self.link.uplink.acknowledged(command)

    async def rotate(self, command: RotateCredential) -> None:
        link = self.link
        if not NODE_SECRET.fullmatch(command.node_secret):
            log.warning("ignored a credential rotation with a malformed secret")
            return
        rotated = dataclasses.replace(link.credential, node_secret=command.node_secret)
        await asyncio.to_thread(credentials.save, link.state_dir, rotated)  # on disk (0600) before it is used
        link.credential = rotated
        self.roles.use_credential(rotated)
        log.info("node credential rotated")
        await self.send(CredentialSaved())

    async def fetch(self, command: FetchShard) -> None:
        link = self.link
        try:
            try:
                dest = shard_dir(link.state_dir, command.model_id, command.role)
            except ValueError as exc:
                await self.send(TaskDone(task_id=command.task_id, ok=False, detail=str(exc)))
                return
            reason = await fetch_with_progress(
                link.credential,
                command.model_id,
                command.role,
                dest,
                task_id=command.task_id,
                send=self.send,
                trust=link.trust,
            )
            if reason:
                log.warning("fetching %s of model %s failed: %s", command.role, command.model_id, reason)
        finally:
            self.running.discard(command.task_id)
