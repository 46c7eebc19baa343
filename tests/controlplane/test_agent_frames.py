"""No frame down an agent link is larger than its agent takes: the limit it announced when it
connected, or websockets' default 1 MiB for an agent that announced none. A command past it fails
alone, with the sizes, and the link goes on carrying the others."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import HttpCommunicator, WebsocketCommunicator
from django.contrib.auth import get_user_model

from controlplane.accounts.services import create_api_key
from controlplane.artifacts.services import register_model
from controlplane.config.asgi import application
from controlplane.deployments.generation import RequestTooLarge, astream, new_request
from controlplane.deployments.models import Deployment, DeploymentNode, DeploymentStatus, Role
from controlplane.nodes.models import Node, NodeTask, TaskState
from controlplane.nodes.services import create_join_token, enroll_node, send_command
from inference.wire.generation import Done
from inference.wire.link import (
    AGENT_PROTOCOL,
    FRAME_LIMIT_HEADER,
    LEGACY_FRAME_LIMIT,
    LINK_PATH,
    OLDEST_AGENT_PROTOCOL,
    PROTOCOL_HEADER,
    SERVER_FRAME_LIMIT_HEADER,
    MessageError,
    StartRole,
    frame_limit,
)

pytestmark = pytest.mark.django_db(transaction=True)

ANNOUNCED = 64 * 1024
# (protocol, the limit it announces, the limit it is held to): announcing it, and announcing nothing.
AGENTS = [(AGENT_PROTOCOL, str(ANNOUNCED), ANNOUNCED), (OLDEST_AGENT_PROTOCOL, None, LEGACY_FRAME_LIMIT)]


def agent_link(node: Node, secret: str, protocol: int, announced: str | None) -> WebsocketCommunicator:
    headers = [(b"authorization", f"Node {node.pk}:{secret}".encode())]
    headers.append((PROTOCOL_HEADER.lower().encode(), str(protocol).encode()))
    if announced is not None:
        headers.append((FRAME_LIMIT_HEADER.lower().encode(), announced.encode()))
    return WebsocketCommunicator(application, LINK_PATH, headers=headers)


@pytest.fixture
def main(tiny_model: Path) -> tuple[Deployment, Node, str]:
    """A ready deployment whose main is on a node this test's link speaks for."""
    _, token = create_join_token(created_by=None)
    node, secret = enroll_node(token=token, name="main-box", inventory={})
    deployment = Deployment.objects.create(
        name="d", model=register_model(name="tiny", path=str(tiny_model)), status=DeploymentStatus.READY
    )
    DeploymentNode.objects.create(deployment=deployment, node=node, role=Role.MAIN, port=9300)
    return deployment, node, secret


async def answer_one(comm: WebsocketCommunicator) -> dict:
    """Take the next command as main's agent would, and finish its generation."""
    command = await comm.receive_json_from(timeout=10)
    done = Done(request_id=command["request_id"], token_ids=[5, 6], finish_reason="length", metrics={})
    await comm.send_json_to(done.to_json())
    return command


async def commands_sent(comm: WebsocketCommunicator, within_s: float = 0.5) -> list[str]:
    """The types of the commands that came down the link within ``within_s``."""
    sent = []
    while not await comm.receive_nothing(timeout=within_s):
        sent.append((await comm.receive_json_from())["type"])
    return sent


def test_a_frame_limit_is_what_the_agent_announced_or_1_mib_and_nothing_else() -> None:
    assert frame_limit("16777216") == 16 * 2**20
    assert frame_limit(None) == LEGACY_FRAME_LIMIT == 2**20  # an agent that announces nothing: websockets' default
    for unusable in ("", "lots", "0", "-1", "1e9", "٣", "9" * 19):
        with pytest.raises(MessageError, match=FRAME_LIMIT_HEADER):
            frame_limit(unusable)


