"""The agent link on the control plane's side: one websocket per enrolled agent.

The agent opens it with its node credential in the ``Authorization`` header; anything
else is refused before the socket is accepted. Events are validated with
``inference.wire.link`` and each calls one service; commands for a node reach its socket
through the channel-layer group ``node.<id>`` (a ``{"type": "agent.command", ...}`` event), each
frame measured against the frame limit the agent announced when it connected (``frames``): one that
would not fit fails what it asked for, never the link.

Generation events are relayed to the caller of the generation service (``relay``: in this
process when it listens here, else through the group ``generation.<request_id>``) — and only
for generations given to this node (``owners``), so a node cannot speak for a generation it was
not given. Each is acknowledged (``Acknowledge``, a batch every ``ACK_EVERY_S``), so the agent
forgets it; what it sends again after a reconnection (on this process or another) is relayed
again, and the caller drops what it had already. A link that closes pauses its open generations'
callers (``relay.pause``) instead of failing them: the rest comes on the agent's next link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from controlplane.channel_layer import waiting_for_redis
from controlplane.shared_redis import UNREACHABLE
from inference.wire.generation import GENERATION_EVENTS, Failed, Generate, GenerationEvent, Token
from inference.wire.link import (
    AGENT_PROTOCOL,
    CLOSE_PROTOCOL_MISMATCH,
    CLOSE_UNAUTHENTICATED,
    EVENTS,
    FIRST_AGENT_PROTOCOL,
    FRAME_LIMIT_HEADER,
    LEGACY_FRAME_LIMIT,
    MAX_ACKS,
    OLDEST_AGENT_PROTOCOL,
    PROTOCOL_HEADER,
    SERVER_FRAME_LIMIT_HEADER,
    Acknowledge,
    CredentialSaved,
    Heartbeat,
    MessageError,
    RoleState,
    RotateCredential,
    TaskDone,
    TaskProgress,
    frame_bytes,
    frame_limit,
    loads,
    parse,
)

from . import frames, link_writes, liveness, owners, services
from .beats import Beats
from .groups import node_group
from .inventory import clean_inventory, lasting
from .relay import pause, relay
from .reports import MAX_DETAIL_CHARS, PendingWrites, clean_role_report, clean_role_reports

log = logging.getLogger(__name__)

ACK_EVERY_S = 0.2  # how long a relayed event waits to be acknowledged with the others
MAX_REQUEST_ID_CHARS = 128  # a request id past this names no generation (the control plane's are 32)
MAX_REFUSED = 1024  # request ids a link remembers refusing (not looked up again)


# Every step of every generation, for live views of the pipeline (the console).
STEPS_GROUP = "cluster.steps"


def _db(fn):
    """``fn`` on a thread of the pool, not on the one thread that Channels shares between every
    consumer of the process: one slow write must not hold up every other agent's link."""
    return database_sync_to_async(fn, thread_sensitive=False)


def protocol_mismatch(protocol: str) -> str:
    """The close reason an agent of another protocol gets (a websocket reason holds 123 bytes)."""
    return f"agent protocol {protocol:.8}, server {AGENT_PROTOCOL}: upgrade by running the install one-liner again"


