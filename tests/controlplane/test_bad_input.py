"""Input that used to be a 500 is a clear 4xx and changes nothing (issue 11's list)."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from controlplane.accounts.services import create_api_key
from controlplane.serving.models import Job

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def key() -> str:
    _, secret = create_api_key(user=get_user_model().objects.create_user("user"))
    return secret


def _post(client: Client, path: str, key: str, body: str):
    return client.post(path, body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stream_options": "x"}, "stream_options"),
        ({"stream_options": ["include_usage"]}, "stream_options"),
    ],
)
def test_the_openai_api_refuses_bad_fields_with_its_error_shape(key: str, body: dict, param: str) -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True} | body
    response = _post(Client(), "/v1/chat/completions", key, json.dumps(request))
    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"] == param


def test_an_integer_past_pythons_digit_limit_is_a_400_not_a_500(key: str) -> None:
    huge = '{"model": "m", "max_tokens": ' + "9" * 5000 + "}"
    response = _post(Client(), "/v1/completions", key, huge)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    assert _post(Client(), "/api/jobs", key, huge).status_code == 400


def test_a_job_seed_past_64_bits_is_refused_and_no_job_is_made(key: str) -> None:
    body = {"model": "m", "prompts": ["hi"], "seed": 2**63}
    response = _post(Client(), "/api/jobs", key, json.dumps(body))
    assert response.status_code == 400 and "seed" in response.json()
    assert not Job.objects.exists()


@pytest.mark.parametrize("header", ["Node abc:x", "Node 1:x", "Node :x", "Node abc"])
def test_a_node_credential_that_is_not_one_is_refused(header: str) -> None:
    response = Client().get("/api/models/1/shards/main/manifest.json", HTTP_AUTHORIZATION=header)
    assert response.status_code in (401, 403), response.content


@pytest.mark.parametrize("path", ["\x85" + "*" * 900, "/tmp/" + "a" * 300, "./" + "a" * 300 + "/b"])
def test_a_model_path_the_filesystem_refuses_is_a_400_and_registers_nothing(path: str) -> None:
    """Found by the schema fuzz: a path component longer than the filesystem allows was a 500."""
    from controlplane.artifacts.models import ModelArtifact

    staff = get_user_model().objects.create_user("admin", is_staff=True)
    _, secret = create_api_key(user=staff)
    response = _post(Client(), "/api/models", secret, json.dumps({"name": "long", "path": path}))
    assert response.status_code == 400, response.content
    assert "detail" in response.json()
    assert not ModelArtifact.objects.exists()
