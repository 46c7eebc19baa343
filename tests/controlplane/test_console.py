"""The console: staff only, its websocket sends the cluster's state as it changes, and its forms act through the API."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.core.cache import caches
from django.test import Client

from controlplane.artifacts.services import register_model
from controlplane.console.consumers import ConsoleConsumer
from controlplane.deployments.generation import astream, new_request
from controlplane.deployments.models import Deployment, DeploymentNode, DeploymentStatus, Role
from controlplane.deployments.services import DEFAULT_MAX_BATCH
from controlplane.nodes.models import Node
from controlplane.nodes.services import create_join_token, enroll_node
from controlplane.nodes.step_watch import SHARED_CACHE, WATCH_KEY
from inference.constants import MAX_BATCH
from inference.wire.generation import Done
from tests.controlplane.test_storable import enrolled, link


@pytest.mark.django_db(transaction=True)
def test_the_console_socket_is_for_staff_and_sends_changes() -> None:
    users = get_user_model().objects
    staff, reader = users.create_user("boss", is_staff=True), users.create_user("reader")
    _, token = create_join_token(created_by=None)
    enroll_node(token=token, name="box-1", inventory={"gpus": [{"name": "RTX 3090", "memory_bytes": 24 * 2**30}]})

    async def session(user) -> list[dict]:
        comm = WebsocketCommunicator(ConsoleConsumer.as_asgi(), "/ws/console/")
        comm.scope["user"] = user
        connected, code = await comm.connect()
        if not connected:
            return [{"refused": code}]
        first = await comm.receive_json_from(timeout=5)
        await database_sync_to_async(Node.objects.filter(name="box-1").update)(name="box-renamed")
        second = await comm.receive_json_from(timeout=5)
        await comm.disconnect()
        return [first, second]

    assert async_to_sync(session)(reader) == [{"refused": 4403}]
    first, second = async_to_sync(session)(staff)
    assert first["type"] == "snapshot" and first["nodes"][0]["name"] == "box-1"
    assert first["nodes"][0]["gpus"] == [{"name": "RTX 3090", "memory_bytes": 24 * 2**30}]
    assert second["nodes"][0]["name"] == "box-renamed"


@pytest.mark.django_db(transaction=True)
def test_generations_ask_main_for_step_reports_only_while_a_console_watches(
    channel_layer_on_test_redis, tiny_model: Path
) -> None:
    """A step report is most of a token's bytes at every hop, and only the console's live view
    reads it: a generation asks for reports once a console is open, not before."""
    staff = get_user_model().objects.create_user("boss", is_staff=True)
    node, secret = enrolled()
    deployment = Deployment.objects.create(
        name="d", model=register_model(name="tiny", path=str(tiny_model)), status=DeploymentStatus.READY
    )
    DeploymentNode.objects.create(deployment=deployment, node=node, role=Role.MAIN, port=9300)
    caches[SHARED_CACHE].delete(WATCH_KEY)  # a console of an earlier test may have marked it

    async def sent(agent: WebsocketCommunicator) -> dict:
        """What main's agent is sent for a generation (which is then answered at once)."""
        request = new_request(prompt_ids=[1, 2, 3], max_new_tokens=1)
        events = astream(deployment.pk, request)
        first = asyncio.ensure_future(events.__anext__())
        command = await agent.receive_json_from(timeout=10)
        await agent.send_json_to(
            Done(request_id=request.request_id, token_ids=[5], finish_reason="length", metrics={}).to_json()
        )
        await first
        await events.aclose()
        return command

    async def session() -> tuple[dict, dict]:
        agent = link(node, secret)
        assert (await agent.connect())[0]
        console = WebsocketCommunicator(ConsoleConsumer.as_asgi(), "/ws/console/")
        console.scope["user"] = staff
        try:
            unwatched = await sent(agent)
            assert (await console.connect())[0]
            await console.receive_json_from(timeout=5)  # its first snapshot: it has marked the view open
            watched = await sent(agent)
            return unwatched, watched
        finally:
            await console.disconnect()
            await agent.disconnect()

    unwatched, watched = async_to_sync(session)()
    assert unwatched["type"] == watched["type"] == "generate"
    assert unwatched["step_reports"] is False and watched["step_reports"] is True


