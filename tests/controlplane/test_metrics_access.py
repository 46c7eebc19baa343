"""Who may scrape ``/metrics``, and how often: the metrics token (in production, it alone), compared in
constant time, and every call throttled by address before any credential is looked at."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.test import Client

from controlplane import throttles
from controlplane.accounts.services import create_api_key
from controlplane.serving.metrics import token_matches

pytestmark = pytest.mark.django_db

TOKEN = "prometheus-scrapes-with-this-token-0123456789"


@pytest.fixture(autouse=True)
def fresh_counts():
    cache.clear()  # the throttles' counts
    yield
    cache.clear()


def scrape(authorization: str | None = None, client: Client | None = None) -> int:
    headers = {"HTTP_AUTHORIZATION": authorization} if authorization is not None else {}
    return (client or Client()).get("/metrics", **headers).status_code


def test_a_token_matches_only_itself_whole() -> None:
    assert token_matches(TOKEN, TOKEN)
    for other in ("", TOKEN[:-1], TOKEN + "x", TOKEN.upper(), "\udcff"):
        assert not token_matches(other, TOKEN)
    assert not token_matches("", "")  # no token set: nothing matches it


def test_the_metrics_token_scrapes_and_a_wrong_one_is_refused(settings) -> None:
    settings.METRICS_TOKEN = TOKEN
    assert scrape(f"Bearer {TOKEN}") == 200
    assert scrape(f"Bearer {TOKEN[:-1]}") == 401
    assert scrape(f"Basic {TOKEN}") == 401
    assert scrape() == 401


def test_production_takes_the_token_alone_and_without_one_serves_metrics_to_nobody(settings) -> None:
    """Locally a staff user's metrics key and a staff session scrape too; in production neither does."""
    staff = get_user_model().objects.create_user("ops", is_staff=True)
    _, staff_key = create_api_key(user=staff, scopes=["metrics"])
    session = Client()
    session.force_login(staff)
    assert scrape(f"Bearer {staff_key}") == 200 and scrape(client=session) == 200  # local, as before
    settings.METRICS_TOKEN_ONLY = True
    refused = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {staff_key}")
    assert refused.status_code == 403 and b"set ODMOE_METRICS_TOKEN" in refused.content
    assert scrape(client=session) == 403
    settings.METRICS_TOKEN = TOKEN
    assert scrape(f"Bearer {staff_key}") == 401 and scrape(client=session) == 401
    assert scrape(f"Bearer {TOKEN}") == 200


def test_metrics_calls_are_throttled_by_address_before_any_credential_is_checked(monkeypatch, settings) -> None:
    """Before, /metrics had no rate: each call with a guessed key cost a key lookup, and a scrape
    that reads every user's usage from the database could be asked in a loop."""
    settings.METRICS_TOKEN = TOKEN
    rates = {"user": "100/minute", "anon": "2/minute"}
    monkeypatch.setattr(throttles.UserThrottle, "THROTTLE_RATES", rates)
    monkeypatch.setattr(throttles.AnonThrottle, "THROTTLE_RATES", rates)
    assert [scrape(f"Bearer guess-{i}") for i in range(2)] == [401, 401]
    throttled = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert throttled.status_code == 429 and int(throttled["Retry-After"]) >= 1
    elsewhere = Client(REMOTE_ADDR="10.0.0.7").get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert elsewhere.status_code == 200  # another address has its own count
