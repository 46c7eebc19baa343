"""What comes from agents and models is written on PostgreSQL as on SQLite.

PostgreSQL refuses a NUL in text and ``\\u0000`` in jsonb, and a value longer than its
varchar; SQLite keeps them all. Each test here failed on PostgreSQL (a DataError, the write
lost) before ``controlplane.storable`` and the finish-reason check, and passes on both.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator

from controlplane.artifacts.services import register_model
from controlplane.config.asgi import application
from controlplane.deployments.models import Deployment, DeploymentNode, DeploymentStatus, MemberState, Role
from controlplane.nodes.models import Node, NodeTask, TaskState
from controlplane.nodes.services import create_join_token, enroll_node
from controlplane.storable import REPLACEMENT, storable_json, storable_text
from inference.wire.generation import Done
from inference.wire.link import AGENT_PROTOCOL, LINK_PATH, PROTOCOL_HEADER, RoleState, TaskDone

R = REPLACEMENT


def enrolled(name: str = "box") -> tuple[Node, str]:
    _, token = create_join_token(created_by=None)
    return enroll_node(token=token, name=name, inventory={})


def link(node: Node, secret: str) -> WebsocketCommunicator:
    """The node's agent link, as an agent of this protocol opens it."""
    headers = [(PROTOCOL_HEADER.lower().encode(), str(AGENT_PROTOCOL).encode())]
    headers.append((b"authorization", f"Node {node.pk}:{secret}".encode()))
    return WebsocketCommunicator(application, LINK_PATH, headers=headers)


def test_nul_and_lone_surrogates_become_the_replacement_character_and_nothing_else_changes() -> None:
    assert storable_text("a\x00b\ud800c") == f"a{R}b{R}c"
    assert storable_text("plain ü 漢 🙂") == "plain ü 漢 🙂"
    value = {"k\x00": ["x\x00", 1, 2.5, None, True, {"\udfff": "ok"}], "n": 3}
    assert storable_json(value) == {f"k{R}": [f"x{R}", 1, 2.5, None, True, {R: "ok"}], "n": 3}


@pytest.mark.django_db(transaction=True)
def test_an_agents_nul_in_a_task_or_a_role_report_is_recorded(channel_layer_on_test_redis, tiny_model: Path) -> None:
    node, secret = enrolled()
    task = NodeTask.objects.create(node=node, kind="fetch_shard", params={})
    deployment = Deployment.objects.create(
        name="d", model=register_model(name="tiny", path=str(tiny_model)), status=DeploymentStatus.DEPLOYING, epoch=1
    )
    member = DeploymentNode.objects.create(deployment=deployment, node=node, role=Role.MAIN, port=9300)
    failed = RoleState(
        deployment=deployment.runtime_key,
        role="main",
        role_name="main",
        state=MemberState.FAILED,
        detail="CUDA error\x00",
        metrics={"recall": "x\x00"},
    )

    async def session() -> None:
        comm = link(node, secret)
        assert (await comm.connect())[0]
        await comm.send_json_to(TaskDone(task_id=str(task.pk), ok=False, detail="disk full\x00\x00").to_json())
        await comm.send_json_to(failed.to_json())
        await comm.disconnect()  # what the agent said is written before its link's close is handled

    async_to_sync(session)()
    task.refresh_from_db()
    assert (task.state, task.detail) == (TaskState.FAILED, f"disk full{R}{R}")
    member.refresh_from_db()
    assert (member.state, member.detail, member.metrics) == (MemberState.FAILED, f"CUDA error{R}", {"recall": f"x{R}"})


@pytest.mark.django_db
def test_a_generated_nul_is_kept_in_a_chat_answer_and_a_job_output(tiny_model: Path) -> None:
    from django.contrib.auth import get_user_model

    from controlplane.chat import services as chat
    from controlplane.chat.models import Message, MessageStatus
    from controlplane.serving.completions import CompletionResult
    from controlplane.serving.jobs import record_result
    from controlplane.serving.models import Job, JobOutput, OutputStatus

    user = get_user_model().objects.create_user("alice")
    _, answer, _ = chat.start_turn(user=user, conversation_id=None, content="say a NUL")
    chat.finish_answer(answer_id=answer.pk, content="a\x00b", status=MessageStatus.COMPLETE, error="late\x00")
    answer.refresh_from_db()
    assert (answer.content, answer.error) == (f"a{R}b", f"late{R}")

    job = Job.objects.create(owner=user, model_name="tiny", max_tokens=4)
    output = JobOutput.objects.create(job=job, index=0, prompt="say a NUL")
    result = CompletionResult(text="\x00!", token_ids=[0, 1], finish_reason="length", prompt_tokens=3, metrics={})
    record_result(output_id=output.pk, result=result)
    output.refresh_from_db()
    assert (output.status, output.text, output.finish_reason) == (OutputStatus.DONE, f"{R}!", "length")
    assert Message.objects.filter(content__contains=R).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_finish_reason_main_never_sends_fails_the_generation(channel_layer_on_test_redis, tiny_model: Path) -> None:
    from controlplane.deployments.generation import ClusterGenerationError, astream, new_request

    node, secret = enrolled()
    deployment = Deployment.objects.create(
        name="d", model=register_model(name="tiny", path=str(tiny_model)), status=DeploymentStatus.READY
    )
    DeploymentNode.objects.create(deployment=deployment, node=node, role=Role.MAIN, port=9300)

    async def session() -> str:
        comm = link(node, secret)
        assert (await comm.connect())[0]
        request = new_request(prompt_ids=[1, 2], max_new_tokens=2)
        # The first event is awaited in the background: it sends the command down the link first.
        first = asyncio.ensure_future(astream(deployment.pk, request).__anext__())
        command = await comm.receive_json_from(timeout=10)
        assert command["type"] == "generate" and command["request_id"] == request.request_id
        done = Done(request_id=request.request_id, token_ids=[5], finish_reason="x" * 40, metrics={})
        await comm.send_json_to(done.to_json())
        try:
            await first
        except ClusterGenerationError as exc:
            return str(exc)
        finally:
            await comm.disconnect()
        return "no error"

    assert async_to_sync(session)() == "main ended the generation with an unknown finish reason '" + "x" * 39
