"""What users touch, against a real cluster: the OpenAI-compatible API with the official client,
and the jobs API run by a real Celery worker that restarts mid-job.

Each test starts its own small cluster (uvicorn, a Celery worker, 3 agents: main, shadow,
one worker; or 2 without a shadow) serving the tiny model, and runs several checks against it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks import openai_concurrency
from controlplane.accounts.models import ApiKey
from controlplane.serving.parameters import CHAT, COMPLETIONS, RESPONSES, Support
from controlplane.serving.text import tokenizer_for
from inference.runtime.textstream import load_tokenizer
from tests.controlplane import openai_schema
from tests.controlplane.live import SERVED_MODEL, TASK_REDELIVERY_S, Api, Served
from tests.reference import PROMPTS, reference_generate

pytestmark = pytest.mark.slow
MODEL = SERVED_MODEL


def reference_text(served: Served, prompt_ids: list[int], tokens: int) -> str:
    tokenizer = load_tokenizer(served.model_dir)
    return tokenizer.decode(reference_generate(served.model_dir, prompt_ids, tokens), skip_special_tokens=True)


def chat_prompt_ids(served: Served, messages: list[dict]) -> list[int]:
    from controlplane.serving.text import encode_chat, tokenizer_for

    return encode_chat(tokenizer_for(served.model_dir), messages)


MESSAGES = [{"role": "user", "content": "Which experts does this token need?"}]


def check_openai_text(served: Served) -> None:
    client = served.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = reference_text(served, chat_prompt_ids(served, MESSAGES), 12)
    assert whole.choices[0].message.content == streamed == expected
    assert whole.choices[0].finish_reason == "length"
    prompt_tokens = len(chat_prompt_ids(served, MESSAGES))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 12)
    assert chunks[-1].usage.total_tokens == prompt_tokens + 12
    # The same prompt again: main's prefix cache held the first answer's blocks (16 tokens each).
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # it really streamed

    text = client.completions.create(model=MODEL, prompt="Mixture of experts", max_tokens=8, temperature=0)
    tokenizer = load_tokenizer(served.model_dir)
    assert text.choices[0].text == reference_text(served, tokenizer("Mixture of experts")["input_ids"], 8)


def check_prefix_cache_per_tenant(served: Served) -> None:
    """Issue 51: bob sending alice's prompt was told how much of it main's cache held
    (``cached_tokens``), so he could confirm guesses of it 16 tokens at a time. Now each user's
    prompts reuse only their own blocks, or those of a namespace staff granted both their keys."""
    alice, bob = served.client(served.user_key), served.client(served.other_key)
    memo = [1, *range(300, 345)]  # token ids: a guess of them is exact
    reusable = (len(memo) - 1) // 16 * 16
    ask = dict(model=MODEL, prompt=memo, max_tokens=4, temperature=0)
    first = alice.completions.create(**ask)
    guess = bob.completions.create(**ask)
    again = alice.completions.create(**ask)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert guess.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == reusable
    assert guess.choices[0].text == first.choices[0].text  # prefilled whole, as alice's first was
    # A namespace staff granted both keys (the admin, or create_api_key --prefix-namespace): shared.
    keys = ApiKey.objects.filter(user__username__in=("alice", "bob"))
    keys.update(prefix_namespace="support-bot")
    try:
        system_prompt = [1, *range(350, 395)]
        alice.completions.create(**{**ask, "prompt": system_prompt})
        shared = bob.completions.create(**{**ask, "prompt": system_prompt})
        assert shared.usage.prompt_tokens_details.cached_tokens == reusable
    finally:
        keys.update(prefix_namespace="")


def check_sampling_and_stop(served: Served) -> None:
    client = served.client()
    ask = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0.9, top_p=0.95, seed=7)
    first = client.chat.completions.create(**ask).choices[0].message.content
    assert client.chat.completions.create(**ask).choices[0].message.content == first
    greedy = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    full = greedy.choices[0].message.content
    stop = full[4:7]
    cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # The knobs reach main: sampling from the one likeliest token, or from those as likely as it, is
    # greedy decoding (top_k and min_p, the extensions, through the client's extra_body) ...
    greedy_ask = dict(model=MODEL, messages=MESSAGES, max_tokens=12)
    for knob in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = client.chat.completions.create(**greedy_ask, temperature=0.9, seed=3, extra_body=knob)
        assert sampled.choices[0].message.content == full, knob
    # ... and a +100 logit bias takes every greedy token, OpenAI's penalties change the answer.
    biased = client.chat.completions.create(**greedy_ask, temperature=0, logit_bias={"280": 100})
    text = biased.choices[0].message.content  # token 280, 12 times over ("ha" in this model's tokenizer)
    assert text != full and text == text[: len(text) // 12] * 12
    penalised = client.chat.completions.create(**greedy_ask, temperature=0, frequency_penalty=2, presence_penalty=2)
    assert penalised.choices[0].message.content != full


def check_openai_errors(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=5)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x " * 5000}], max_tokens=5)
    assert long.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100000)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        served.client("odmoe-key-forged").models.list()
    request = urllib.request.Request(
        f"{served.plane.server}/v1/chat/completions",
        data=b"{not json",
        method="POST",
        headers={"Authorization": f"Bearer {served.user_key}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request)
    body = json.loads(raw.value.read())
    assert raw.value.code == 400 and body["error"]["type"] == "invalid_request_error"


def check_a_schema_past_a_mib_fails_alone_on_mains_link(served: Served) -> None:
    """One user's 1.5 MB schema while another user's answer streams on the same link to main: the
    schema's request is a 400, and nothing else fails. Before, the agent took at most 1 MiB
    in a frame (websockets' default), so the request closed main's link with 1009, failed the other
    answer and turned the deployment degraded."""
    from controlplane.deployments.models import Deployment, DeploymentNode, Role

    main = DeploymentNode.objects.get(deployment__name=MODEL, role=Role.MAIN).node
    schema = {"type": "json_schema", "json_schema": {"name": "big", "schema": {"const": "x" * 1_500_000}}}
    other = served.client(served.other_key)
    streaming = served.client().completions.create(
        model=MODEL, prompt="Which experts", max_tokens=48, temperature=0, stream=True
    )
    pieces = [next(iter(streaming))]  # under way on main's link
    with pytest.raises(openai.APIStatusError) as refused:
        other.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, response_format=schema)
    # The request's fault, refused at the edge by its bounds (serving.bounds) before a Generate is built.
    assert refused.value.status_code == 400, refused.value.body
    assert refused.value.body["param"] == "response_format.json_schema.schema"
    pieces += list(streaming)
    assert pieces[-1].choices[0].finish_reason == "length"
    assert other.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0).choices
    assert Deployment.objects.get(name=MODEL).status == "ready"
    assert type(main).objects.get(pk=main.pk).connected_at == main.connected_at  # the link never dropped


def check_many_at_once(served: Served) -> None:
    """Several prompts, several choices and several callers at once share main's batch."""
    client = served.client()
    tokenizer = load_tokenizer(served.model_dir)
    prompts = ["Mixture of experts", "Route every token", "on demand"]
    many = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for choice, prompt in zip(many.choices, prompts, strict=True):
        assert choice.text == reference_text(served, tokenizer(prompt)["input_ids"], 8)
    assert many.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert many.usage.completion_tokens == 3 * 8

    # n choices, streamed: the chunks of each choice carry its index.
    chunks = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, n=2, stream=True
    )
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    expected = reference_text(served, chat_prompt_ids(served, MESSAGES), 12)
    assert texts == [expected, expected]
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=99)
    assert too_many.value.body["param"] == "n"

    # Three callers at once: main runs them as one batch, and each answer is its own run's.
    staff = served.api(served.staff_key)
    deployment = staff.get("/api/deployments")["results"][0]["id"]
    answers: dict[int, dict] = {}

    def ask(i: int) -> None:
        body = {"prompt_ids": PROMPTS[i], "max_new_tokens": 24}
        answers[i] = staff.post(f"/api/deployments/{deployment}/generate", body)

    callers = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    for i in range(3):
        assert answers[i]["token_ids"] == reference_generate(served.model_dir, PROMPTS[i], 24)
    assert max(a["metrics"]["max_batch"] for a in answers.values()) >= 2

    # The benchmark of the acceptance, as a user runs it against a live server: four
    # prompts one after another, then together; the same answers.
    timed = openai_concurrency.one_round(client, MODEL, openai_concurrency.PROMPTS[:4], 12)
    assert timed["identical"] is True
    print(f"4 chat completions together took {timed['ratio']:.2f} of one after another")


