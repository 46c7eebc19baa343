"""The agent link on the control plane's side: one websocket per enrolled agent.

The agent opens it with its node credential in the ``Authorization`` header; anything
else is refused before the socket is accepted. Events are validated with
``agent.messages`` and each calls one service; commands for a node reach its socket
through the channel-layer group ``node.<id>`` (a ``{"type": "agent.command", ...}`` event).

Generation events are relayed to the group ``generation.<request_id>``, where the caller
of the generation service listens — and only for requests that went down this very socket,
so a node cannot speak for a generation it was not given.
"""

from __future__ import annotations

import logging

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from agent.messages import (
    EVENTS,
    GENERATION_EVENTS,
    CredentialSaved,
    Generate,
    GenerationToken,
    Heartbeat,
    MessageError,
    RoleState,
    RotateCredential,
    TaskDone,
    TaskProgress,
    parse,
)

from . import services

log = logging.getLogger(__name__)

CLOSE_UNAUTHENTICATED = 4401


def node_group(node_id: str) -> str:
    return f"node.{node_id}"


def generation_group(request_id: str) -> str:
    return f"generation.{request_id}"


# Every step of every generation, for live views of the pipeline (the console).
STEPS_GROUP = "cluster.steps"


class AgentConsumer(AsyncJsonWebsocketConsumer):
    node_id: str | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.generations: dict[str, str] = {}  # request id -> deployment, sent down this socket, not finished

    async def connect(self) -> None:
        node = await database_sync_to_async(self._authenticate)()
        if node is None:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.node_id = str(node.pk)
        await self.channel_layer.group_add(node_group(self.node_id), self.channel_name)
        await self.accept()
        log.info("agent of node %s connected", node.name)

    async def disconnect(self, code: int) -> None:
        if self.node_id is None:
            return
        await self.channel_layer.group_discard(node_group(self.node_id), self.channel_name)
        await database_sync_to_async(services.mark_offline)(node_id=self.node_id)

    async def receive_json(self, content, **kwargs) -> None:
        try:
            event = parse(content, allowed=EVENTS)
        except MessageError as exc:
            log.warning("node %s sent a bad message: %s", self.node_id, exc)
            await self.send_json({"type": "error", "detail": str(exc)})
            return
        if isinstance(event, GENERATION_EVENTS):
            await self._relay_generation(event)
        elif isinstance(event, Heartbeat):
            await database_sync_to_async(services.record_heartbeat)(
                node_id=self.node_id, inventory=event.inventory, roles=event.roles
            )
        elif isinstance(event, RoleState):
            await database_sync_to_async(services.record_runtime)(
                node_id=self.node_id, reports=[event.to_json()], complete=False
            )
        elif isinstance(event, TaskProgress):
            await database_sync_to_async(services.record_task_progress)(
                node_id=self.node_id, task_id=event.task_id, done=event.done, total=event.total
            )
        elif isinstance(event, CredentialSaved):
            await database_sync_to_async(services.confirm_rotation)(node_id=self.node_id)
        elif isinstance(event, TaskDone):
            await database_sync_to_async(services.record_task_done)(
                node_id=self.node_id, task_id=event.task_id, ok=event.ok, detail=event.detail
            )

    async def agent_revoked(self, event: dict) -> None:
        """The node was removed: its credential is gone, so is this link (the agent stops retrying)."""
        await self.close(code=CLOSE_UNAUTHENTICATED)

    async def agent_rotate(self, event: dict) -> None:
        """Rotate the node's credential: the new one is made here and goes only down this socket."""
        secret = await database_sync_to_async(services.begin_rotation)(node_id=self.node_id)
        if secret is not None:
            await self.send_json(RotateCredential(node_secret=secret).to_json())

    async def agent_command(self, event: dict) -> None:
        """A command for this node from a service or task: forward it to the agent."""
        command = event["command"]
        if command.get("type") == Generate.TYPE:
            self.generations[command["request_id"]] = command["deployment"]
        await self.send_json(command)

    async def _relay_generation(self, event) -> None:
        if event.request_id not in self.generations:
            log.warning("node %s sent an event for a generation it was not given", self.node_id)
            return
        deployment = self.generations[event.request_id]
        if not isinstance(event, GenerationToken):
            del self.generations[event.request_id]
        await self.channel_layer.group_send(
            generation_group(event.request_id), {"type": "generation.event", "event": event.to_json()}
        )
        if isinstance(event, GenerationToken) and event.step is not None:
            step = {"deployment": deployment, "request_id": event.request_id, "index": event.index, "step": event.step}
            await self.channel_layer.group_send(STEPS_GROUP, {"type": "cluster.step", **step})

    def _authenticate(self):
        headers = dict(self.scope.get("headers", []))
        scheme, _, value = headers.get(b"authorization", b"").decode(errors="replace").partition(" ")
        node_id, _, secret = value.strip().partition(":")
        if scheme != "Node" or not node_id or not secret:
            return None
        return services.authenticate_node(node_id=node_id, secret=secret)
