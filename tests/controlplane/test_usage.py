"""Usage per user and key: every generation's tokens counted once, per (user, key, deployment, UTC
day), by one race-free write; the daily quota decided at the edge; shown on the keys page, in
the console and at /metrics. The live half (the OpenAI client on a cluster) is in test_serving_e2e."""

from __future__ import annotations

import asyncio
import json
import threading
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connections
from django.test import Client
from rest_framework.test import APIClient

from controlplane.accounts.models import ApiKey, TokenUsage
from controlplane.accounts.selectors import key_usage, usage_by_user_and_deployment, usage_series
from controlplane.accounts.services import QuotaExceeded, check_quota, create_api_key, record_usage, tokens_today
from controlplane.accounts.usage import Caller, next_reset, quota_refusal, utc_day

pytestmark = pytest.mark.django_db(transaction=True)  # the OpenAI views are async: other threads

NOON = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


@pytest.fixture
def alice():
    return get_user_model().objects.create_user("alice", password="a-long-test-password")


@pytest.fixture
def staff():
    return get_user_model().objects.create_user("admin", password="a-long-test-password", is_staff=True)


def usage_rows() -> list[tuple]:
    fields = ("user__username", "api_key_id", "deployment", "day", "prompt_tokens", "completion_tokens", "generations")
    return list(TokenUsage.objects.order_by("pk").values_list(*fields))


# The decisions, pure.


def test_a_day_is_a_utc_day_and_a_quota_resets_at_the_next_utc_midnight() -> None:
    late_in_tokyo = datetime(2026, 12, 6, 8, 30, tzinfo=UTC).astimezone(ZoneInfo("Asia/Tokyo"))
    assert utc_day(late_in_tokyo) == date(2026, 12, 6)
    assert next_reset(datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC)) == datetime(2027, 1, 1, tzinfo=UTC)
    assert next_reset(datetime(2026, 12, 5, 0, 0, tzinfo=UTC)) == datetime(2026, 12, 6, tzinfo=UTC)


def test_the_quota_decision_refuses_from_the_quota_on_and_says_when_it_resets() -> None:
    assert quota_refusal(quota=None, used=10**12, now=NOON) is None  # unlimited
    assert quota_refusal(quota=100, used=99, now=NOON) is None  # below: a generation may start
    refused = quota_refusal(quota=100, used=100, now=NOON)
    assert isinstance(refused, QuotaExceeded)
    assert refused.retry_after_s == 12 * 3600 and refused.resets_at == datetime(2026, 12, 6, tzinfo=UTC)
    assert "100 of 100 tokens" in str(refused) and "resets at 2026-12-06T00:00:00Z (UTC midnight)" in str(refused)
    past = quota_refusal(quota=100, used=250, now=datetime(2026, 12, 5, 23, 59, 59, 500000, tzinfo=UTC))
    assert past is not None and past.retry_after_s == 1  # never 0: a client would retry at once


# Counting.


def test_usage_grows_one_row_per_user_key_deployment_and_day(alice) -> None:
    key, _ = create_api_key(user=alice, scopes=["inference"])
    other, _ = create_api_key(user=alice, scopes=["inference"])
    record_usage(caller=Caller(alice.pk, key.pk), deployment="d", prompt_tokens=5, completion_tokens=3, now=NOON)
    record_usage(caller=Caller(alice.pk, key.pk), deployment="d", prompt_tokens=7, completion_tokens=1, now=NOON)
    record_usage(caller=Caller(alice.pk, other.pk), deployment="d", prompt_tokens=1, completion_tokens=1, now=NOON)
    record_usage(caller=Caller(alice.pk), deployment="d", prompt_tokens=2, completion_tokens=2, now=NOON)
    record_usage(caller=Caller(alice.pk), deployment="d", prompt_tokens=2, completion_tokens=0, now=NOON)
    record_usage(caller=Caller(alice.pk, key.pk), deployment="e", prompt_tokens=4, completion_tokens=4, now=NOON)
    tomorrow = NOON + timedelta(days=1)
    record_usage(caller=Caller(alice.pk, key.pk), deployment="d", prompt_tokens=9, completion_tokens=9, now=tomorrow)
    day, next_day = date(2026, 12, 5), date(2026, 12, 6)
    assert usage_rows() == [
        ("alice", key.pk, "d", day, 12, 4, 2),
        ("alice", other.pk, "d", day, 1, 1, 1),
        ("alice", None, "d", day, 4, 2, 2),  # a browser session's: one row too, however many
        ("alice", key.pk, "e", day, 4, 4, 1),
        ("alice", key.pk, "d", next_day, 9, 9, 1),
    ]
    assert tokens_today(key=key, now=NOON) == 24  # both deployments, prompt and completion
    with pytest.raises(ValueError, match="negative"):
        record_usage(caller=Caller(alice.pk, key.pk), deployment="d", prompt_tokens=-1, completion_tokens=0, now=NOON)
    assert usage_rows()[0] == ("alice", key.pk, "d", day, 12, 4, 2)  # bad input changes nothing


