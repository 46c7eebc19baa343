"""Limits: login lockout (django-axes), DRF throttles per user and per address, and the cap on one
user's generations at once (a 429 with Retry-After, in OpenAI's error shape)."""

from __future__ import annotations

import asyncio
import json

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.test import Client
from rest_framework.test import APIClient

from controlplane import throttles
from controlplane.accounts.services import create_api_key

pytestmark = pytest.mark.django_db(transaction=True)
PASSWORD = "a-long-test-password"


@pytest.fixture(autouse=True)
def fresh_counts():
    cache.clear()
    yield
    cache.clear()


def test_five_failed_logins_lock_that_username_from_that_address_out(settings) -> None:
    """The fifth failure locks the pair out; the right password does not get through until the cool-off."""
    get_user_model().objects.create_user("alice", password=PASSWORD)
    browser = Client(REMOTE_ADDR="10.0.0.7")
    codes = [
        browser.post("/accounts/login/", {"username": "alice", "password": "wrong"}).status_code
        for _ in range(settings.AXES_FAILURE_LIMIT)
    ]
    assert codes == [200] * (settings.AXES_FAILURE_LIMIT - 1) + [429]  # the form with its error, then locked
    locked = browser.post("/accounts/login/", {"username": "alice", "password": PASSWORD})
    assert locked.status_code == 429  # even the right password, until the cool-off ends
    elsewhere = Client(REMOTE_ADDR="10.0.0.8").post("/accounts/login/", {"username": "alice", "password": PASSWORD})
    assert elsewhere.status_code == 302  # another address is not locked out


def test_failed_logins_spread_over_addresses_lock_the_username_out_everywhere(settings) -> None:
    """A guesser on many addresses, each below the pair's limit, still gets only
    LOGIN_USERNAME_FAILURE_LIMIT tries; then the username is locked out from every address,
    a fresh one too, and the owner's own success elsewhere does not lift it."""
    get_user_model().objects.create_user("alice", password=PASSWORD)
    per_address = settings.AXES_FAILURE_LIMIT - 1  # never enough to lock a pair
    addresses = [f"10.1.0.{i}" for i in range(settings.LOGIN_USERNAME_FAILURE_LIMIT // per_address + 1)]
    failures = [a for a in addresses for _ in range(per_address)][: settings.LOGIN_USERNAME_FAILURE_LIMIT]
    codes = [
        Client(REMOTE_ADDR=a).post("/accounts/login/", {"username": "alice", "password": "wrong"}).status_code
        for a in failures
    ]
    assert codes == [200] * (len(failures) - 1) + [429]  # the last of the username's failures locks it
    fresh = Client(REMOTE_ADDR="10.2.0.1").post("/accounts/login/", {"username": "alice", "password": PASSWORD})
    assert fresh.status_code == 429  # every address, the right password too, until the cool-off
    other = get_user_model().objects.create_user("bob", password=PASSWORD)
    assert (
        Client(REMOTE_ADDR=failures[0])
        .post("/accounts/login/", {"username": other.username, "password": PASSWORD})
        .status_code
        == 302
    )


def test_a_success_resets_only_its_own_addresss_failures(settings) -> None:
    """The owner logging in from home clears home's count, not what a guesser elsewhere spent."""
    get_user_model().objects.create_user("alice", password=PASSWORD)
    guesser, home = Client(REMOTE_ADDR="10.3.0.1"), Client(REMOTE_ADDR="10.3.0.2")
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        guesser.post("/accounts/login/", {"username": "alice", "password": "wrong"})
        home.post("/accounts/login/", {"username": "alice", "password": "typo"})
    assert home.post("/accounts/login/", {"username": "alice", "password": PASSWORD}).status_code == 302
    assert guesser.post("/accounts/login/", {"username": "alice", "password": "wrong"}).status_code == 429


def test_api_calls_past_the_rate_are_429_per_user_and_anonymous_per_address(monkeypatch) -> None:
    monkeypatch.setattr(throttles.UserThrottle, "THROTTLE_RATES", {"user": "3/minute", "anon": "2/minute"})
    monkeypatch.setattr(throttles.AnonThrottle, "THROTTLE_RATES", {"user": "3/minute", "anon": "2/minute"})
    staff = get_user_model().objects.create_user("admin", is_staff=True)
    _, key = create_api_key(user=staff)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    codes = [client.get("/api/nodes").status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    refused = client.get("/api/nodes")
    assert "Retry-After" in refused.headers
    # Anonymous calls (enrollment: where join tokens could be guessed) are counted per address.
    guess = {"token": "odmoe_join_not-a-token", "name": "box"}
    anonymous = [APIClient().post("/api/agents/enroll", guess, format="json").status_code for _ in range(3)]
    assert anonymous == [400, 400, 429]


def test_one_user_runs_at_most_the_cap_of_generations_at_once(settings) -> None:
    settings.MAX_GENERATIONS_PER_USER = 2

    async def scenario() -> list:
        first = await throttles.GenerationSlot.take(7)
        second = await throttles.GenerationSlot.take(7)
        with pytest.raises(throttles.TooManyGenerations, match="at most 2 generations at once"):
            await throttles.GenerationSlot.take(7)
        other = await throttles.GenerationSlot.take(8)  # another user has slots of their own
        await first.release()
        await first.release()  # twice: given back once
        third = await throttles.GenerationSlot.take(7)
        for slot in (second, other, third):
            await slot.release()
        return [await throttles.GenerationSlot.take(7) for _ in range(2)]

    assert len(asyncio.run(scenario())) == 2


def test_the_openai_api_answers_429_past_the_cap(settings, tiny_model) -> None:
    from controlplane.artifacts.services import register_model
    from controlplane.deployments.models import Deployment, DeploymentStatus

    settings.MAX_GENERATIONS_PER_USER = 0  # no slot at all: the first request is past the cap
    model = register_model(name="tiny", path=str(tiny_model))
    Deployment.objects.create(name="d", model=model, status=DeploymentStatus.READY)
    _, key = create_api_key(user=get_user_model().objects.create_user("user"))
    body = {"model": "d", "messages": [{"role": "user", "content": "hi"}]}
    response = Client().post(
        "/v1/chat/completions", json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
    )
    assert response.status_code == 429 and response["Retry-After"] == "1"
    assert response.json()["error"]["code"] == "too_many_generations"