@pytest.mark.parametrize(("protocol", "announced", "limit"), AGENTS, ids=["announced", "announced-nothing"])
def test_a_generate_past_the_agents_frame_limit_fails_alone_and_the_link_carries_the_next(
    channel_layer_on_test_redis, main, protocol: int, announced: str | None, limit: int
) -> None:
    """Before, the control plane sent it anyway: the agent's websocket closed the link with 1009,
    and every generation on it failed."""
    deployment, node, secret = main
    too_large = new_request(prompt_ids=[1, 2], max_new_tokens=2, grammar="x" * limit)
    fits = new_request(prompt_ids=[1, 2], max_new_tokens=2, grammar="y" * (limit - 4096))

    async def session() -> tuple[str, dict, list, bool]:
        comm = agent_link(node, secret, protocol, announced)
        assert (await comm.connect())[0]
        with pytest.raises(RequestTooLarge) as refused:
            async for _ in astream(deployment.pk, too_large):
                pass
        nothing_sent = await comm.receive_nothing(timeout=0.5)
        answered = asyncio.ensure_future(answer_one(comm))
        events = [event async for event in astream(deployment.pk, fits)]
        command = await answered
        await comm.disconnect()
        return str(refused.value), command, events, nothing_sent and not refused.value.retryable

    reason, command, events, refused_alone = async_to_sync(session)()
    # The command as it went out: step reports are asked for while any console watches, and a console
    # test on another worker of the run may be watching (the mark is in the shared Redis).
    sizes = [
        len(json.dumps({**too_large.to_json(), "deployment": deployment.runtime_key, "step_reports": watched}))
        for watched in (False, True)
    ]
    assert any(f"the request takes {size} bytes" in reason for size in sizes), reason
    assert f"the {limit} bytes that node's agent takes" in reason
    assert refused_alone  # never sent down the link, and not worth trying again
    assert command["request_id"] == fits.request_id and len(command["grammar"]) == limit - 4096
    assert [type(e) for e in events] == [Done]


def test_the_issues_chat_completion_is_refused_at_the_edge_and_never_reaches_mains_link(
    channel_layer_on_test_redis, main
) -> None:
    """The issue's request, a 1.5 MB schema, to a main whose agent takes 1 MiB (one that announces nothing):
    the request's bounds (``serving.bounds``) refuse it before a Generate is built, so the frame check
    behind them (the tests above) is never needed for it, and the link carries nothing of it."""
    deployment, node, secret = main
    _, key = create_api_key(user=get_user_model().objects.create_user("bob"))
    schema = {"const": "x" * 1_500_000}
    body = {
        "model": deployment.name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}},
    }
    headers = [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {key}".encode())]
    headers.append((b"content-type", b"application/json"))

    async def session() -> tuple[dict, list[str], str]:
        comm = agent_link(node, secret, OLDEST_AGENT_PROTOCOL, None)
        assert (await comm.connect())[0]
        call = HttpCommunicator(application, "POST", "/v1/chat/completions", json.dumps(body).encode(), headers)
        response = await call.get_response(timeout=60)
        sent = await commands_sent(comm)
        status = await sync_to_async(lambda: Deployment.objects.get(pk=deployment.pk).status)()
        await comm.disconnect()
        return {"status": response["status"], **json.loads(response["body"])}, sent, status

    answer, sent, status = async_to_sync(session)()
    assert answer["status"] == 400
    assert sent == []  # nothing went down the link: no generate, and nothing to cancel
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format.json_schema.schema"
    assert "bytes as compact JSON, more than the" in error["message"]
    assert status == DeploymentStatus.READY  # its link stayed up


def test_the_control_plane_announces_the_most_a_frame_up_the_link_may_hold(
    channel_layer_on_test_redis, main, settings
) -> None:
    """The agent keeps what it sends up within it (``agent.frames``): past it the edge closes the link."""
    _, node, secret = main

    async def accepted() -> dict:
        comm = agent_link(node, secret, AGENT_PROTOCOL, str(ANNOUNCED))
        await comm.send_input({"type": "websocket.connect"})
        answer = await comm.receive_output(timeout=10)
        await comm.disconnect()
        return answer

    answer = async_to_sync(accepted)()
    assert answer["type"] == "websocket.accept"
    assert (
        dict(answer["headers"])[SERVER_FRAME_LIMIT_HEADER.lower().encode()] == str(settings.MAX_REQUEST_BYTES).encode()
    )


def test_a_role_start_past_the_frame_limit_fails_its_task_with_the_sizes(channel_layer_on_test_redis, main) -> None:
    _, node, secret = main
    task = NodeTask.objects.create(node=node, kind="start_role", params={})
    spec = {"role": "main", "padding": "z" * ANNOUNCED}
    command = StartRole(task_id=str(task.pk), deployment="d1-1", model_id=1, shard="main", spec=spec, client_keys={})

    async def session() -> bool:
        comm = agent_link(node, secret, AGENT_PROTOCOL, str(ANNOUNCED))
        assert (await comm.connect())[0]
        await sync_to_async(send_command)(node_id=str(node.pk), command=command.to_json())
        nothing_sent = await comm.receive_nothing(timeout=1)
        for _ in range(100):  # the task's end is written in the background, as the agent's would be
            if await sync_to_async(lambda: NodeTask.objects.get(pk=task.pk).state)() == TaskState.FAILED:
                break
            await asyncio.sleep(0.05)
        await comm.disconnect()
        return nothing_sent

    assert async_to_sync(session)()
    task.refresh_from_db()
    assert task.state == TaskState.FAILED
    assert "the start_role command takes" in task.detail and f"the {ANNOUNCED} bytes that node's agent" in task.detail