@pytest.mark.parametrize("with_key", [True, False], ids=["key", "session"])
def test_concurrent_increments_of_one_row_all_count(alice, with_key: bool) -> None:
    """Writers at once on one (user, key, deployment, day), its row not there yet: all of them race to
    create it; one does, the others add to it. Run with ODMOE_TEST_DATABASE=postgres and =sqlite."""
    key = create_api_key(user=alice, scopes=["inference"])[0] if with_key else None
    caller = Caller(alice.pk, key.pk if key else None)
    writers, rounds = 6, 5
    start = threading.Barrier(writers)
    failures: list[BaseException] = []

    def write(i: int) -> None:
        try:
            start.wait(timeout=10)
            for _ in range(rounds):
                record_usage(caller=caller, deployment="d", prompt_tokens=10, completion_tokens=i, now=NOON)
        except BaseException as exc:
            failures.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures, failures
    expected = ("alice", caller.api_key_id, "d", date(2026, 12, 5), 10 * writers * rounds, rounds * sum(range(writers)))
    assert usage_rows() == [(*expected, writers * rounds)]


def test_a_key_is_held_to_its_own_quota_today_and_a_session_to_none(alice) -> None:
    capped, _ = create_api_key(user=alice, scopes=["inference"], daily_token_quota=10)
    free, _ = create_api_key(user=alice, scopes=["inference"])
    check_quota(key=capped, now=NOON)
    record_usage(caller=Caller(alice.pk, capped.pk), deployment="d", prompt_tokens=6, completion_tokens=3, now=NOON)
    record_usage(caller=Caller(alice.pk, free.pk), deployment="d", prompt_tokens=500, completion_tokens=0, now=NOON)
    record_usage(caller=Caller(alice.pk), deployment="d", prompt_tokens=500, completion_tokens=0, now=NOON)
    check_quota(key=capped, now=NOON)  # 9 of 10: the next generation may start (and may end past 10)
    record_usage(caller=Caller(alice.pk, capped.pk), deployment="e", prompt_tokens=1, completion_tokens=0, now=NOON)
    with pytest.raises(QuotaExceeded, match="10 of 10 tokens"):
        check_quota(key=capped, now=NOON)  # every deployment counts
    check_quota(key=capped, now=NOON + timedelta(days=1))  # a new UTC day
    check_quota(key=free, now=NOON)
    check_quota(key=None, now=NOON)


@pytest.mark.parametrize("quota", [0, -5, 10**16])
def test_a_quota_out_of_bounds_is_refused_and_makes_no_key(alice, quota: int) -> None:
    with pytest.raises(ValueError, match="daily token quota"):
        create_api_key(user=alice, scopes=["inference"], daily_token_quota=quota)
    client = APIClient()
    client.force_authenticate(alice)
    answer = client.post("/api/keys", {"scopes": ["inference"], "daily_token_quota": quota}, format="json")
    assert answer.status_code == 400 and "daily_token_quota" in answer.json()
    with pytest.raises(CommandError, match="daily token quota"):
        call_command("create_api_key", "alice", "--daily-token-quota", str(quota))
    assert not ApiKey.objects.exists()