def wait_job(api: Api, job_id: str, done, timeout_s: float = 120) -> dict:
    """The job's detail once ``done(detail)`` holds (its outputs counted by state: ``outputs_by_status``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = api.get(f"/api/jobs/{job_id}")
        if done(job):
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} did not get there: {job['status']}, {job['outputs_by_status']}")


def job_outputs(api: Api, job_id: str) -> list[dict]:
    """Every output of a job, in prompt order, page after page (two to a page: the paging is used)."""
    found, path = [], f"/api/jobs/{job_id}/outputs?limit=2"
    while path:
        page = api.get(path)
        found += page["results"]
        path = page["next"] and page["next"].removeprefix(api.base)
    return found


def check_job_survives_its_worker_killed(served: Served) -> None:
    alice = served.api(served.user_key)
    prompts = ["Mixture of experts", "Route every token", "to a few experts", "on demand", "and evict them"]
    job = alice.post("/api/jobs", {"model": MODEL, "prompts": prompts, "max_tokens": 10, "temperature": 0}, expect=201)
    assert job["status"] in ("queued", "running") and job["prompts"] == 5
    wait_job(alice, job["id"], lambda j: j["outputs_by_status"]["done"] > 0)
    celery = next(c for c in served.plane.group.children if c.name == "celery")
    served.plane.group.stop(celery, kill=True)  # mid-job, without a chance to hand back its tasks
    # kombu's Redis transport gives back a dead worker's unacknowledged tasks when a worker starts
    # polling, then only every 100 s (each 10th of its 10-second looks): a task not yet past its
    # redelivery time at the new worker's first look would wait that long. It is past it now.
    time.sleep(TASK_REDELIVERY_S)
    served.plane.start_celery()
    finished = wait_job(alice, job["id"], lambda j: j["status"] in ("succeeded", "failed"), timeout_s=180)
    assert finished["status"] == "succeeded", finished
    assert finished["outputs_by_status"]["done"] == 5
    tokenizer = load_tokenizer(served.model_dir)
    outputs = job_outputs(alice, job["id"])
    for output, prompt in zip(outputs, prompts, strict=True):
        assert output["status"] == "done" and output["finish_reason"] == "length"
        assert output["text"] == reference_text(served, tokenizer(prompt)["input_ids"], 10)
        # The summary figures are kept; the per-step record, which grows with the answer, is not.
        assert output["metrics"]["generated_tokens"] == 10 and "per_step" not in output["metrics"]
    assert finished["stored_bytes"] == sum(o["stored_bytes"] for o in outputs) > 0
    # Jobs are private to their owner; staff see them all.
    assert served.api(served.other_key).call("GET", f"/api/jobs/{job['id']}")[0] == 404
    assert served.api(served.staff_key).get(f"/api/jobs/{job['id']}")["owner"] == "alice"
    assert [j["id"] for j in alice.get("/api/jobs")["results"]] == [job["id"]]


def check_job_cancel(served: Served) -> None:
    alice = served.api(served.user_key)
    # Long answers (most of the tiny model's 1,024-token context): a prompt may finish between the poll
    # that sees the job running and the cancel; a cancelled prompt stops at once whatever its max_tokens.
    # The prompt matters as much: the tiny model ends "a b c" with its end-of-sequence token after 20
    # tokens (then two prompts could end before the cancel came), "x y z" runs all 900.
    job = alice.post(
        "/api/jobs", {"model": MODEL, "prompts": ["x y z"] * 6, "max_tokens": 900, "temperature": 0}, expect=201
    )
    wait_job(alice, job["id"], lambda j: j["status"] == "running")
    cancelled = alice.post(f"/api/jobs/{job['id']}/cancel")
    assert cancelled["status"] == "cancelled"
    final = wait_job(
        alice, job["id"], lambda j: j["outputs_by_status"]["queued"] + j["outputs_by_status"]["running"] == 0
    )
    counts = final["outputs_by_status"]
    assert counts["cancelled"] + counts["done"] == 6 and counts["cancelled"] >= 5
    # Ended, it can be deleted, and what it stored with it.
    assert alice.call("DELETE", f"/api/jobs/{job['id']}")[0] == 204
    assert alice.call("GET", f"/api/jobs/{job['id']}")[0] == 404
    bad = alice.call("POST", "/api/jobs", {"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert bad[0] == 400 and "max_tokens" in bad[1]


def check_job_stops_when_its_key_is_revoked(served: Served) -> None:
    """Revoking the key a job was submitted with stops the job at once: its queued prompts and the
    one running on the cluster, each saying why."""
    staff = served.api(served.staff_key)
    key = staff.post("/api/keys", {"name": "batch", "scopes": ["inference"]}, expect=201)
    body = {"model": MODEL, "prompts": ["x y z"] * 6, "max_tokens": 200, "temperature": 0}  # no early end (above)
    job = served.api(key["key"]).post("/api/jobs", body, expect=201)
    wait_job(staff, job["id"], lambda j: j["outputs_by_status"]["running"] > 0)
    staff.call("DELETE", f"/api/keys/{key['id']}", expect=200)
    assert staff.get(f"/api/jobs/{job['id']}")["status"] == "cancelled"  # at once, not prompt after prompt
    final = wait_job(
        staff, job["id"], lambda j: j["outputs_by_status"]["queued"] + j["outputs_by_status"]["running"] == 0
    )
    assert final["outputs_by_status"]["cancelled"] >= 5
    for output in job_outputs(staff, job["id"]):
        assert output["status"] == "done" or "was revoked" in output["error"], output


def check_usage_and_quota(served: Served) -> None:
    """Each key's tokens counted as its calls answer (the OpenAI API, streamed or not, and a job run
    by Celery), exported to /metrics; a key with a quota of 1 token runs the call it starts below it,
    then gets 429 ``quota_exceeded`` with Retry-After until UTC midnight."""
    staff = served.api(served.staff_key)
    metered = staff.post("/api/keys", {"name": "metered", "scopes": ["inference"]}, expect=201)
    capped = staff.post("/api/keys", {"name": "capped", "scopes": ["inference"], "daily_token_quota": 1}, expect=201)
    assert (metered["daily_token_quota"], capped["daily_token_quota"], metered["tokens_today"]) == (None, 1, 0)

    client = served.client(metered["key"])
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Mixture of experts",
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    job = served.api(metered["key"]).post(
        "/api/jobs", {"model": MODEL, "prompt": "Route every token", "max_tokens": 3, "temperature": 0}, expect=201
    )
    wait_job(staff, job["id"], lambda j: j["status"] in ("succeeded", "failed"))
    (output,) = job_outputs(staff, job["id"])
    assert output["status"] == "done", output
    spent = (
        whole.usage.total_tokens + chunks[-1].usage.total_tokens + output["prompt_tokens"] + len(output["token_ids"])
    )
    keys = {k["name"]: k for k in staff.get("/api/keys?limit=100")["results"]}
    assert (keys["metered"]["tokens_today"], keys["metered"]["tokens_last_30_days"]) == (spent, spent)

    request = urllib.request.Request(f"{served.plane.server}/metrics")
    request.add_header("Authorization", f"Bearer {served.staff_key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        exported = response.read().decode()
    labels = f'deployment="{MODEL}",key_id="{metered["id"]}",key_prefix="{metered["prefix"]}",user="staff"'
    prompts = whole.usage.prompt_tokens + chunks[-1].usage.prompt_tokens + output["prompt_tokens"]
    assert f"odmoe_usage_prompt_tokens_total{{{labels}}} {float(prompts)}" in exported
    assert f"odmoe_usage_generations_total{{{labels}}} 3.0" in exported
    assert metered["key"] not in exported

    limited = served.client(capped["key"])
    first = limited.completions.create(model=MODEL, prompt="Mixture of experts", max_tokens=4, temperature=0)
    assert first.usage.total_tokens > 1  # started below the quota: it ran to its end, past it
    with pytest.raises(openai.RateLimitError) as refused:
        limited.completions.create(model=MODEL, prompt="Mixture of experts", max_tokens=4, temperature=0)
    error = refused.value.body
    assert (refused.value.status_code, error["code"], error["type"]) == (429, "quota_exceeded", "insufficient_quota")
    assert f"{first.usage.total_tokens} of 1 tokens" in error["message"] and "UTC midnight" in error["message"]
    retry_after = int(refused.value.response.headers["Retry-After"])
    assert 1 <= retry_after <= 86400 and refused.value.response.headers["x-should-retry"] == "false"
    keys = {k["name"]: k for k in staff.get("/api/keys?limit=100")["results"]}
    assert keys["capped"]["tokens_today"] == first.usage.total_tokens  # the refused call counted nothing


def check_chat(served: Served) -> None:
    from asgiref.sync import async_to_sync
    from channels.testing import WebsocketCommunicator
    from django.contrib.auth import get_user_model

    from controlplane.accounts.models import TokenUsage
    from controlplane.chat.consumers import ChatConsumer
    from controlplane.chat.models import Message

    alice = get_user_model().objects.get(username="alice")

    async def talk(messages: list[dict]) -> list[dict]:
        comm = WebsocketCommunicator(ChatConsumer.as_asgi(), "/ws/chat/")
        comm.scope["user"] = alice
        assert (await comm.connect())[0]
        received = []
        for message in messages:
            await comm.send_json_to(message)
            while True:
                event = await comm.receive_json_from(timeout=120)
                received.append(event)
                if event["type"] == "token" and message.get("stop_after") == sum(
                    e["type"] == "token" for e in received
                ):
                    await comm.send_json_to({"type": "stop"})
                if event["type"] in ("done", "error") and (event["type"] == "done" or "still" not in event["detail"]):
                    break
        await comm.disconnect()
        return received

    content = "Which experts does this token need?"
    events = async_to_sync(talk)([{"type": "send", "conversation": None, "content": content, "max_tokens": 12}])
    tokens = [e["text"] for e in events if e["type"] == "token"]
    done = events[-1]
    assert done["type"] == "done" and done["status"] == "complete" and len(tokens) > 1
    rest = served.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert "".join(tokens) == done["content"] == rest.choices[0].message.content
    assert done["metrics"]["decode_tok_s"] > 0 and "ttft_ms" in done["metrics"]
    conversation = events[0]["id"]

    # A long answer stopped after a few tokens ends on the cluster and is saved as stopped.
    ask = {"type": "send", "conversation": conversation, "content": "Go on", "max_tokens": 400, "stop_after": 3}
    events = async_to_sync(talk)([ask])
    stopped = events[-1]
    assert stopped["type"] == "done" and stopped["status"] == "stopped"
    assert sum(e["type"] == "token" for e in events) < 400
    saved = list(Message.objects.filter(conversation_id=conversation).values_list("role", "status"))
    assert saved == [("user", "complete"), ("assistant", "complete"), ("user", "complete"), ("assistant", "stopped")]
    # Both answers counted to alice's browser session (no key), the stopped one with the tokens it made.
    (session,) = TokenUsage.objects.filter(user=alice, api_key=None)
    assert (session.deployment, session.generations) == (MODEL, 2)
    assert session.completion_tokens >= 12 + 3 and session.prompt_tokens > 0
    # The cluster is free again: the next request is served at once.
    again = served.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert again.choices[0].finish_reason == "length"


def check_chat_outlives_its_page_and_its_writer(served: Served, redis_url: str) -> None:
    """A chat answer is written by its writer, not by the page's socket (``controlplane.chat.writer``):
    a page whose socket closes mid-answer asks again from its last piece and gets the rest, each piece
    once; a writer that stops mid-answer (its task cancelled, as when its web process shuts down) is
    taken over by the page following the answer, which has main go on from the tokens already
    written; a page that never comes back stops the answer after the grace window. Every answer's
    tokens are counted once. The writers run in this process, on the cluster's Redis (where its web
    server keeps when each agent was last heard)."""
    from asgiref.sync import async_to_sync
    from channels.testing import WebsocketCommunicator
    from django.contrib.auth import get_user_model
    from django.test import override_settings

    from controlplane.accounts.models import TokenUsage
    from controlplane.chat import tape, writer
    from controlplane.chat.consumers import ChatConsumer
    from controlplane.chat.models import Message
    from controlplane.deployments.models import AnswerPause

    alice = get_user_model().objects.get(username="alice")
    content, tokens, long = "Tell me about the experts", 40, 240
    prompt = chat_prompt_ids(served, [{"role": "user", "content": content}])
    send = {"type": "send", "conversation": None, "content": content, "max_tokens": tokens}

    async def page() -> WebsocketCommunicator:
        comm = WebsocketCommunicator(ChatConsumer.as_asgi(), "/ws/chat/")
        comm.scope["user"] = alice
        assert (await comm.connect())[0]
        return comm

    async def until_done(comm: WebsocketCommunicator, received: list[dict]) -> list[dict]:
        while not received or received[-1]["type"] != "done":
            received.append(await comm.receive_json_from(timeout=120))
        return received

    async def pieces_then(comm: WebsocketCommunicator, count: int) -> tuple[int, list[dict]]:
        """The answer's id and the first ``count`` pieces shown."""
        answer = (await comm.receive_json_from(timeout=30))["answer"]
        shown = [await comm.receive_json_from(timeout=120) for _ in range(count)]
        assert all(event["type"] == "token" for event in shown), shown
        return answer, shown

    async def page_comes_back() -> tuple[list[dict], list[dict]]:
        first = await page()
        await first.send_json_to(send)
        answer, before = await pieces_then(first, 3)
        await first.disconnect()  # the socket closes; the answer goes on
        second = await page()
        await second.send_json_to({"type": "resume", "answer": answer, "after": before[-1]["index"] + 1})
        after = await until_done(second, [])
        await second.disconnect()
        return before, after

    async def writer_stops() -> tuple[int, list[dict]]:
        comm = await page()
        await comm.send_json_to({**send, "max_tokens": long})  # long enough to stop its writer mid-answer
        answer, before = await pieces_then(comm, 3)
        (task,) = [t for t in writer._running if t.get_name() == f"chat-answer-{answer}"]
        task.cancel()  # as at its web process's shutdown: the lease is given up, the answer not ended
        received = await until_done(comm, before)
        await comm.disconnect()
        return answer, received

    async def page_never_comes_back() -> int:
        comm = await page()
        await comm.send_json_to({**send, "max_tokens": 400})
        answer, _ = await pieces_then(comm, 2)
        await comm.disconnect()
        for _ in range(200):  # the grace window, then the writer's next look (every writing.TOUCH_S)
            if not await Message.objects.filter(pk=answer, status="streaming").aexists():
                break
            await asyncio.sleep(0.1)
        return answer

    usage = TokenUsage.objects.filter(user=alice, api_key=None)
    counted = usage.first().completion_tokens if usage.exists() else 0
    with override_settings(REDIS_URL=redis_url):
        before, after = async_to_sync(page_comes_back)()
        shown = before + [e for e in after if e["type"] == "token"]
        assert [e["index"] for e in shown] == sorted({e["index"] for e in shown})  # each piece once, in order
        assert "".join(e["text"] for e in shown) == after[-1]["content"] == reference_text(served, prompt, tokens)
        assert after[-1]["status"] == "complete"

        answer, received = async_to_sync(writer_stops)()
        shown = [e for e in received if e["type"] == "token"]
        assert [e["index"] for e in shown] == sorted({e["index"] for e in shown})
        ids = tape.token_ids(tape.pieces(answer))
        (resumed_at,) = tape.read_meta(answer).resumed_at
        assert 3 <= resumed_at < long and len(ids) == long, (resumed_at, len(ids))
        # Main's tokens up to the takeover, then main going on from them (re-read as prompt).
        assert ids[:resumed_at] == reference_generate(served.model_dir, prompt, resumed_at)
        rest = reference_generate(served.model_dir, prompt + ids[:resumed_at], long - resumed_at)
        assert ids[resumed_at:] == rest
        assert "".join(e["text"] for e in shown) == received[-1]["content"] == Message.objects.get(pk=answer).content
        assert received[-1]["status"] == "complete" and received[-1]["metrics"]["taken_over_at"] == [resumed_at]
        assert received[-1]["metrics"]["generated_tokens"] == long  # the answer's, not the last writer's
        # The console lists the pause: the takeover, where it went on, and how long the page waited.
        (pause,) = AnswerPause.objects.filter(cause="web_restart", request_id=tape.read_meta(answer).request_id)
        assert pause.at_token == resumed_at and pause.paused_ms > 0 and pause.deployment_name == MODEL

        with override_settings(CHAT_RESUME_GRACE_S=1.0):
            closed = async_to_sync(page_never_comes_back)()
        left = Message.objects.get(pk=closed)
        assert (left.status, left.error) == ("stopped", writer.PAGE_CLOSED)
        stopped_tokens = len(tape.token_ids(tape.pieces(closed)))
        assert 2 <= stopped_tokens < 400

    # Three answers, each counted once: every token of each, whoever wrote it.
    assert usage.first().completion_tokens - counted == tokens + long + stopped_tokens


