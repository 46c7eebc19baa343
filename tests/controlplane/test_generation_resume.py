"""A generation's caller through a dropped agent link (``generation.astream``): each token once, in
order, though main's agent sends some again on its next link; a gap or a link that never comes back
is an error the same request may retry."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator

from controlplane.artifacts.services import register_model
from controlplane.console.snapshot import snapshot
from controlplane.deployments import generation
from controlplane.deployments.models import (
    AnswerPause,
    Deployment,
    DeploymentNode,
    DeploymentStatus,
    MemberState,
    Role,
)
from controlplane.nodes.models import Node
from controlplane.serving import metrics
from inference.wire.generation import Done, Token
from tests.controlplane.test_agent_link import communicator, enrolled

pytestmark = pytest.mark.django_db(transaction=True)
NAMES = ("link_pauses", "resent_tokens")


@pytest.fixture
def served(tiny_model: Path, channel_layer_on_test_redis) -> tuple[Deployment, Node, str]:
    model = register_model(name="tiny", path=str(tiny_model))
    deployment = Deployment.objects.create(name="d", model=model, status=DeploymentStatus.READY)
    node, secret = enrolled("main")
    DeploymentNode.objects.create(deployment=deployment, node=node, role=Role.MAIN, state=MemberState.READY)
    return deployment, node, secret


async def link(node: Node, secret: str) -> WebsocketCommunicator:
    comm = communicator(f"Node {node.pk}:{secret}")
    assert (await comm.connect())[0]
    return comm


async def caller(deployment: Deployment, request_id: str, into: list) -> None:
    request = generation.new_request(request_id=request_id, prompt_ids=[1, 2], max_new_tokens=4)
    try:
        async for event in generation.astream(deployment.pk, request):
            into.append(event)
    except generation.ClusterGenerationError as exc:
        into.append(exc)


def token(index: int) -> dict:
    return Token(request_id="r1", index=index, token_id=10 + index).to_json()


def test_tokens_sent_again_on_the_next_link_reach_the_caller_once(served) -> None:
    deployment, node, secret = served

    async def session() -> list:
        events: list = []
        comm = await link(node, secret)
        streaming = asyncio.create_task(caller(deployment, "r1", events))
        assert (await comm.receive_json_from(timeout=5))["type"] == "generate"
        for index in (0, 1):
            await comm.send_json_to(token(index))
        await comm.disconnect()
        await asyncio.sleep(0.2)
        again = await link(node, secret)
        for index in (0, 1, 2, 3):  # what was not acknowledged, and the rest
            await again.send_json_to(token(index))
        done = Done(request_id="r1", token_ids=[10, 11, 12, 13], finish_reason="length", metrics={}, index=4)
        await again.send_json_to(done.to_json())
        await asyncio.wait_for(streaming, 10)
        await again.disconnect()
        return events

    events = async_to_sync(session)()
    assert [e.index for e in events[:-1]] == [0, 1, 2, 3] and isinstance(events[-1], Done)
    cost = events[-1].metrics["link"]  # the answer says what it cost: one pause, after its 2 tokens
    assert (cost["pauses"], cost["resent_tokens"], cost["paused_at"]) == (1, 2, [2])
    (paused_ms,) = cost["paused_ms"]
    assert paused_ms >= 200  # from the last token before the link closed to the first new one
    (pause,) = AnswerPause.objects.filter(request_id="r1")  # and the console lists it
    assert (pause.cause, pause.at_token, pause.paused_ms, pause.deployment_id) == (
        "main_link",
        2,
        paused_ms,
        deployment.pk,
    )
    assert pause.detail == "2 token(s) sent again"
    assert snapshot()["pauses"][0]["cause_label"] == "main's agent link closed"

    before = [metrics.REGISTRY.get_sample_value(f"odmoe_{n}_total", {"api": "chat"}) or 0 for n in NAMES]
    metrics.record("chat", ok=True, prompt_tokens=2, metrics=events[-1].metrics)
    after = [metrics.REGISTRY.get_sample_value(f"odmoe_{n}_total", {"api": "chat"}) for n in NAMES]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 2]  # and Prometheus counts it


def test_prometheus_counts_the_restarts_of_main_an_answer_was_carried_across() -> None:
    name = "odmoe_main_restarts_carried_total"
    before = metrics.REGISTRY.get_sample_value(name, {"api": "jobs"}) or 0
    carried = {"main_restarts": {"count": 1, "resumed_at": [5]}}
    metrics.record("jobs", ok=True, prompt_tokens=2, metrics=carried)
    assert metrics.REGISTRY.get_sample_value(name, {"api": "jobs"}) - before == 1


def test_a_gap_in_the_tokens_is_a_retryable_error(served) -> None:
    deployment, node, secret = served

    async def session() -> list:
        events: list = []
        comm = await link(node, secret)
        streaming = asyncio.create_task(caller(deployment, "r1", events))
        await comm.receive_json_from(timeout=5)
        for index in (0, 2):
            await comm.send_json_to(token(index))
        await asyncio.wait_for(streaming, 10)
        await comm.disconnect()
        return events

    first, error = async_to_sync(session)()
    assert first.index == 0 and isinstance(error, generation.ClusterGenerationError) and error.retryable
    assert "tokens 1 to 1 of the generation never came" in str(error)


def test_a_link_that_does_not_come_back_in_time_is_a_retryable_error(served, monkeypatch) -> None:
    deployment, node, secret = served
    monkeypatch.setattr(generation, "NEXT_EVENT_TIMEOUT_S", 0.5)

    async def session() -> list:
        events: list = []
        comm = await link(node, secret)
        streaming = asyncio.create_task(caller(deployment, "r1", events))
        await comm.receive_json_from(timeout=5)
        await comm.send_json_to(token(0))
        await comm.disconnect()
        await asyncio.wait_for(streaming, 10)
        return events

    first, error = async_to_sync(session)()
    assert first.index == 0 and isinstance(error, generation.ClusterGenerationError) and error.retryable
    assert "the link to main's node closed mid-generation" in str(error)