def test_generation_counts_every_generation_where_it_passes(channel_layer_on_test_redis, tiny_model: Path) -> None:
    """The one place tokens are counted: main's result counts its prompt and every generated token
    before the caller sees it; a generation left before its end counts the prompt and what came."""
    from controlplane.artifacts.services import register_model
    from controlplane.deployments.generation import astream, new_request
    from controlplane.deployments.models import Deployment, DeploymentNode, DeploymentStatus, Role
    from inference.wire.generation import Done, Token
    from tests.controlplane.test_storable import enrolled, link

    alice = get_user_model().objects.create_user("alice")
    key, _ = create_api_key(user=alice, scopes=["inference"])
    node, secret = enrolled()
    deployment = Deployment.objects.create(
        name="d", model=register_model(name="tiny", path=str(tiny_model)), status=DeploymentStatus.READY
    )
    DeploymentNode.objects.create(deployment=deployment, node=node, role=Role.MAIN, port=9300)

    caller = Caller(alice.pk, key.pk)

    async def generation(comm, finish: bool) -> list:
        request = new_request(prompt_ids=[1, 2, 3], max_new_tokens=8)
        events = astream(deployment.pk, request, caller=caller)
        first = asyncio.ensure_future(events.__anext__())
        await comm.receive_json_from(timeout=10)  # main's command
        for index, token in enumerate((5, 6)):
            await comm.send_json_to(Token(request_id=request.request_id, index=index, token_id=token).to_json())
        await first
        await events.__anext__()
        rows = []
        if finish:
            done = Done(request_id=request.request_id, token_ids=[5, 6, 7], finish_reason="length", metrics={})
            await comm.send_json_to(done.to_json())
            await events.__anext__()
            rows = await asyncio.to_thread(usage_rows)  # counted before the result was handed on
        await events.aclose()  # finished, or the client went away
        return rows

    async def session() -> tuple[list, list]:
        comm = link(node, secret)
        assert (await comm.connect())[0]
        try:
            at_done = await generation(comm, True)
            await generation(comm, False)  # two tokens came, then it was left
            return at_done, await asyncio.to_thread(usage_rows)
        finally:
            await comm.disconnect()

    at_done, after_both = async_to_sync(session)()
    today = utc_day(datetime.now(UTC))
    assert at_done == [("alice", key.pk, "d", today, 3, 3, 1)]
    assert after_both == [("alice", key.pk, "d", today, 6, 5, 2)]


# Where it is shown and enforced.


def test_the_keys_page_shows_each_keys_tokens_and_quota_and_makes_a_key_with_one(alice) -> None:
    key, _ = create_api_key(user=alice, name="harness", scopes=["inference"], daily_token_quota=5000)
    now = datetime.now(UTC)
    record_usage(caller=Caller(alice.pk, key.pk), deployment="d", prompt_tokens=120, completion_tokens=3, now=now)
    record_usage(
        caller=Caller(alice.pk, key.pk),
        deployment="d",
        prompt_tokens=1000,
        completion_tokens=0,
        now=now - timedelta(days=3),
    )
    record_usage(  # outside the 30 days
        caller=Caller(alice.pk, key.pk),
        deployment="d",
        prompt_tokens=9,
        completion_tokens=0,
        now=now - timedelta(days=30),
    )
    browser = Client()
    browser.force_login(alice)
    page = browser.get("/keys/").content.decode()
    row = page[page.index(f'data-key="{key.pk}"') :]
    row = row[: row.index("</tr>")]
    assert '<td class="tokens-today">123</td>' in row and '<td class="tokens-window">1123</td>' in row
    assert '<td class="quota">5000</td>' in row

    made = browser.post("/keys/", {"name": "capped", "scopes": ["inference"], "daily_token_quota": "77"})
    assert made.status_code == 200 and "created-key" in made.content.decode()
    capped = ApiKey.objects.get(name="capped")
    assert capped.daily_token_quota == 77
    assert '<td class="quota">unlimited</td>' not in made.content.decode()

    api = APIClient()
    api.force_authenticate(alice)
    listed = {k["name"]: k for k in api.get("/api/keys").json()["results"]}
    assert (listed["harness"]["tokens_today"], listed["harness"]["tokens_last_30_days"]) == (123, 1123)
    assert (listed["capped"]["tokens_today"], listed["capped"]["daily_token_quota"]) == (0, 77)
    created = api.post("/api/keys", {"name": "api", "scopes": ["inference"], "daily_token_quota": 9}, format="json")
    assert created.status_code == 201 and created.json()["daily_token_quota"] == 9
    call_command("create_api_key", "alice", "--name", "cli", "--daily-token-quota", "11")
    assert ApiKey.objects.get(name="cli").daily_token_quota == 11
    assert ApiKey.objects.get(name="api").daily_token_quota == 9


def test_the_console_shows_usage_per_user_and_deployment(alice, staff) -> None:
    key, _ = create_api_key(user=alice, scopes=["inference"])
    now = datetime.now(UTC)
    record_usage(caller=Caller(alice.pk, key.pk), deployment="mixtral", prompt_tokens=40, completion_tokens=2, now=now)
    record_usage(caller=Caller(alice.pk), deployment="mixtral", prompt_tokens=10, completion_tokens=8, now=now)
    record_usage(caller=Caller(staff.pk), deployment="tiny", prompt_tokens=1, completion_tokens=1, now=now)
    assert [
        (r.username, r.deployment, r.spent.prompt_today, r.spent.completion_window)
        for r in usage_by_user_and_deployment()
    ] == [("alice", "mixtral", 50, 10), ("admin", "tiny", 1, 1)]
    browser = Client()
    browser.force_login(alice)
    assert browser.get("/console/").status_code == 302  # staff only
    browser.force_login(staff)
    page = browser.get("/console/").content.decode()
    rows = page[page.index('id="usage-rows"') :]
    assert "<tr><td>alice</td><td>mixtral</td><td>50</td>\n      <td>10</td><td>50</td><td>10</td></tr>" in rows
    assert "<td>admin</td><td>tiny</td>" in rows