def reference_logprobs(served: Served, ids: list[int]) -> torch.Tensor:
    """``torch.log_softmax`` of Transformers' own forward over ``ids``: row ``p`` scores token ``p + 1``."""
    model = AutoModelForCausalLM.from_pretrained(served.model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_logprobs(served: Served) -> None:
    """Chat ``logprobs``/``top_logprobs`` (whole and streamed) and completions ``echo`` with
    ``logprobs`` and ``max_tokens: 0`` (how lm-evaluation-harness asks for log-likelihoods), with
    the official client; the values are Transformers' own log-softmax."""
    client = served.client()
    tokenizer = tokenizer_for(str(served.model_dir))
    ask = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**ask)
    prompt_ids = chat_prompt_ids(served, MESSAGES)
    answer_ids = reference_generate(served.model_dir, prompt_ids, 6)
    reference = reference_logprobs(served, prompt_ids + answer_ids)
    content = whole.choices[0].logprobs.content
    assert [c.bytes for c in content] == [list(tokenizer.token_bytes(t)) for t in answer_ids]
    if not set(answer_ids) & set(tokenizer.backend.get_added_tokens_decoder()):  # the text leaves those out
        assert b"".join(bytes(c.bytes) for c in content).decode() == whole.choices[0].message.content
    for position, (entry, token) in enumerate(zip(content, answer_ids, strict=True), start=len(prompt_ids) - 1):
        assert entry.logprob == pytest.approx(float(reference[position, token]), abs=1e-4)
        top_values, top_ids = torch.topk(reference[position], 3)
        assert [t.bytes for t in entry.top_logprobs] == [list(tokenizer.token_bytes(t)) for t in top_ids.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely one
    streamed = [
        entry
        for chunk in client.chat.completions.create(**ask, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content
    ]
    assert [(e.token, e.logprob, e.top_logprobs) for e in streamed] == [
        (e.token, e.logprob, e.top_logprobs) for e in content
    ]

    prompt = "Mixture of experts"
    ids = tokenizer.encode(prompt)
    echoed = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0, temperature=0)
    choice = echoed.choices[0]
    reference = reference_logprobs(served, ids)
    assert choice.text == prompt and echoed.usage.completion_tokens == 0 and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) and logprobs.text_offset[0] == 0
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts the first
    for position, token in enumerate(ids[1:]):
        assert logprobs.token_logprobs[position + 1] == pytest.approx(float(reference[position, token]), abs=1e-4)
        top = logprobs.top_logprobs[position + 1]
        assert 2 <= len(top) <= 3 and logprobs.tokens[position + 1] in top  # the 2 likeliest and the chosen one
        assert max(top.values()) == pytest.approx(float(reference[position].max()), abs=1e-4)
    # With a generated part: the prompt's tokens, then the answer's, offsets counted from the prompt.
    more = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=3, temperature=0)
    choice = more.choices[0]
    assert choice.text.startswith(prompt) and len(choice.logprobs.tokens) == len(ids) + 3
    assert choice.logprobs.text_offset[len(ids)] == len(prompt)
    # Streamed: the prompt first with its logprobs, then each piece with its tokens'; the same in all.
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=3, temperature=0, stream=True
        )
    )
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in pieces) == choice.text and pieces[0].text == prompt
    streamed_tokens = [t for p in pieces if p.logprobs for t in p.logprobs.tokens]
    streamed_offsets = [o for p in pieces if p.logprobs for o in p.logprobs.text_offset]
    assert streamed_tokens == choice.logprobs.tokens and streamed_offsets == choice.logprobs.text_offset
    # A stop sequence: the logprobs run through the token that completed it, no further.
    full = whole.choices[0].message.content
    stop = full[2:4]
    cut = client.chat.completions.create(**{**ask, "stop": [stop]})
    kept = [bytes(c.bytes) for c in cut.choices[0].logprobs.content]
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert stop in b"".join(kept).decode(errors="replace")
    assert stop not in b"".join(kept[:-1]).decode(errors="replace")

    for bad, param in [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **bad)
        assert refused.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logprobs=6)
    assert refused.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)  # without echo: nothing to answer
    assert refused.value.body["param"] == "max_tokens"


