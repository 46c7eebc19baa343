"""Generate through the cluster: send a request to a deployment's main node, yield tokens as they come.

The request (``inference.wire.generation.Generate``) goes down the main node's agent link; the
agent hands it to main and sends main's events (``Token``, ``Done``, ``Failed``) back up as they
are, and the link's consumer relays them to ``astream`` (``controlplane.nodes.relay``: straight
to its queue when the link is in this process, else through the channel-layer group
``generation.<request_id>``, which ``astream`` reads into the same queue). ``stream`` is the same for
synchronous callers (Celery tasks, views): it runs ``astream`` on its own event loop in a
thread and hands events over through a queue.

Every generation's tokens are counted here, the one place all of them pass (the OpenAI API,
the chat, jobs, the operator's generate call), to the ``caller`` it is given
(``accounts.usage``): when main reports the end, its prompt and generated tokens; when it
ends otherwise after main started it (the client went away, a failure), the prompt and the
tokens that came.

**Why a listener is stopped with a message, never cancelled.** Every receive on the channel layer
in one process shares one pop from Redis at a time (channels_redis hands each popped message to
the buffer of the channel it is for), and a receive cancelled during its pop loses what the pop
takes from Redis, whichever of the process's channels it was for (channels_redis#366): a
``Generate`` on its way to main's agent link, another request's events. Cancelling each
generation's listener at its end did that under load: on the demo cluster, one user keeping 65
requests going, 5 of 4,105 ``Generate`` commands in 150 s never reached the agent and their
callers (another user's too) failed after ``FIRST_EVENT_TIMEOUT_S`` with "no answer from the
cluster". So ``stop_listening`` sends the listener's own channel ``STOP`` and waits for it to
return; a cancel is left for a layer that cannot take the message (Redis gone).

**A dropped agent link is a pause.** Main's agent keeps what the control plane has not acknowledged
and sends it again on its next link (``agent.outbox``), so a token may come twice: ``astream`` takes
each token once, by its index. Meanwhile it waits as for any next event; a timeout after the link
closed (``relay.LinkPaused``) is one the same request may retry. The answer's metrics say what each
pause cost (``link``), and the console lists it (``pauses``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from channels import DEFAULT_CHANNEL_LAYER
from channels.db import database_sync_to_async
from channels.layers import BaseChannelLayer, channel_layers, get_channel_layer

from controlplane.accounts.services import record_usage
from controlplane.accounts.usage import Caller
from controlplane.channel_layer import waiting_for_redis
from controlplane.database_away import waiting_for_the_database
from controlplane.nodes import step_watch
from controlplane.nodes.groups import generation_group, node_group
from controlplane.nodes.relay import PAUSED, LinkPaused, listening
from controlplane.shared_redis import UNREACHABLE
from inference.wire.generation import GENERATION_EVENTS, Done, Failed, Generate, Token
from inference.wire.link import CancelGeneration, parse

from . import pauses
from .models import RUNNING, Deployment, DeploymentNode, DeploymentStatus, MemberState, Role

FIRST_EVENT_TIMEOUT_S = 120.0  # prefill and a queue behind other generations
NEXT_EVENT_TIMEOUT_S = 60.0
STOP = "generation.stop"  # what ends a generation's listener (stop_listening)
STOP_TIMEOUT_S = 10.0  # twice channels_redis's pop timeout: past it the listener is cancelled after all
# How main ends a generation (inference.runtime.roles.main). Another value is a broken or hostile main's:
# it would reach API clients, and PostgreSQL refuses what is longer than JobOutput.finish_reason.
FINISH_REASONS = ("stop", "length", "cancelled")

log = logging.getLogger(__name__)


class ClusterUnavailable(RuntimeError):
    """No ready deployment can take the request; the message says why."""


class ClusterGenerationError(RuntimeError):
    """The cluster could not finish the generation; the message is the runtime's reason.

    ``retryable``: the same request can succeed shortly (main is being restarted).
    """

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class ClusterBusy(ClusterGenerationError):
    """Main's batch and queue were full: the generation never started; the same request can
    succeed once others end (the OpenAI API answers 429 ``deployment_busy`` with Retry-After)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