def test_metrics_export_usage_per_user_key_and_deployment_and_never_the_secret(alice, staff) -> None:
    key, secret = create_api_key(user=alice, scopes=["inference"])
    _, scrape = create_api_key(user=staff, scopes=["metrics"])
    now = datetime.now(UTC)
    record_usage(caller=Caller(alice.pk, key.pk), deployment="d", prompt_tokens=40, completion_tokens=2, now=now)
    record_usage(caller=Caller(alice.pk), deployment="d", prompt_tokens=10, completion_tokens=8, now=now)
    idle, _ = create_api_key(user=alice, scopes=["inference"])  # idle for 31 days: its series has ended
    record_usage(
        caller=Caller(alice.pk, idle.pk),
        deployment="d",
        prompt_tokens=1,
        completion_tokens=1,
        now=now - timedelta(days=31),
    )
    assert len(usage_series()) == 2
    text = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {scrape}").content.decode()
    labels = f'deployment="d",key_id="{key.pk}",key_prefix="{key.prefix}",user="alice"'
    assert f"odmoe_usage_prompt_tokens_total{{{labels}}} 40.0" in text
    assert f"odmoe_usage_completion_tokens_total{{{labels}}} 2.0" in text
    assert f"odmoe_usage_generations_total{{{labels}}} 1.0" in text
    assert 'odmoe_usage_prompt_tokens_total{deployment="d",key_id="",key_prefix="",user="alice"} 10.0' in text
    assert f'key_id="{idle.pk}"' not in text and "odmoe_usage_series_left_out 0.0" in text
    assert secret not in text and secret[len("odmoe-key-") :][6:] not in text


def test_a_spent_key_is_refused_at_every_edge_before_anything_runs(alice, staff, tiny_model: Path) -> None:
    from controlplane.artifacts.services import register_model
    from controlplane.deployments.models import Deployment, DeploymentStatus

    key, secret = create_api_key(user=alice, scopes=["inference"], daily_token_quota=10)
    record_usage(caller=Caller(alice.pk, key.pk), deployment="d", prompt_tokens=8, completion_tokens=4)
    body = json.dumps({"model": "none", "messages": [{"role": "user", "content": "hi"}]})
    answer = Client().post(
        "/v1/chat/completions", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {secret}"
    )
    assert answer.status_code == 429
    error = answer.json()["error"]
    assert (error["code"], error["type"], error["param"]) == ("quota_exceeded", "insufficient_quota", None)
    assert "12 of 10 tokens" in error["message"] and "UTC midnight" in error["message"]
    wait = int(answer["Retry-After"])
    assert 1 <= wait <= 86400 and answer["x-should-retry"] == "false"
    assert f"in {wait} s" in error["message"] or f"in {wait + 1} s" in error["message"]

    jobs = APIClient()
    jobs.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    refused = jobs.post("/api/jobs", {"model": "none", "prompt": "x"}, format="json")
    assert refused.status_code == 429 and refused.json()["code"] == "quota_exceeded" and refused["Retry-After"]
    # The same user through a browser session, or another key of theirs, has no quota of its own.
    browser = Client()
    browser.force_login(alice)
    assert (
        browser.post("/api/jobs", {"model": "none", "prompt": "x"}, content_type="application/json").status_code == 404
    )
    assert key_usage(keys=[key])[key.pk].today == 12

    # A deployment's generate call (staff), through a staff key with a spent quota.
    deployment = Deployment.objects.create(
        name="d", model=register_model(name="tiny", path=str(tiny_model)), status=DeploymentStatus.READY
    )
    operator, operator_secret = create_api_key(user=staff, scopes=["inference"], daily_token_quota=1)
    record_usage(caller=Caller(staff.pk, operator.pk), deployment="d", prompt_tokens=1, completion_tokens=0)
    check = APIClient()
    check.credentials(HTTP_AUTHORIZATION=f"Bearer {operator_secret}")
    generate = check.post(f"/api/deployments/{deployment.pk}/generate", {"prompt_ids": [1, 2]}, format="json")
    assert generate.status_code == 429 and "1 of 1 tokens" in generate.json()["detail"] and generate["Retry-After"]
    assert TokenUsage.objects.filter(api_key=operator).get().generations == 1  # nothing ran, nothing counted