def check_token_prompts(served: Served) -> None:
    """Token-id prompts, as lm-evaluation-harness's ``local-completions`` sends them: the same answer
    as the text they encode, and for its log-likelihood request (a batch of token lists without a
    BOS, ``max_tokens: 1``, ``echo``, ``logprobs: 1``, ``seed``) Transformers' logprobs of those very
    ids; an id past the vocabulary is a 400 that names it."""
    client = served.client()
    tokenizer = tokenizer_for(str(served.model_dir))
    prompt = "Mixture of experts"
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    ids = client.completions.create(model=MODEL, prompt=tokenizer.encode(prompt), max_tokens=8, temperature=0)
    assert ids.choices[0].text == text.choices[0].text and ids.usage == text.usage
    batch = [tokenizer.encode(prompt, add_special_tokens=False), tokenizer.encode("Route every token")[:3]]
    scored = client.completions.create(
        model=MODEL, prompt=batch, max_tokens=1, echo=True, logprobs=1, temperature=0, seed=1234
    )
    assert scored.usage.prompt_tokens == sum(len(p) for p in batch)
    for choice, prompt_ids in zip(sorted(scored.choices, key=lambda c: c.index), batch, strict=True):
        reference = reference_logprobs(served, prompt_ids)
        logprobs = choice.logprobs
        assert choice.text.startswith(tokenizer.decode(prompt_ids, skip_special_tokens=True))
        assert len(logprobs.tokens) == len(prompt_ids) + 1 and logprobs.token_logprobs[0] is None
        for position, token in enumerate(prompt_ids[1:]):
            assert logprobs.token_logprobs[position + 1] == pytest.approx(float(reference[position, token]), abs=1e-4)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=[1, 10**6], max_tokens=1)
    assert refused.value.body["param"] == "prompt" and "token id 1000000" in refused.value.body["message"]


