"""The control plane and Redis restart under a serving cluster, for real: nothing is lost.

One small cluster (uvicorn, a Celery worker with beat, 3 agents serving the tiny model) on a
Redis of its own, its agents linked through a proxy the test can cut, answers carried across
main's restart exactly. First, with 8 answers streaming (half greedy, half seeded), every agent's
link is cut at the TCP level: each answer ends whole, and equal to the same request's undisturbed
answer; then main's process is killed the same way, with the same outcome. Then, mid-job, the
ASGI server is stopped (SIGTERM) and Redis killed: it comes back empty, as after a crash between
snapshots, its queued tasks gone. Both start again on the same
ports. The agents reconnect by themselves, with backoff; no role process restarts; the
deployment serves the same greedy text as before; the job ends with every output done and
right; and the console shows each node's new link. Then two quick checks of the fixes this
needed, without a cluster.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest
import redis

from inference.runtime.textstream import load_tokenizer
from tests.controlplane.conftest import ServedOnOwnRedis
from tests.controlplane.link_cut import LinkCut
from tests.controlplane.live import SERVED_MODEL, Served, role_pids
from tests.controlplane.test_serving_e2e import MESSAGES, chat_prompt_ids, job_outputs, reference_text, wait_job

PROMPTS = ["Mixture of experts", "Route every token", "to a few experts", "on demand", "and evict them", "again"]
TOKENS = 12
DOWN_S = 2.0


def greedy_chat(served: Served) -> str:
    answer = served.client().chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, max_tokens=TOKENS, temperature=0
    )
    return answer.choices[0].message.content


STREAMS = 8
STREAM_TOKENS = 48


def streamed_answers(
    served: Served, fault: Callable[[], None] | None = None
) -> tuple[list[tuple[str, str]], list[int]]:
    """``STREAMS`` chat answers streamed at once, even ones greedy, odd ones seeded: each one's text and
    finish reason. With ``fault``, it is injected once each answer has shown two pieces (or ended); with
    it, how many pieces each had shown then."""
    client, shown = served.client(), [0] * STREAMS
    ended = [threading.Event() for _ in range(STREAMS)]

    def answer(i: int) -> tuple[str, str]:
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": 1000 + i}
        pieces, finish = [], ""
        try:
            chunks = client.chat.completions.create(
                model=SERVED_MODEL, messages=MESSAGES, max_tokens=STREAM_TOKENS, stream=True, **sampling
            )
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                    shown[i] += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
        finally:
            ended[i].set()
        return "".join(pieces), finish

    at_cut: list[int] = []
    with ThreadPoolExecutor(STREAMS) as pool:
        answers = [pool.submit(answer, i) for i in range(STREAMS)]
        if fault is not None:
            deadline = time.monotonic() + 120
            while not all(n >= 2 or e.is_set() for n, e in zip(shown, ended, strict=True)):
                assert time.monotonic() < deadline, shown
                time.sleep(0.005)
            at_cut = list(shown)
            fault()
        return [a.result() for a in answers], at_cut


def cut_every_link(link_cut: LinkCut) -> Callable[[], None]:
    def cut() -> None:
        assert link_cut.cut() >= 3  # main's, the shadow's and the worker's agent links

    return cut


def kill_main(state_root: Path) -> Callable[[], None]:
    def kill() -> None:
        (pid,) = [pid for spec, pid in role_pids(state_root).items() if spec.endswith("/main.spec.json")]
        os.kill(pid, signal.SIGKILL)

    return kill


def console_nodes(served: Served) -> dict[str, dict]:
    """The nodes as the console shows them (``/console/state.json``, for a logged-in staff member)."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    browser = Client()
    browser.force_login(get_user_model().objects.get(username="staff"))
    request = urllib.request.Request(f"{served.plane.server}/console/state.json")
    request.add_header("Cookie", f"sessionid={browser.cookies['sessionid'].value}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return {node["name"]: node for node in json.loads(response.read())["nodes"]}


@pytest.mark.slow
def test_agents_reconnect_and_nothing_is_lost_when_the_control_plane_and_redis_restart(
    served_on_own_redis: ServedOnOwnRedis,
) -> None:
    from controlplane.nodes.models import NodeTask
    from controlplane.serving.models import JobOutput, OutputStatus

    served, broker = served_on_own_redis.served, served_on_own_redis.redis
    plane, staff, alice = served.plane, served.plane.api, served.api(served.user_key)
    assert plane.link_cut is not None

    # Every agent link cut mid-answer: each of 8 answers in flight ends whole, token for token.
    undisturbed, _ = streamed_answers(served)
    through_the_cut, at_cut = streamed_answers(served, cut_every_link(plane.link_cut))
    assert through_the_cut == undisturbed, at_cut
    assert any(0 < n < STREAM_TOKENS for n in at_cut), at_cut  # the cut came mid-answer
    greedy = reference_text(served, chat_prompt_ids(served, MESSAGES), STREAM_TOKENS)
    assert {text for text, _ in undisturbed[::2]} == {greedy}
    assert {finish for _, finish in undisturbed} == {"length"}

    # Main's process killed mid-answer: its agent starts it again and replays each answer exactly
    # (the deployment's replay is exact): each of 8 answers in flight ends equal to the undisturbed one.
    through_the_restart, at_kill = streamed_answers(served, kill_main(plane.state_root))
    assert through_the_restart == undisturbed, at_kill
    assert any(0 < n < STREAM_TOKENS for n in at_kill), at_kill
    plane.wait_for("main ready again", lambda: staff.get("/api/deployments")["results"][0]["status"] == "ready", 60)

    before = greedy_chat(served)
    pids = role_pids(plane.state_root)
    assert len(pids) == 3, pids  # main, shadow, worker
    starts = NodeTask.objects.filter(kind="start_role").count()
    linked = {name: node["connected_at"] for name, node in console_nodes(served).items()}
    assert len(linked) == 3 and all(linked.values()), linked
    logs = {name: plane.group.log_dir / f"agent-{name}.log" for name in linked}

    body = {"model": SERVED_MODEL, "prompts": PROMPTS, "max_tokens": TOKENS, "temperature": 0}
    job = alice.post("/api/jobs", body, expect=201)
    wait_job(alice, job["id"], lambda j: j["status"] == "running")
    restart, logged = time.time(), {name: log.stat().st_size for name, log in logs.items()}
    plane.group.stop(next(c for c in plane.group.children if c.name == "asgi"))  # SIGTERM: every link drops
    broker.kill()  # Redis: the broker and the channel layer with it, queued tasks and all
    unfinished = JobOutput.objects.filter(job_id=job["id"]).exclude(status=OutputStatus.DONE).count()
    assert unfinished > 0, "the job ended before the restart"
    time.sleep(DOWN_S)
    broker.start()
    plane.start_server()

    # While the agents' backoff runs out: what every answer must be.
    tokenizer = load_tokenizer(served.model_dir)
    expected = [reference_text(served, tokenizer(prompt)["input_ids"], TOKENS) for prompt in PROMPTS]
    assert before == reference_text(served, chat_prompt_ids(served, MESSAGES), TOKENS)

    def back() -> bool:
        nodes = staff.get("/api/nodes")["results"]
        deployment = staff.get("/api/deployments")["results"][0]
        assert deployment["status"] != "failed", deployment["status_reason"]
        return len(nodes) == 3 and all(n["status"] == "online" for n in nodes) and deployment["status"] == "ready"

    plane.wait_for("the agents back online and the deployment ready", back, timeout_s=90)
    for name, log in logs.items():  # each agent retried by itself, with backoff: a few tries, not a tight loop
        since = log.read_bytes()[logged[name] :].decode(errors="replace")
        tries = since.count("; retrying")
        assert "link closed" in since and " is up" in since and 1 <= tries <= 10, (name, since)
    assert role_pids(plane.state_root) == pids  # no role process was restarted: they served on through it all
    assert NodeTask.objects.filter(kind="start_role").count() == starts  # nor sent again
    assert greedy_chat(served) == before

    # No job lost: its queued tasks went with Redis, its running ones with their links; all ran again.
    finished = wait_job(alice, job["id"], lambda j: j["status"] in ("succeeded", "failed"), timeout_s=120)
    assert finished["status"] == "succeeded", finished
    outputs = job_outputs(alice, job["id"])
    assert [o["status"] for o in outputs] == ["done"] * len(PROMPTS)
    assert [o["text"] for o in outputs] == expected

    # The console shows the reconnection: every node online again, on a link that came up after the restart.
    shown = console_nodes(served)
    assert {node["status"] for node in shown.values()} == {"online"}
    for name, node in shown.items():
        assert datetime.fromisoformat(node["connected_at"]).timestamp() > restart, (name, linked[name], node)


@pytest.mark.django_db
def test_unfinished_job_outputs_are_queued_again_once_after_redis_comes_back_empty(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uuid

    from django.contrib.auth import get_user_model

    from controlplane.config.celery_app import app
    from controlplane.serving import tasks
    from controlplane.serving.models import Job, JobOutput, JobStatus, OutputStatus

    owner = get_user_model().objects.create_user("alice")
    running = Job.objects.create(owner=owner, model_name="m", max_tokens=4, status=JobStatus.RUNNING)
    ended = Job.objects.create(owner=owner, model_name="m", max_tokens=4, status=JobStatus.CANCELLED)
    outputs = {
        status: JobOutput.objects.create(job=running, index=i, prompt="p", status=status)
        for i, status in enumerate(OutputStatus.values)
    }
    JobOutput.objects.create(job=ended, index=0, prompt="p", status=OutputStatus.QUEUED)
    sent = []
    monkeypatch.setattr(tasks.run_job_output_task, "delay", sent.append)
    monkeypatch.setattr(tasks, "BROKER_MARK", f"odmoe-test:{uuid.uuid4().hex}")  # as in a Redis that lost it
    try:
        assert tasks.recover_lost_jobs_task() == 2
        assert sorted(sent) == sorted([outputs[OutputStatus.QUEUED].pk, outputs[OutputStatus.RUNNING].pk])
        assert tasks.recover_lost_jobs_task() == 0  # the mark is there now: nothing was lost since
    finally:
        redis.Redis.from_url(redis_url).delete(tasks.BROKER_MARK)
    assert app.amqp.router.route({}, tasks.recover_lost_jobs_task.name)["queue"].name == "celery"  # not behind jobs


def test_a_command_for_a_link_that_just_closed_leaves_the_consumer_to_its_disconnect() -> None:
    """uvicorn raises ClientDisconnected (an OSError) on a send after the socket closed; had it left
    the consumer, ``disconnect`` would never run and the node would stay online with no link."""
    from asgiref.sync import async_to_sync
    from uvicorn.protocols.utils import ClientDisconnected

    from controlplane.nodes.consumers import AgentConsumer

    consumer = AgentConsumer()
    consumer.node_id = "n1"

    async def closed(message: dict) -> None:
        raise ClientDisconnected()

    consumer.base_send = closed
    async_to_sync(consumer.agent_command)({"type": "agent.command", "command": {"type": "ping", "nonce": "x"}})


def test_a_generation_for_a_link_that_just_closed_fails_at_once_as_retryable(channel_layer_on_test_redis) -> None:
    """A ``Generate`` that could not go down the link never reached the agent, which will send
    nothing for it after reconnecting: its caller hears so now, instead of waiting out a timeout."""
    import asyncio

    from asgiref.sync import async_to_sync
    from uvicorn.protocols.utils import ClientDisconnected

    from controlplane.nodes import owners
    from controlplane.nodes.consumers import AgentConsumer
    from controlplane.nodes.relay import listening
    from inference.wire.generation import Failed, Generate

    consumer = AgentConsumer()
    consumer.node_id, consumer.channel_layer = "n1", None

    async def closed(message: dict) -> None:
        raise ClientDisconnected()

    consumer.base_send = closed
    command = Generate(request_id="r-closed", deployment="dep1-1", prompt_ids=[1], max_new_tokens=2).to_json()

    async def session() -> object:
        with listening("r-closed") as inbox:
            await consumer.agent_command({"type": "agent.command", "command": command})
            return await asyncio.wait_for(inbox.get(), 5)

    failed = async_to_sync(session)()
    assert isinstance(failed, Failed) and failed.retryable and "before the request went down it" in failed.error
    assert consumer.generations == {} and owners.owner("r-closed") is None