class AgentConsumer(AsyncJsonWebsocketConsumer):
    node_id: str | None = None
    frame_limit = LEGACY_FRAME_LIMIT  # the most bytes one frame down this link may hold: what the agent announced

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.generations: dict[str, str] = {}  # request id -> deployment, given to this node, not finished
        self._acks: dict[str, int] = {}  # request id -> the last index relayed, not yet acknowledged
        self._refused: set[str] = set()  # request ids this node was found not to have been given
        self._acker: asyncio.Task | None = None
        self.link_since = None  # when this link came up (Node.connected_at), to tell it from a newer one
        # What arrives to be recorded is written in the background, so the link keeps reading
        # (generation tokens go on at once) however slow the database is. Two lanes: the node's
        # liveness (the newest heartbeat's inventory: never queued behind anything, so a busy
        # node is not taken for a silent one), and the rest in order, one write per kind (a
        # heartbeat's roles, one role's state, one task's progress or end), a newer one replacing
        # the one not written yet: a flood of frames neither grows this queue nor the writes.
        self._liveness: dict | None = None
        self._liveness_writer: asyncio.Task | None = None
        self._writes = PendingWrites()
        self._writer: asyncio.Task | None = None
        # Which heartbeats reach the database at all (``beats``): liveness goes to Redis every time,
        # the node's row and its roles' report only on change or after a while.
        self._beats = Beats(refresh_s=liveness.ROW_REFRESH_S, stall_s=settings.NODE_HEARTBEAT_TIMEOUT_S / 2)

    async def connect(self) -> None:
        node = await _db(self._authenticate)()
        if node is None:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        # An agent that sends no protocol predates the header: it speaks the first one.
        protocol = self._header(PROTOCOL_HEADER.lower().encode()) or str(FIRST_AGENT_PROTOCOL)
        if not protocol.isdigit() or not OLDEST_AGENT_PROTOCOL <= int(protocol) <= AGENT_PROTOCOL:
            # Told at connect, with what to do, instead of failing later on a message it misreads.
            await self.accept()
            await self.close(code=CLOSE_PROTOCOL_MISMATCH, reason=protocol_mismatch(protocol))
            log.warning("node %s: its agent speaks protocol %s, not %s", node.name, protocol, AGENT_PROTOCOL)
            return
        try:
            self.frame_limit = frame_limit(self._header(FRAME_LIMIT_HEADER.lower().encode()))
        except MessageError as exc:  # nothing could be sent that it surely takes
            await self.accept()
            await self.close(code=CLOSE_PROTOCOL_MISMATCH, reason=str(exc)[:120])
            log.warning("node %s: its agent announced no usable frame limit (%s)", node.name, exc)
            return
        self.node_id = str(node.pk)
        await waiting_for_redis(
            self.channel_layer.group_add, node_group(self.node_id), self.channel_name, repeatable=True
        )
        # The most a frame up this link may hold (the edge closes the link on a bigger one): the
        # agent keeps what it sends within it.
        await self.accept(
            headers=[(SERVER_FRAME_LIMIT_HEADER.lower().encode(), str(settings.MAX_REQUEST_BYTES).encode())]
        )
        self.link_since = await _db(services.mark_connected)(node_id=self.node_id)
        log.info("agent of node %s connected", node.name)

    def _header(self, name: bytes) -> str | None:
        for key, value in self.scope.get("headers", []):
            if key == name:
                return value.decode("latin-1")[:20]
        return None

    async def disconnect(self, code: int) -> None:
        if self.node_id is None:
            return
        for writer in (self._liveness_writer, self._writer):
            if writer is not None:
                await writer  # what the agent said before it went is recorded before it is offline
        if self._acker is not None:
            self._acker.cancel()  # what it would have acknowledged, the agent sends again
        # The database first: with Redis gone too (a restart of both), the node is still marked offline.
        await _db(services.mark_offline)(node_id=self.node_id, link_since=self.link_since)
        try:
            await self._pause_open_generations()
            await self.channel_layer.group_discard(node_group(self.node_id), self.channel_name)
        except Exception as exc:  # Redis may be down: its groups expire by themselves
            log.warning("node %s: could not tidy its link's channel groups (%s)", self.node_id, exc)

    async def _pause_open_generations(self) -> None:
        """Generations given to this node and not finished go on in main, whose agent keeps their
        events for its next link: their callers hear that the link closed, and wait on."""
        for request_id in list(self.generations):
            await pause(self.channel_layer, request_id)
        self.generations.clear()

    async def send_json(self, content, close=False) -> None:
        """Every frame down the link, measured first: one past the agent's frame limit is not sent,
        and fails what it asked for alone (``frames.refusal``)."""
        text = await self.encode_json(content)
        size = frame_bytes(text)
        if size <= self.frame_limit:
            await self.send(text_data=text, close=close)
            return
        kind = f"{content.get('type')!r:.40}"
        log.warning(
            "node %s: a %s frame of %d bytes is past its agent's %d: not sent",
            self.node_id,
            kind,
            size,
            self.frame_limit,
        )
        answer = frames.refusal(content, size, self.frame_limit)
        if isinstance(answer, Failed):
            await self._fail_here(answer)
        elif isinstance(answer, TaskDone) and services.is_task_id(answer.task_id):
            key = ("done", answer.task_id)
            self._record(key, services.record_task_done, task_id=answer.task_id, ok=False, detail=answer.detail)

    @classmethod
    async def decode_json(cls, text_data):
        return loads(text_data)  # numbers JSON has not (NaN, Infinity, 1e999) refused, as the database would

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        """A frame that is not JSON text is refused like a malformed message: Channels' own JSON
        consumer raises on it (a binary or empty frame, text that is not JSON or nests too deep)."""
        try:
            if not text_data:
                raise ValueError("a message must be a JSON text frame")
            content = await self.decode_json(text_data)
        except (ValueError, RecursionError) as exc:
            log.warning("node %s sent a frame that is not JSON: %.200s", self.node_id, exc)
            await self.send_json({"type": "error", "detail": f"not a JSON message: {exc}"})
            return
        await self.receive_json(content, **kwargs)

    async def receive_json(self, content, **kwargs) -> None:
        if self.node_id is None:
            return  # a frame that raced the close of a link turned away at connect
        try:
            event = parse(content, allowed=EVENTS)
        except MessageError as exc:
            log.warning("node %s sent a bad message: %s", self.node_id, exc)
            await self.send_json({"type": "error", "detail": str(exc)})
            return
        if isinstance(event, GENERATION_EVENTS):
            await self._relay_generation(event)
        elif isinstance(event, Heartbeat):
            self._heartbeat(event)
        elif isinstance(event, RoleState):
            report = clean_role_report(event.to_json())
            key = ("role", report["deployment"], report["role_name"])
            self._beats.unsettle()
            self._record(key, services.record_runtime, reports=[report], complete=False)
        elif isinstance(event, TaskProgress | TaskDone) and not services.is_task_id(event.task_id):
            pass  # names no task of any node's: nothing to record, nor to hold meanwhile
        elif isinstance(event, TaskProgress):
            key = ("progress", event.task_id)
            self._record(key, services.record_task_progress, task_id=event.task_id, done=event.done, total=event.total)
        elif isinstance(event, TaskDone):
            detail = event.detail[:MAX_DETAIL_CHARS]
            self._record(
                ("done", event.task_id), services.record_task_done, task_id=event.task_id, ok=event.ok, detail=detail
            )
        elif isinstance(event, CredentialSaved):
            self._record(("credential_saved",), services.confirm_rotation)

    def _heartbeat(self, event: Heartbeat) -> None:
        """The node is alive (``liveness``, in Redis); its row and its roles' report are written
        when due (``beats``)."""
        beats, now = self._beats, time.monotonic()
        beats.beat(now)
        liveness.heard(self.node_id)
        # Known inventory entries only, each within its size, before it is held or stored.
        inventory = clean_inventory(event.inventory)
        if beats.row_due(now, writable=liveness.writable(), lasting=lasting(inventory)):
            self._liveness = inventory
            if self._liveness_writer is None or self._liveness_writer.done():
                self._liveness_writer = asyncio.create_task(self._write_liveness())
        reports = clean_role_reports(event.roles)
        epoch = beats.roles_due(reports, now)
        if epoch is not None:
            loop = asyncio.get_running_loop()
            if not self._record(("roles",), self._reconcile, reports=reports, epoch=epoch, loop=loop):
                self._beats.acted(epoch, False)  # dropped: acted on at the next heartbeat

    def _reconcile(self, *, node_id: str, reports: list[dict], epoch: int, loop: asyncio.AbstractEventLoop) -> None:
        """A heartbeat's complete report acted on (on a link-writes thread); whether it left the node
        settled is noted on the link's own loop."""
        settled = False  # a write that fails is acted on again at the next heartbeat
        try:
            settled = services.record_runtime(node_id=node_id, reports=reports, complete=True)
        finally:
            loop.call_soon_threadsafe(self._beats.acted, epoch, settled)

    def _record(self, key: tuple, write: Callable, **kwargs) -> bool:
        """Queue ``write(node_id=…, **kwargs)``, replacing a queued write of the same ``key``; whether it
        was queued (False: dropped, too many wait already)."""
        queued = self._writes.put(key, write, kwargs)
        if not queued and self._writes.dropped == 1:
            log.warning(
                "node %s: %d writes wait already; what else it reports is dropped", self.node_id, len(self._writes)
            )
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())
        return queued

    async def _write_liveness(self) -> None:
        while self._liveness is not None:
            inventory, self._liveness = self._liveness, None
            try:
                await link_writes.write(services.record_liveness, node_id=self.node_id, inventory=inventory)
            except Exception:
                log.exception("node %s: its heartbeat could not be recorded", self.node_id)

    async def _write(self) -> None:
        while self._writes:
            row = self._liveness_writer
            if row is not None and not row.done():
                # The node's row first: what a heartbeat reports of its roles is acted on with the node
                # online, as that heartbeat made it, or its deployments see it offline for a moment.
                await asyncio.shield(row)
            write, kwargs = self._writes.take()
            try:
                await link_writes.write(write, node_id=self.node_id, **kwargs)
            except Exception:
                log.exception("node %s: %s failed", self.node_id, write.__name__)

    async def agent_revoked(self, event: dict) -> None:
        """The node was removed: its credential is gone, so is this link (the agent stops retrying)."""
        await self.close(code=CLOSE_UNAUTHENTICATED)

    async def agent_rotate(self, event: dict) -> None:
        """Rotate the node's credential: the new one is made here and goes only down this socket."""
        secret = await _db(services.begin_rotation)(node_id=self.node_id)
        if secret is not None:
            await self.send_json(RotateCredential(node_secret=secret).to_json())

    async def agent_command(self, event: dict) -> None:
        """A command for this node from a service or task: forward it to the agent."""
        command = event["command"]
        self._beats.unsettle()  # a role started, stopped or realigned: the next report is acted on
        if command.get("type") == Generate.TAG:
            request_id, deployment = command["request_id"], command["deployment"]
            await asyncio.to_thread(owners.given, request_id, self.node_id, deployment)
            self.generations[request_id] = deployment
        try:
            await self.send_json(command)
        except OSError:  # the socket closed (uvicorn's ClientDisconnected): disconnect() still runs next
            log.warning(
                "node %s: its link closed before a %s command could go down it", self.node_id, command.get("type")
            )
            if command.get("type") == Generate.TAG:  # never reached the agent: nothing will come of it
                error = "the link to main's node closed before the request went down it"
                await self._fail_here(Failed(request_id=command["request_id"], error=error, retryable=True))

    async def _fail_here(self, failed: Failed) -> None:
        """End a generation given to this node whose request never went down its link, with ``failed``."""
        self.generations.pop(failed.request_id, None)
        await relay(self.channel_layer, failed)
        await asyncio.to_thread(owners.ended, failed.request_id)

    async def _relay_generation(self, event: GenerationEvent) -> None:
        request_id = event.request_id
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            log.warning("node %s sent an event for a request id of %d characters", self.node_id, len(request_id))
            return  # names no generation of the control plane's: neither relayed nor acknowledged
        try:
            deployment = self.generations.get(request_id) or await self._resumed(request_id)
        except owners.Unreachable as exc:  # not known now: kept by the agent, sent again on its next link
            log.warning("node %s: %s", self.node_id, exc)
            return
        if deployment is None:
            if request_id not in self._refused:
                log.warning("node %s sent an event for a generation it was not given", self.node_id)
            self._acknowledge(event)  # nothing to relay: the agent need not keep it either
            return
        if not isinstance(event, Token):
            del self.generations[request_id]
        await relay(self.channel_layer, event)
        self._acknowledge(event)
        if not isinstance(event, Token):
            await asyncio.to_thread(owners.ended, request_id)
        if isinstance(event, Token) and event.step is not None:
            step = {"deployment": deployment, "request_id": event.request_id, "index": event.index, "step": event.step}
            with contextlib.suppress(*UNREACHABLE):  # a console's live view misses one step: nothing else
                await self.channel_layer.group_send(STEPS_GROUP, {"type": "cluster.step", **step})

    async def _resumed(self, request_id: str) -> str | None:
        """The deployment of ``request_id`` if this node was given it on an earlier link (its agent
        sends again what that link did not see acknowledged), now relayed on this one. A request id
        refused once on this link is not looked up again (``_refused``, bounded)."""
        if request_id in self._refused:
            return None
        owner = await asyncio.to_thread(owners.owner, request_id)
        if owner is None or owner[0] != self.node_id:
            if len(self._refused) >= MAX_REFUSED:
                self._refused.clear()
            self._refused.add(request_id)
            return None
        self.generations[request_id] = owner[1]
        return owner[1]

    def _acknowledge(self, event: GenerationEvent) -> None:
        """Acknowledge ``event`` with the others that come within ``ACK_EVERY_S``."""
        request_id, index = event.request_id, event.index or 0
        self._acks[request_id] = max(index, self._acks.get(request_id, 0))
        if self._acker is None or self._acker.done():
            self._acker = asyncio.create_task(self._send_acks())

    async def _send_acks(self) -> None:
        while self._acks:  # those noted while one batch went out go in the next
            await asyncio.sleep(ACK_EVERY_S)
            acks, self._acks = list(self._acks.items()), {}
            for start in range(0, len(acks), MAX_ACKS):  # one message holds MAX_ACKS at most
                try:
                    await self.send_json(Acknowledge(acks=acks[start : start + MAX_ACKS]).to_json())
                except OSError:  # the link closed: the agent sends them again on its next one
                    return

    def _authenticate(self):
        headers = dict(self.scope.get("headers", []))
        scheme, _, value = headers.get(b"authorization", b"").decode(errors="replace").partition(" ")
        node_id, _, secret = value.strip().partition(":")
        if scheme != "Node" or not node_id or not secret:
            return None
        return services.authenticate_node(node_id=node_id, secret=secret)