def post_raw(served: Served, path: str, body: dict) -> tuple[int, dict | str]:
    """POST ``body`` as it is (the official client would check it first); the error, or the text answered."""
    request = urllib.request.Request(
        f"{served.plane.server}{path}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {served.user_key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]


def check_every_parameter_is_honoured_or_refused(served: Served) -> None:
    """The walk of ``controlplane.serving.parameters``: every honoured parameter is answered,
    every other one is a 400 naming it (``unsupported_parameter``) past the values it accepts,
    which are answered; a parameter of nobody's spec is a 400 naming it."""
    bases = {
        "/v1/chat/completions": (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}),
        "/v1/completions": (COMPLETIONS, {"model": MODEL, "prompt": "Mixture", "max_tokens": 2, "temperature": 0}),
        "/v1/responses": (RESPONSES, {"model": MODEL, "input": "Mixture", "max_output_tokens": 2, "temperature": 0}),
    }
    for path, (declared, base) in bases.items():
        for name, parameter in declared.items():
            if parameter.support is Support.HONOURED:
                if parameter.example is not None:
                    status, answer = post_raw(served, path, {**base, **parameter.example})
                    assert status == 200, (path, name, answer)
                if isinstance(parameter.accepts, type):
                    status, answer = post_raw(served, path, {**base, name: ["not", "a", "label"]})
                    assert status == 400 and answer["param"] == name, (path, name, answer)
                continue
            status, answer = post_raw(served, path, {**base, name: "a-value-it-does-not-take"})
            assert status == 400, (path, name, answer)
            assert (answer["param"], answer["code"]) == (name, "unsupported_parameter"), (path, answer)
        refused = [n for n, p in declared.items() if p.support is not Support.HONOURED]
        # Null, and each value a refused parameter accepts (all of them at once, one request per rank).
        for rank in range(1 + max(len(declared[n].accepts) for n in refused)):
            body = {n: ([None, *declared[n].accepts] + [None] * 3)[rank] for n in refused}
            status, answer = post_raw(served, path, {**base, **body})
            assert status == 200, (path, rank, answer)
        for unknown in ("top_a", "mirostat"):  # neither OpenAI's nor one of the extensions
            status, answer = post_raw(served, path, {**base, unknown: 1})
            assert status == 400 and (answer["param"], answer["code"]) == (unknown, "unsupported_parameter")
    status, answer = post_raw(served, "/v1/completions", {**bases["/v1/completions"][1], "max_completion_tokens": 2})
    assert status == 400 and answer["param"] == "max_completion_tokens"  # the chat's, not the completions'