class TooManyGenerations(ClusterGenerationError):
    """The user already had the most generations one user may have in main at once (the
    deployment's ``max_per_user``, running and waiting): this one never started; it can once
    one of theirs ends (the OpenAI API answers 429 ``too_many_generations`` with Retry-After)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


class RequestTooLarge(ClusterGenerationError):
    """The request is larger than a frame main's node takes (its agent's announced limit): it never
    went out, and the same request fails again (the OpenAI API answers 400 ``request_too_large``)."""


def new_request(**fields: Any) -> Generate:
    """A generation to send to a deployment, under a fresh request id unless ``fields`` name one
    (``astream`` fills in the deployment's runtime key)."""
    return Generate(**{"request_id": uuid.uuid4().hex, **fields})


def can_serve(deployment: Deployment) -> bool:
    """Ready, or degraded with main ready: main serves around a lost worker or shadow (inference.policies.failover)."""
    if deployment.status == DeploymentStatus.READY:
        return True
    if deployment.status != DeploymentStatus.DEGRADED:
        return False
    return deployment.members.filter(role=Role.MAIN, state=MemberState.READY).exists()


def _target(deployment_id: int) -> tuple[str, str, str]:
    """(main's node id, the runtime key, the name) of a deployment that can serve now."""
    deployment = Deployment.objects.filter(pk=deployment_id).first()
    if deployment is None:
        raise ClusterUnavailable(f"no deployment {deployment_id}")
    main = deployment.members.filter(role=Role.MAIN).first()
    if main is None or not can_serve(deployment):
        reason = f": {deployment.status_reason}" if deployment.status_reason else ""
        raise ClusterUnavailable(f"deployment {deployment.name} is {deployment.status}{reason}")
    return str(main.node_id), deployment.runtime_key, deployment.name


def main_node(deployment_id: int) -> str:
    """Main's node of a running deployment (ready or not: a cancel must get through a degraded one)."""
    member = DeploymentNode.objects.filter(
        deployment_id=deployment_id, deployment__status__in=RUNNING, role=Role.MAIN
    ).first()
    if member is None:
        raise ClusterUnavailable(f"deployment {deployment_id} is not running")
    return str(member.node_id)


async def astream(
    deployment_id: int,
    request: Generate,
    *,
    caller: Caller | None = None,
    layer: BaseChannelLayer | None = None,
) -> AsyncIterator[Token | Done]:
    """Tokens as main produces them, then the result with its metrics; raises on failure.

    The tokens are counted to ``caller`` before the result is handed on (None: to nobody, for
    the platform's own checks).
    """
    node_id, key, name = await waiting_for_the_database(_target, deployment_id)  # PostgreSQL restarting: waited
    # Step reports only while a console shows them: they are most of a token's bytes on every hop.
    # Read before the group is joined: nothing between the join and its ``finally`` may be left.
    step_reports = await step_watch.watched()
    layer = layer or get_channel_layer()
    channel = await layer.new_channel()
    group = generation_group(request.request_id)
    await waiting_for_redis(layer.group_add, group, channel, repeatable=True)
    command = msgspec.structs.replace(request, deployment=key, step_reports=step_reports)
    generated: int | None = None  # tokens so far, once main started the generation
    with listening(request.request_id) as inbox:
        from_layer = asyncio.create_task(_from_layer(layer, channel, group, inbox))
        try:
            # Not tried again once Redis may have taken it: main would refuse a second as already running.
            command_message = {"type": "agent.command", "command": command.to_json()}
            await waiting_for_redis(layer.group_send, node_group(node_id), command_message)
            timeout, paused = FIRST_EVENT_TIMEOUT_S, False
            link = _LinkPauses()
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        event = await inbox.get()
                except TimeoutError:
                    if paused:
                        raise ClusterGenerationError(
                            f"the link to main's node closed mid-generation and no answer came within {timeout:.0f} s",
                            retryable=True,
                        ) from None
                    raise ClusterGenerationError(f"no answer from the cluster within {timeout:.0f} s") from None
                if isinstance(event, LinkPaused):
                    paused = True  # the same wait: its agent sends the rest on its next link
                    link.closed(generated or 0)
                    continue
                timeout, paused = NEXT_EVENT_TIMEOUT_S, False
                if isinstance(event, Exception):
                    raise event
                if isinstance(event, Token) and event.index < (generated or 0):
                    link.resent_tokens += 1
                    continue  # sent again after the link came back: had it
                _check_event(event, generated or 0)
                link.came()
                if isinstance(event, Done):
                    generated = None
                    await _count(caller, name, len(request.prompt_ids), len(event.token_ids))
                    if link.pauses:
                        event = msgspec.structs.replace(event, metrics={**event.metrics, "link": link.metrics()})
                    await pauses.note(deployment_id, request.request_id, event.metrics)
                    yield event
                    return
                generated = (generated or 0) + 1
                yield event
        finally:
            await stop_listening(layer, channel, from_layer)
            if generated is not None:  # ended before main's result, after main started: what came
                await _count(caller, name, len(request.prompt_ids), generated)
            with contextlib.suppress(*UNREACHABLE):  # Redis away: the group expires by itself
                await layer.group_discard(group, channel)


@dataclass
class _LinkPauses:
    """What main's link closing cost the answer (its ``link`` metrics): its pauses, the tokens sent again."""

    pauses: int = 0
    resent_tokens: int = 0
    paused_at: list[int] = field(default_factory=list)  # the tokens generated when each pause began
    # Each pause in ms, from the last event before the link closed to the first new one after.
    paused_ms: list[float] = field(default_factory=list)
    last_at: float = field(default_factory=time.monotonic)  # when the last new event came
    paused_since: float | None = None  # when the pause under way began (its last event); None: no pause

    def closed(self, generated: int) -> None:
        """Note the link closing after ``generated`` tokens."""
        if self.paused_since is None:  # the link may close again before anything new came: one pause
            self.pauses += 1
            self.paused_since = self.last_at
            self.paused_at.append(generated)

    def came(self) -> None:
        """Note a new event: it ends the pause under way, if any."""
        self.last_at = time.monotonic()
        if self.paused_since is not None:
            self.paused_ms.append(round((self.last_at - self.paused_since) * 1000, 1))
            self.paused_since = None

    # One key per line, alike building/memory.py's MemoryPlan.to_dict by shape only.
    def metrics(self) -> dict[str, Any]:
        """The answer's ``link`` metrics."""
        return {
            "pauses": self.pauses,
            "resent_tokens": self.resent_tokens,
            "paused_at": self.paused_at,
            "paused_ms": self.paused_ms,
        }


def _check_event(event: Token | Done | Failed, generated: int) -> None:
    """Raise what ``event`` shows went wrong: tokens missed before it, main's failure, an unknown finish reason."""
    if isinstance(event, Token | Done) and (event.index or 0) > generated:
        raise ClusterGenerationError(
            f"tokens {generated} to {event.index - 1} of the generation never came", retryable=True
        )
    if isinstance(event, Failed):
        if event.too_many_generations:
            raise TooManyGenerations(event.error)
        if event.busy:
            raise ClusterBusy(event.error)
        if event.too_large:
            raise RequestTooLarge(event.error)
        raise ClusterGenerationError(event.error, retryable=event.retryable)
    if isinstance(event, Done) and event.finish_reason not in FINISH_REASONS:
        reason = f"{event.finish_reason!r:.40}"
        raise ClusterGenerationError(f"main ended the generation with an unknown finish reason {reason}")


async def _from_layer(layer: BaseChannelLayer, channel: str, group: str, inbox: asyncio.Queue) -> None:
    """Put the events that come through the channel layer (main's link is in another process)
    into ``inbox``, each parsed and checked; what cannot be read goes in as the error, and ends it.
    Returns on ``STOP`` (``stop_listening``). A Redis restart is waited out when Redis kept its data
    (``channel_layer``); one that lost it, or Redis away past ``SEND_WAIT_S``, ends the generation as
    one the caller may ask again."""
    receive = getattr(layer, "receive_or_raise", layer.receive)
    while True:
        try:
            message = await receive(channel)
        except UNREACHABLE as exc:
            log.warning("a generation's listener lost Redis (%s): it waits for it", exc)
            try:
                kept = await waiting_for_redis(layer.in_group, group, channel, repeatable=True)
            except UNREACHABLE as again:
                kept, exc = False, again
            if kept:
                continue
            error = f"the channel layer's Redis restarted and this generation's events may be lost ({exc})"
            inbox.put_nowait(ClusterGenerationError(error, retryable=True))
            return
        try:
            if message.get("type") == STOP:
                return
            if message.get("type") == PAUSED:
                inbox.put_nowait(LinkPaused(str(message.get("request_id", ""))))
                continue
            inbox.put_nowait(parse(message["event"], allowed=GENERATION_EVENTS))
        except Exception as exc:  # a malformed event: the stream ends with it
            inbox.put_nowait(exc)
            return


async def stop_listening(layer: BaseChannelLayer, channel: str, listener: asyncio.Task) -> None:
    """End ``listener`` (``_from_layer`` on ``channel``) without cancelling it mid-pop (the module's
    docstring says why): its channel gets ``STOP``, and it returns when that comes."""
    if not listener.done():
        try:
            await layer.send(channel, {"type": STOP})
            await asyncio.wait_for(asyncio.shield(listener), STOP_TIMEOUT_S)
        except Exception:  # Redis gone, or the stop lost: nothing is left to lose by cancelling
            log.warning("a generation's listener on %s did not stop by itself; cancelled", channel)
    listener.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await listener


async def _count(caller: Caller | None, deployment: str, prompt_tokens: int, completion_tokens: int) -> None:
    """Add a generation's tokens to ``caller``'s usage. A database that refuses is logged, not raised:
    the generation is done and its answer still goes out."""
    if caller is None:
        return
    try:
        await database_sync_to_async(record_usage, thread_sensitive=False)(
            caller=caller, deployment=deployment, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
        )
    except Exception:
        log.exception(
            "the usage of %s on %s (%d + %d tokens) was not recorded",
            caller,
            deployment,
            prompt_tokens,
            completion_tokens,
        )


async def acancel(deployment_id: int, request_id: str) -> None:
    """Stop a generation after its current step; it ends with finish_reason "cancelled"."""
    node_id = await database_sync_to_async(main_node, thread_sensitive=False)(deployment_id)
    command = CancelGeneration(request_id=request_id).to_json()
    await get_channel_layer().group_send(node_group(node_id), {"type": "agent.command", "command": command})


def stream(deployment_id: int, request: Generate, *, caller: Caller | None = None) -> Iterator[Token | Done]:
    """``astream`` for synchronous code."""
    events: queue.Queue = queue.Queue()
    end = object()

    async def pump() -> None:
        # A layer of its own: one channel layer cannot receive on two event loops.
        layer = channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)
        try:
            async for event in astream(deployment_id, request, caller=caller, layer=layer):
                events.put(event)
        except Exception as exc:  # handed to the caller's thread, re-raised there
            events.put(exc)
        finally:
            events.put(end)
            if hasattr(layer, "close_pools"):
                await layer.close_pools()

    thread = threading.Thread(target=asyncio.run, args=(pump(),), name=f"generation-{request.request_id}", daemon=True)
    thread.start()
    while (item := events.get()) is not end:
        if isinstance(item, Exception):
            raise item
        yield item
    thread.join()


def generate(deployment_id: int, request: Generate, *, caller: Caller | None = None) -> Done:
    """The whole generation (synchronous)."""
    for event in stream(deployment_id, request, caller=caller):
        if isinstance(event, Done):
            return event
    raise ClusterGenerationError("the cluster ended the generation without a result")


def cancel(deployment_id: int, request_id: str) -> None:
    asyncio.run(acancel(deployment_id, request_id))