def test_without_redis_a_console_still_marks_in_vain_and_no_step_reports_are_asked_for(settings) -> None:
    from controlplane.nodes import step_watch
    from inference.runtime.launcher import free_port

    settings.CACHES = {
        **settings.CACHES,
        "shared": {**settings.CACHES["shared"], "LOCATION": f"redis://127.0.0.1:{free_port()}/0"},
    }

    async def both() -> bool:
        await step_watch.mark_watched()  # logged, not raised: the console's view goes on
        return await step_watch.watched()

    assert async_to_sync(both)() is False


@pytest.mark.django_db
def test_the_console_pages_are_for_staff() -> None:
    users = get_user_model().objects
    browser = Client()
    assert browser.get("/console/").status_code == 302  # to the login page
    browser.force_login(users.create_user("reader"))
    assert browser.get("/console/").status_code == 302
    browser.force_login(users.create_user("boss", is_staff=True))
    page = browser.get("/console/")
    assert page.status_code == 200 and b"Create join token" in page.content and "csrftoken" in page.cookies
    assert browser.get("/console/state.json").json()["nodes"] == []


@pytest.mark.django_db
def test_the_deployment_form_sets_max_batch_within_its_limits(tiny_model: Path) -> None:
    """The form's max_batch field and what its script posts, as the staff user's session with its CSRF token."""
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(get_user_model().objects.create_user("boss", is_staff=True))
    page = browser.get("/console/")
    field = f'<input name="max_batch" type="number" min="1" max="{MAX_BATCH}" value="{DEFAULT_MAX_BATCH}" required>'
    assert field in page.content.decode() and b"sequences main runs at once; more wait in a queue" in page.content
    model = register_model(name="tiny", path=str(tiny_model))
    nodes = []
    for name in ("a", "b", "c"):
        _, token = create_join_token(created_by=None)
        nodes.append(str(enroll_node(token=token, name=name, inventory={"gpus": [{"memory_bytes": 8 * 2**30}]})[0].pk))
    form = {"name": "batched", "model": model.pk, "nodes": nodes, "shadow_dtype": "fp32", "strategy": "odmoe"}
    form |= {"token_period": 1, "kv_period": 1}

    def post(path: str, body: dict):
        headers = {"HTTP_X_CSRFTOKEN": page.cookies["csrftoken"].value}
        return browser.post(path, json.dumps(body), content_type="application/json", **headers)

    for bad in (0, 999, "abc", None):  # None: what the script sends for a field that is not a number
        refused = post("/api/deployments/suggest", {**form, "max_batch": bad})
        assert refused.status_code == 400 and "max_batch" in refused.json(), refused.content
        refused = post("/api/deployments", {**form, "max_batch": bad})
        assert refused.status_code == 400 and "max_batch" in refused.json(), refused.content
        assert Deployment.objects.count() == 0
    # As the form does: suggest roles for the batch, then create with them.
    roles = post("/api/deployments/suggest", {**form, "max_batch": 3})
    assert roles.status_code == 200, roles.content
    created = post("/api/deployments", {**form, "max_batch": 3, "roles": roles.json()})
    assert created.status_code == 201, created.content
    assert created.json()["max_batch"] == 3 and Deployment.objects.get().max_batch == 3
    assert browser.get("/console/state.json").json()["deployments"][0]["max_batch"] == 3


@pytest.mark.django_db
def test_the_deployment_form_sets_a_users_bound_below_the_batch_and_queue(tiny_model: Path) -> None:
    """The form's max_per_user field, what its script posts, and the role spec main gets: 1 up to
    below max_batch + main's queue (64), so that one user leaves the others a place."""
    from controlplane.deployments.lifecycle import role_spec

    browser = Client(enforce_csrf_checks=True)
    browser.force_login(get_user_model().objects.create_user("boss", is_staff=True))
    page = browser.get("/console/")
    field = '<input name="max_per_user" type="number" min="1" max="127" value="32" required>'
    assert field in page.content.decode(), page.content.decode()
    model = register_model(name="tiny", path=str(tiny_model))
    nodes = []
    for name in ("a", "b", "c"):
        _, token = create_join_token(created_by=None)
        nodes.append(str(enroll_node(token=token, name=name, inventory={"gpus": [{"memory_bytes": 8 * 2**30}]})[0].pk))
    form = {"name": "bounded", "model": model.pk, "nodes": nodes, "shadow_dtype": "fp32", "strategy": "odmoe"}
    form |= {"token_period": 1, "kv_period": 1, "max_batch": 8}

    def post(body: dict):
        headers = {"HTTP_X_CSRFTOKEN": page.cookies["csrftoken"].value}
        return browser.post("/api/deployments", json.dumps(body), content_type="application/json", **headers)

    for bad in (0, 72, 128, "abc", None):  # 72: not below 8 + 64
        refused = post({**form, "max_per_user": bad})
        assert refused.status_code == 400 and "max_per_user" in str(refused.json()), refused.content
        assert Deployment.objects.count() == 0
    created = post({**form, "max_per_user": 71})
    assert created.status_code == 201, created.content
    deployment = Deployment.objects.get()
    assert created.json()["max_per_user"] == 71 and deployment.max_per_user == 71
    assert browser.get("/console/state.json").json()["deployments"][0]["max_per_user"] == 71
    members = list(deployment.members.select_related("node"))
    main = next(m for m in members if m.role == "main")
    assert role_spec(deployment, main, members)["settings"]["max_per_user"] == 71
    from controlplane.deployments.api import DeploymentListApi

    assert DeploymentListApi.InputSerializer().fields["max_per_user"].default == 32  # left out: 32