def _raw(served: Served, path: str, body: dict | None = None) -> tuple[int, object]:
    """An answer's status and JSON as the server sent it (a GET without ``body``); a stream's events
    as a list, each ``data:`` line's JSON up to ``[DONE]``."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{served.plane.server}{path}",
        data=data,
        method="GET" if body is None else "POST",
        headers={"Authorization": f"Bearer {served.user_key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            text = response.read().decode()
            if not (body or {}).get("stream"):
                return response.status, json.loads(text)
            events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-1:]
            return response.status, [json.loads(event) for event in events[:-1]]
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _first_echoed_logprob_documented(answer: dict) -> dict:
    """An echoed completion as OpenAI's document would have it. OpenAI's API gives the prompt's
    first token a null logprob and null alternatives (nothing predicts it), as this API does; the
    document types them as a number and an object. Any other null still fails the check."""
    answer = json.loads(json.dumps(answer))
    for choice in answer["choices"]:
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        logprobs["token_logprobs"][0], logprobs["top_logprobs"][0] = 0.0, {}
    return answer


def _streamed_completion_documented(chunk: dict) -> dict:
    """A streamed completion's chunk as OpenAI's document would have it. The document types each
    chunk as a whole completion, whose ``finish_reason`` is a string; OpenAI's API, like this one,
    sends null there until the choice's last chunk (checked by the caller)."""
    chunk = json.loads(json.dumps(chunk))
    for choice in chunk["choices"]:
        choice["finish_reason"] = choice["finish_reason"] or "stop"
    return chunk


def check_answers_keep_to_openais_schema(served: Served) -> None:
    """Every kind of answer the API sends, as sent, against OpenAI's published schemas
    (``tests/controlplane/openai_schema.py``): the models, chat plain, with logprobs, under a
    schema and with a tool call, completions plain, with logprobs and echoed, every streamed chunk
    (with usage), and error bodies. Where OpenAI's own API departs from its document, the API
    follows the API, and the departure is named here."""
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    completion = {"model": MODEL, "prompt": "Mixture of", "max_tokens": 4, "temperature": 0}
    tool = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object", "properties": {}}}}
    person = {"name": "person", "schema": PERSON}
    answers = [
        ("ListModelsResponse", "/v1/models", None),
        ("Model", f"/v1/models/{MODEL}", None),
        ("CreateChatCompletionResponse", "/v1/chat/completions", chat),
        ("CreateChatCompletionResponse", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}),
        ("CreateChatCompletionResponse", "/v1/chat/completions", {**chat, "n": 2, "temperature": 1, "seed": 3}),
        (
            "CreateChatCompletionResponse",
            "/v1/chat/completions",
            {**chat, "max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": person}},
        ),
        (
            "CreateChatCompletionResponse",
            "/v1/chat/completions",
            {**chat, "max_tokens": 40, "tools": [tool], "tool_choice": "required"},
        ),
        ("CreateCompletionResponse", "/v1/completions", completion),
        ("CreateCompletionResponse", "/v1/completions", {**completion, "logprobs": 2, "echo": True}),
    ]
    streams = [
        ("CreateChatCompletionStreamResponse", "/v1/chat/completions", chat),
        (
            "CreateChatCompletionStreamResponse",
            "/v1/chat/completions",
            {**chat, "logprobs": True, "top_logprobs": 1, "stream_options": {"include_usage": True}},
        ),
        (
            "CreateChatCompletionStreamResponse",
            "/v1/chat/completions",
            {**chat, "max_tokens": 40, "tools": [tool], "tool_choice": "required"},
        ),
        ("CreateCompletionResponse", "/v1/completions", {**completion, "logprobs": 1}),
        ("CreateCompletionResponse", "/v1/completions", {**completion, "stream_options": {"include_usage": True}}),
    ]
    errors = [
        ("/v1/chat/completions", {**chat, "model": "no-such-model"}),
        ("/v1/chat/completions", {**chat, "top_a": 1}),
        ("/v1/completions", {**completion, "max_tokens": -1}),
    ]
    for name, path, body in answers:
        status, answer = _raw(served, path, body)
        assert status == 200, (path, body, answer)
        if body and body.get("echo"):
            answer = _first_echoed_logprob_documented(answer)
        openai_schema.conforms(name, answer)
    for name, path, body in streams:
        status, chunks = _raw(served, path, {**body, "stream": True})
        assert status == 200 and chunks, (path, body, chunks)
        ends = [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"]]
        assert ends[-1] is not None and ends[:-1] == [None] * (len(ends) - 1), ends  # one choice here
        for chunk in chunks:
            if name == "CreateCompletionResponse":
                chunk = _streamed_completion_documented(chunk)
            openai_schema.conforms(name, chunk)
    for path, body in errors:
        status, answer = _raw(served, path, body)
        assert status in (400, 404), (path, body, answer)
        openai_schema.conforms("ErrorResponse", answer)


def _raw_events(served: Served, body: dict) -> list[dict]:
    """A streamed Response's events as the server sent them: each ``event:`` line's name must be its
    ``data:`` line's ``type``."""
    request = urllib.request.Request(
        f"{served.plane.server}/v1/responses",
        data=json.dumps({**body, "stream": True}).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {served.user_key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        blocks = [b for b in response.read().decode().split("\n\n") if b.strip()]
    events = []
    for block in blocks:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}", block
        events.append(event)
    return events


PICK = {
    "type": "function",
    "name": "pick",
    "description": "Pick a number.",
    "parameters": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    },
    "strict": True,
}


def check_responses_api(served: Served) -> None:
    """``/v1/responses`` through the official client: the same tokens as the equivalent chat
    request, whole and streamed, with instructions, a JSON schema and a function tool (its call,
    then its output fed back); what it does not serve is a 400 naming it; every Response object and
    event as sent keeps to OpenAI's published schemas."""
    client = served.client()
    ask = dict(model=MODEL, input=MESSAGES[0]["content"], instructions="Answer briefly.", max_output_tokens=12)
    whole = client.responses.create(**ask, temperature=0)
    chat = client.chat.completions.with_raw_response.create(
        temperature=0,
        model=MODEL,
        messages=[{"role": "system", "content": "Answer briefly."}, *MESSAGES],
        max_tokens=12,
    )
    chat = chat.parse()
    assert whole.output_text == chat.choices[0].message.content and whole.status in ("completed", "incomplete")
    usage = chat.usage
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    events = list(client.responses.create(**ask, temperature=0, stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].type == f"response.{whole.status}" and events[-1].response.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # Seeded sampling has no seed here: two sampled answers are each a whole response.
    assert client.responses.create(**ask, temperature=1.0, top_p=0.9).status in ("completed", "incomplete")
    # A JSON schema: the answer keeps to it.
    person = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    shaped = client.responses.create(model=MODEL, input="A person, as JSON", text=person, max_output_tokens=300)
    jsonschema.validate(json.loads(shaped.output_text), PERSON)
    # A function tool: a call, streamed whole; its output fed back as input gets an answer.
    pick = {"model": MODEL, "input": "Pick a number.", "max_output_tokens": 80, "temperature": 0}
    called = client.responses.create(**pick, tools=[PICK], tool_choice="required")
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1, called
    call = calls[0]
    assert call.name == "pick" and 0 <= json.loads(call.arguments)["n"] <= 9
    streamed = list(client.responses.create(**pick, tools=[PICK], tool_choice="required", stream=True))
    (arguments,) = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert arguments.arguments == call.arguments
    follow_up = [
        {"role": "user", "content": "Pick a number."},
        {"type": "function_call", "call_id": call.call_id, "name": "pick", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "picked"},
    ]
    after = client.responses.create(model=MODEL, input=follow_up, tools=[PICK], max_output_tokens=8, temperature=0)
    assert after.status in ("completed", "incomplete")
    # A stored response continued: the chat request of its input, its answer and the new input.
    then = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=whole.id, max_output_tokens=8, temperature=0
    )
    assert then.previous_response_id == whole.id and whole.store
    history = [*MESSAGES, {"role": "assistant", "content": whole.output_text}, {"role": "user", "content": "And then?"}]
    again = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    assert then.output_text == again.choices[0].message.content
    # Not to be continued: another user's, and one asked not to be stored.
    bob = served.client(served.other_key)
    with pytest.raises(openai.NotFoundError) as missing:
        bob.responses.create(model=MODEL, input="Hi", previous_response_id=whole.id, max_output_tokens=2)
    assert missing.value.code == "previous_response_not_found"
    unkept = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    assert not unkept.store
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unkept.id, max_output_tokens=2)
    assert missing.value.code == "previous_response_not_found"
    # What is not served: a built-in tool.
    base = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    status, refused = post_raw(served, "/v1/responses", {**base, "tools": [{"type": "web_search"}]})
    assert status == 400 and refused["param"] == "tools[0].type", refused
    status, refused = post_raw(served, "/v1/responses", {**base, "max_output_tokens": 10**9})
    assert status == 400 and refused["param"] == "max_output_tokens", refused
    # As sent, against OpenAI's published schemas.
    for body in (
        {**ask, "temperature": 0, "previous_response_id": whole.id},
        {**pick, "tools": [PICK], "tool_choice": "required"},
        {**ask, "max_output_tokens": 2},
    ):
        status, answer = _raw(served, "/v1/responses", body)
        assert status == 200, answer
        openai_schema.conforms("Response", answer)
        for event in _raw_events(served, body):
            openai_schema.conforms("ResponseStreamEvent", event)