@pytest.mark.django_db
def test_the_deployment_form_chooses_a_predictor_and_a_next_gate_deployment_has_no_shadow(tiny_model: Path) -> None:
    """The form's Predictor select, and what its script posts with it: two nodes are a whole next-gate deployment."""
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(get_user_model().objects.create_user("boss", is_staff=True))
    page = browser.get("/console/")
    html = page.content.decode()
    options = (
        '<option value="">strategy\'s own</option>'
        "<option>shadow</option><option>next-gate</option><option>prerouter</option>"
    )
    assert f'<select name="predictor">{options}</select>' in html
    # The script reads each strategy's own predictor to count the workers of its estimate.
    assert '<script id="own-predictors" type="application/json">' in html
    # An approximate strategy is offered with its mark.
    assert '<option value="importance">importance (approximate)</option>' in html
    assert '<option value="odmoe">odmoe</option>' in html
    assert '"odmoe": "shadow"' in html and '"full-cache": null' in html and '"lru-offload": "next-gate"' in html
    model = register_model(name="tiny", path=str(tiny_model))
    nodes = []
    for name in ("a", "b"):
        _, token = create_join_token(created_by=None)
        nodes.append(str(enroll_node(token=token, name=name, inventory={"gpus": [{"memory_bytes": 8 * 2**30}]})[0].pk))
    form = {"name": "gated", "model": model.pk, "nodes": nodes, "shadow_dtype": "fp32", "strategy": "odmoe"}
    form |= {"token_period": 1, "kv_period": 1, "max_batch": 8}

    def post(path: str, body: dict):
        headers = {"HTTP_X_CSRFTOKEN": page.cookies["csrftoken"].value}
        return browser.post(path, json.dumps(body), content_type="application/json", **headers)

    refused = post("/api/deployments/suggest", {**form, "predictor": ""})  # the shadow's: a third node needed
    assert refused.status_code == 400 and "at least 3 nodes" in refused.json()["detail"]
    bad = post("/api/deployments", {**form, "strategy": "full-cache", "predictor": "next-gate"})
    assert bad.status_code == 400 and "takes no predictor" in bad.json()["detail"]
    roles = post("/api/deployments/suggest", {**form, "predictor": "next-gate"})
    assert roles.status_code == 200 and roles.json()["shadow"] is None, roles.content
    created = post("/api/deployments", {**form, "predictor": "next-gate", "roles": roles.json()})
    assert created.status_code == 201, created.content
    shown = browser.get("/console/state.json").json()["deployments"][0]
    assert shown["predictor"] == "next-gate" and sorted(m["role"] for m in shown["members"]) == ["main", "worker-0"]
    estimate = post(
        "/api/deployments/estimate", {"model": model.pk, "workers": 1, "strategy": "odmoe", "predictor": "next-gate"}
    )
    assert estimate.status_code == 200 and "shadow" not in {r["role"] for r in estimate.json()["memory"]["roles"]}