# A strict schema whose every string and number is bounded: an answer fits in its max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "floor": {"type": "integer", "maximum": 9}},
            "required": ["city", "floor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "colour", "tags", "home"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def check_structured_output(served: Served) -> None:
    """20 prompts under a strict json_schema, through the official client: every answer is valid
    (the tiny model's weights are random: the grammar alone makes it so)."""
    client = served.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(i: int):
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Person number {i}, as JSON"}],
            max_tokens=300,
            temperature=1.0 if i % 2 else 0,
            seed=i,
            response_format=response_format,
        )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(20)))
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({a.choices[0].message.content for a in answers}) > 1
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0, response_format={"type": "json_object"}
    )
    if whole.choices[0].finish_reason == "stop":  # an unbounded object may run to the limit
        assert isinstance(json.loads(whole.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
        )
    assert refused.value.body["code"] == "invalid_schema" and refused.value.body["param"] == "response_format"


def _check_call(call, tool: dict) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def check_tool_calls(served: Served) -> None:
    """``tool_choice`` required, named and none, whole and streamed, in OpenAI's shapes."""
    client = served.client()
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 200}
    required = client.chat.completions.create(**base, tools=[WEATHER, TIME], tool_choice="required", temperature=0)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)

    chunks = list(
        client.chat.completions.create(
            **base, tools=[WEATHER, TIME], tool_choice="required", temperature=0, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    (streamed,) = deltas[0].tool_calls
    assert streamed.index == 0
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)

    for tool in (TIME, WEATHER):
        named = client.chat.completions.create(
            **base,
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": tool["function"]["name"]}},
        )
        assert named.choices[0].finish_reason == "tool_calls"
        _check_call(named.choices[0].message.tool_calls[0], tool)

    # The loop goes on: the call, its result, and an answer in text.
    turns = [
        *base["messages"],
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    after = client.chat.completions.create(
        model=MODEL, messages=turns, tools=[WEATHER, TIME], tool_choice="none", max_tokens=8, temperature=0
    )
    assert after.choices[0].message.tool_calls is None and after.choices[0].message.content

    none = client.chat.completions.create(
        **{**base, "max_tokens": 8}, tools=[WEATHER], tool_choice="none", temperature=0
    )
    assert none.choices[0].message.tool_calls is None and isinstance(none.choices[0].message.content, str)
    auto = client.chat.completions.create(**base, tools=[WEATHER], temperature=0)
    message = auto.choices[0].message
    auto_chunks = list(client.chat.completions.create(**base, tools=[WEATHER], temperature=0, stream=True))
    if message.tool_calls:
        _check_call(message.tool_calls[0], WEATHER)
        streamed_calls = [
            c.choices[0].delta.tool_calls for c in auto_chunks if c.choices and c.choices[0].delta.tool_calls
        ]
        assert streamed_calls[0][0].function.arguments == message.tool_calls[0].function.arguments
    else:  # text: streamed as it comes, once its first character says it is no call
        assert not message.content.startswith("<")
        pieces = [c.choices[0].delta.content for c in auto_chunks if c.choices and c.choices[0].delta.content]
        assert "".join(pieces) == message.content and len(pieces) > 1


def test_openai_api_chat_and_jobs_on_a_live_cluster(served: Served, redis_url: str) -> None:
    """One cluster for the API's, the chat's and the jobs' checks (a cluster takes 10 to 30 s to start
    and stop); the jobs' come last, as they kill and restart its Celery worker."""
    check_structured_output(served)
    check_tool_calls(served)
    check_openai_text(served)
    check_prefix_cache_per_tenant(served)
    check_sampling_and_stop(served)
    check_openai_errors(served)
    check_a_schema_past_a_mib_fails_alone_on_mains_link(served)
    check_logprobs(served)
    check_token_prompts(served)
    check_every_parameter_is_honoured_or_refused(served)
    check_answers_keep_to_openais_schema(served)
    check_responses_api(served)
    check_many_at_once(served)
    check_usage_and_quota(served)
    check_chat(served)
    check_chat_outlives_its_page_and_its_writer(served, redis_url)
    check_job_survives_its_worker_killed(served)
    check_job_stops_when_its_key_is_revoked(served)
    check_job_cancel(served)


def test_a_next_gate_deployment_serves_without_a_shadow(served_without_shadow: Served) -> None:
    """odmoe with main's next-layer router as its predictor: two agents (main, one worker), no shadow
    process anywhere, and the same tokens as Transformers. Its worker's experts are stored coded
    (exponent-plane): the shard set the Celery build made for it is coded, and no token changes."""
    served = served_without_shadow
    api = served.api(served.staff_key)
    (deployment,) = api.get("/api/deployments")["results"]
    assert deployment["predictor"] == "next-gate" and deployment["status"] == "ready"
    assert sorted(m["role"] for m in deployment["members"]) == ["main", "worker"]
    assert deployment["expert_codec"] == "exponent-plane"
    (model,) = api.get("/api/models")["results"]
    assert model["shard_expert_codec"] == "exponent-plane" and model["shard_workers"] == 1
    # The worker's agent reports the shard it fetched as coded (its next heartbeat, each second here),
    # and main's as not: what the fit check matches a held worker shard's codec against.
    worker = next(m for m in deployment["members"] if m["role"] == "worker")
    main = next(m for m in deployment["members"] if m["role"] == "main")
    deadline = time.monotonic() + 10
    while True:
        nodes = {n["id"]: n["inventory"] for n in api.get("/api/nodes")["results"]}
        codecs = {**nodes[worker["node"]].get("shard_codecs", {}), **nodes[main["node"]].get("shard_codecs", {})}
        if len(codecs) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert codecs == {f"{model['id']}/worker-0": "exponent-plane", f"{model['id']}/main": "none"}, codecs
    answer = api.post(f"/api/deployments/{deployment['id']}/generate", {"prompt_ids": PROMPTS[0], "max_new_tokens": 8})
    assert answer["token_ids"] == reference_generate(served.model_dir, PROMPTS[0], 8)
    check_openai_text(served)
    (deployment,) = served.api(served.staff_key).get("/api/deployments")["results"]
    main = next(m for m in deployment["members"] if m["role"] == "main")
    assert main["metrics"]["recall"] is not None  # main's own next-gate guesses, scored


def test_other_families_register_shard_deploy_and_chat(served_family: Served) -> None:
    """A Qwen2-MoE (bf16) or GraniteMoE checkpoint through the platform: registered, sharded by the
    Celery task, deployed on three agents; the OpenAI client and the browser chat get Transformers'
    own tokens."""
    (deployment,) = served_family.api(served_family.staff_key).get("/api/deployments")["results"]
    assert deployment["status"] == "ready"
    check_openai_text(served_family)
    check_chat(served_family)


@pytest.fixture
def served_bounded(transactional_db, redis_url: str, tmp_path, tiny_model) -> Iterator[Served]:
    """``served``, with at most 16 generations of one user in main at once (running and waiting)."""
    from tests.controlplane.conftest import tiny_cluster
    from tests.controlplane.live import purge_stale_tasks

    purge_stale_tasks()
    with tiny_cluster(tmp_path, tiny_model, redis_url, max_per_user=16) as (served, _):
        yield served


def test_one_key_sends_16_at_once_and_past_its_bound_is_told_so_while_another_user_gets_in(
    served_bounded: Served,
) -> None:
    """The issue's acceptance. One API key sends 16 completions at once (different prompts,
    temperature 0): all are answered (main runs 8 and queues the rest; before, the 5th was a
    429), each with the answer it gets alone. With 16 of its long ones in main (its bound here),
    its 17th is a 429 ``too_many_generations``, and another user's request is still taken."""
    served = served_bounded
    base = f"{served.plane.server}/v1"
    prompts = [f"Question {i}: which experts does token {i} need?" for i in range(16)]
    alice_sync = served.client()
    alone = [
        alice_sync.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in prompts
    ]

    async def scenario() -> tuple[list[str], openai.RateLimitError, str]:
        alice = openai.AsyncOpenAI(base_url=base, api_key=served.user_key, max_retries=0, timeout=300)
        bob = openai.AsyncOpenAI(base_url=base, api_key=served.other_key, max_retries=0, timeout=300)
        answers = await asyncio.gather(
            *(alice.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts)
        )
        together = [a.choices[0].text for a in answers]

        running = asyncio.Semaphore(0)

        async def long_one(prompt: str) -> None:
            stream = await alice.completions.create(
                model=MODEL, prompt=prompt, max_tokens=600, temperature=0, stream=True
            )
            running.release()
            async for _ in stream:  # until it is cancelled below
                pass

        longs = [asyncio.create_task(long_one(p)) for p in prompts]
        for _ in range(8):  # main's batch is running alice's first eight...
            await asyncio.wait_for(running.acquire(), timeout=120)
        await asyncio.sleep(3)  # ...and holds her other eight in its queue
        with pytest.raises(openai.RateLimitError) as refused:
            await alice.completions.create(model=MODEL, prompt="one more", max_tokens=4, temperature=0)
        assert not any(task.done() for task in longs)  # all sixteen of hers still in main
        # Bob asks now, while alice is at her bound: he waits in main's queue for his turn, not refused.
        taken = asyncio.create_task(bob.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0))
        await asyncio.sleep(3)
        assert not taken.done() or taken.exception() is None, taken
        for task in longs:  # alice's clients go away: their generations stop on the cluster
            task.cancel()
        await asyncio.gather(*longs, return_exceptions=True)
        bobs = await asyncio.wait_for(taken, timeout=120)
        await alice.close()
        await bob.close()
        return together, refused.value, bobs.choices[0].text

    together, refused, bobs = asyncio.run(scenario())
    assert together == alone  # all 16 answered, each as alone
    assert refused.status_code == 429 and refused.response.headers["Retry-After"] == "1"
    assert refused.body["code"] == "too_many_generations" and refused.body["type"] == "rate_limit_error"
    assert "16 generations running or waiting" in refused.body["message"]
    assert bobs == alone[0]