@pytest.mark.django_db
def test_the_build_shards_form_offers_the_expert_codec_and_builds_the_set_chosen(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks
) -> None:
    """Each model's *Build shards* form: its codec select is the declaration's choices and default (what
    its script reads from the page), and what the script posts queues that codec's set, as the API does;
    a codec the build does not know is a 400 naming the allowed ones, and nothing is queued."""
    from controlplane.artifacts import services as artifacts
    from controlplane.artifacts.models import ModelArtifact, ShardStatus
    from inference.settings import info

    queued: list[tuple] = []
    monkeypatch.setattr(artifacts, "queue_task", lambda *args: queued.append(args))
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(get_user_model().objects.create_user("boss", is_staff=True))
    page = browser.get("/console/")
    html = page.content.decode()
    codecs = {"choices": list(info("expert_codec").choices), "default": info("expert_codec").default}
    assert codecs == {"choices": ["none", "exponent-plane"], "default": "none"}
    assert f'<script id="expert-codecs" type="application/json">{json.dumps(codecs)}</script>' in html
    # The deployment form's select is the same declaration's.
    assert '<select name="expert_codec"><option selected>none</option><option>exponent-plane</option></select>' in html
    model = register_model(name="tiny", path=str(tiny_model))

    def build(body: dict):
        headers = {"HTTP_X_CSRFTOKEN": page.cookies["csrftoken"].value}
        url = f"/api/models/{model.pk}/shards"
        with django_capture_on_commit_callbacks(execute=True):
            return browser.post(url, json.dumps(body), content_type="application/json", **headers)

    # What the page's error line shows is the answer's text: the field, and for a value every allowed one.
    for bad, said in [("zstd", '"zstd" is not a valid expert_codec; allowed: none, exponent-plane'), ("", "allowed")]:
        refused = build({"workers": 2, "expert_codec": bad})
        assert refused.status_code == 400 and said in refused.json()["expert_codec"][0], refused.content
        assert ModelArtifact.objects.get().shard_status == ShardStatus.NONE and queued == []  # nothing queued
    done = build({"workers": 2, "expert_codec": "exponent-plane"})  # what the script sends for the choice
    assert done.status_code == 202, done.content
    assert done.json()["shard_status"] == "building" and done.json()["shard_expert_codec"] == "exponent-plane"
    assert queued == [(artifacts.BUILD_MODEL_SHARDS_TASK, model.pk, 2, "exponent-plane")]
    shown = browser.get("/console/state.json").json()["models"][0]
    assert (shown["shard_workers"], shown["shard_expert_codec"]) == (2, "exponent-plane")
    # Left at its default, the form sends "none", which is also what the API takes when it is left out.
    ModelArtifact.objects.update(shard_status=ShardStatus.NONE)
    assert build({"workers": 1, "expert_codec": codecs["default"]}).status_code == 202
    assert queued[-1] == (artifacts.BUILD_MODEL_SHARDS_TASK, model.pk, 1, "none")


@pytest.mark.django_db
def test_metrics_are_in_prometheus_format_for_staff_only() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from controlplane.accounts.services import create_api_key
    from controlplane.serving import metrics

    users = get_user_model().objects
    _, staff_key = create_api_key(user=users.create_user("ops", is_staff=True))
    _, user_key = create_api_key(user=users.create_user("someone"))
    metrics.record(
        "openai_chat",
        ok=True,
        prompt_tokens=5,
        metrics={
            "generated_tokens": 9,
            "ttft_ms": 40.0,
            "decode_tok_s": 20.0,
            "recall": 0.98,
            "decode_layer_load_wait_ms_median": 0.4,
            "drafts": {"drafted": 8, "accepted": 6, "decode_passes": 3, "distinct_experts": 3.5},
        },
    )
    client = Client()
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {user_key}").status_code == 401
    answer = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {staff_key}")
    assert answer.status_code == 200 and answer["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(answer.content.decode())}
    requests = {
        tuple(s.labels.values()): s.value for s in families["odmoe_requests"].samples if s.name.endswith("_total")
    }
    assert requests[("openai_chat", "ok")] >= 1
    drafts = {
        name: sum(s.value for s in families[name].samples if s.name.endswith("_total"))
        for name in ("odmoe_drafted_tokens", "odmoe_accepted_drafts", "odmoe_drafted_decode_passes")
    }
    assert drafts["odmoe_drafted_tokens"] >= 8 and drafts["odmoe_accepted_drafts"] >= 6
    assert drafts["odmoe_drafted_decode_passes"] >= 3
    assert {
        "odmoe_time_to_first_token_seconds",
        "odmoe_decode_seconds",
        "odmoe_routing_recall_ratio",
        "odmoe_expert_load_wait_seconds",
        "odmoe_generated_tokens",
        "odmoe_nodes",
        "odmoe_jobs",
    } <= set(families)
    nodes = {s.labels["status"]: s.value for s in families["odmoe_nodes"].samples}
    assert nodes == {"enrolled": 0, "online": 0, "offline": 0, "draining": 0}
