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


def _staff_key() -> str:
    _, secret = create_api_key(user=get_user_model().objects.create_user("staff", is_staff=True))
    return secret


# "²" and "١" are digits to str.isdigit(); int() takes "١" and refuses "²".
@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/deployments", {"roles": {"main": "{node}:\u00b2", "shadow": "{node}", "workers": ["{node}"]}}, "roles"),
        ("/api/deployments", {"model": "\u00b2"}, "model"),
        ("/api/deployments", {"model": "9" * 5000}, "model"),
        ("/api/deployments", {"token_period": 2**31}, "token_period"),
        ("/api/deployments", {"kv_period": 2**64}, "kv_period"),
        ("/api/deployments/suggest", {"model": "\u00b2"}, "model"),
    ],
)
def test_a_deployment_field_past_what_it_can_hold_is_a_400_and_creates_nothing(
    path: str, body: dict, field: str
) -> None:
    """A non-ASCII digit in a seat or a model id, a period past its column: each was a 500."""
    import uuid

    from controlplane.deployments.models import Deployment

    node = str(uuid.uuid4())
    request = {"name": "d", "model": 1, "nodes": [node]} | json.loads(json.dumps(body).replace("{node}", node))
    response = _post(Client(), path, _staff_key(), json.dumps(request))
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert not Deployment.objects.exists()


@pytest.mark.parametrize("periods", [{"token_period": 2**31, "kv_period": 1}, {"token_period": 1, "kv_period": 2**64}])
def test_an_alignment_period_past_its_column_is_a_400_and_changes_nothing(periods: dict) -> None:
    from controlplane.artifacts.models import ModelArtifact
    from controlplane.deployments.models import Deployment

    deployment = Deployment.objects.create(name="d", model=ModelArtifact.objects.create(name="m", path="/m"))
    response = Client().patch(
        f"/api/deployments/{deployment.pk}/settings",
        json.dumps(periods),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {_staff_key()}",
    )
    assert response.status_code == 400, response.content
    assert set(response.json()) == {name for name, value in periods.items() if value > 1}
    deployment.refresh_from_db()
    assert (deployment.token_period, deployment.kv_period) == (1, 1)


@pytest.mark.parametrize(
    ("body", "field"), [({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"), ({"prompt_ids": [1, 2**64]}, "prompt_ids")]
)
def test_a_generation_main_cannot_be_sent_is_a_400_not_sent(body: dict, field: str) -> None:
    """Past 64 bits, the agent could not pack it for main: no answer, and a 502 after two minutes."""
    from controlplane.artifacts.models import ModelArtifact
    from controlplane.deployments.models import Deployment

    deployment = Deployment.objects.create(name="d", model=ModelArtifact.objects.create(name="m", path="/m"))
    request = {"prompt_ids": [1], "do_sample": True} | body
    response = _post(Client(), f"/api/deployments/{deployment.pk}/generate", _staff_key(), json.dumps(request))
    assert response.status_code == 400, response.content
    assert set(response.json()) == {field}


@pytest.mark.parametrize("value", ["\u00b2", "1\u00b2", "\u0661"])
def test_revoking_a_key_by_an_id_that_is_not_one_is_a_404_and_revokes_nothing(value: str) -> None:
    from controlplane.accounts.models import ApiKey

    user = get_user_model().objects.create_user("owner")
    create_api_key(user=user)
    browser = Client()
    browser.force_login(user)
    assert browser.post("/keys/", {"revoke": value}).status_code == 404
    assert not ApiKey.objects.get(user=user).revoked


@pytest.mark.parametrize(
    ("header", "status"),
    [("bytes=" + "9" * 5000 + "-", 416), ("bytes=0-" + "9" * 5000, 206), ("bytes=-" + "9" * 5000, 206)],
)
def test_a_byte_range_past_pythons_digit_limit_is_answered_not_a_500(tmp_path, header: str, status: int) -> None:
    """A number int() refuses (over 4300 digits) is past any file: a 416 as a start, the file's end as an end."""
    from controlplane.artifacts.models import ModelArtifact, ShardStatus
    from controlplane.nodes.models import NodeTask
    from controlplane.nodes.services import create_join_token, enroll_node

    _, token = create_join_token(created_by=None)
    node, secret = enroll_node(token=token, name="box", inventory={})
    (tmp_path / "main").mkdir()
    (tmp_path / "main" / "a.bin").write_bytes(b"x" * 100)
    (tmp_path / "main" / "manifest.json").write_text(json.dumps({"files": [{"path": "a.bin"}]}))
    model = ModelArtifact.objects.create(name="m", path="/m", shard_status=ShardStatus.READY, shard_dir=str(tmp_path))
    NodeTask.objects.create(node=node, kind="fetch_shard", params={"model_id": model.pk, "role": "main"})
    response = Client().get(
        f"/api/models/{model.pk}/shards/main/a.bin", HTTP_AUTHORIZATION=f"Node {node.pk}:{secret}", HTTP_RANGE=header
    )
    assert response.status_code == status
    if status == 206:
        assert b"".join(response.streaming_content) == b"x" * 100


# Frames the chat's socket got: Channels' JSON consumer raised on the first three (the socket
# closed as a server error); the last two were a turn no database stores (none answered).
CHAT_FRAMES = [
    "{",
    "[" * 5000 + "]" * 5000,
    '{"type": "send", "conversation": ' + "9" * 5000 + ', "content": "hi"}',
    '{"type": "send", "conversation": null, "content": "\\ud800"}',
    '{"type": "send", "conversation": null, "content": "a\\u0000b"}',
    '{"type": "send", "conversation": null, "content": "' + "a" * 300_000 + '"}',  # refused before decoding
]


@pytest.mark.parametrize("frame", CHAT_FRAMES, ids=["not-json", "deep", "huge-int", "surrogate", "nul", "long"])
def test_the_chat_answers_a_frame_it_cannot_use_with_an_error_and_saves_nothing(settings, frame: str) -> None:
    from asgiref.sync import async_to_sync
    from channels.layers import channel_layers
    from channels.testing import WebsocketCommunicator

    from controlplane.chat.consumers import ChatConsumer
    from controlplane.chat.models import Conversation, Message

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends.clear()

    async def talk() -> dict:
        comm = WebsocketCommunicator(ChatConsumer.as_asgi(), "/ws/chat/")
        comm.scope["user"] = await get_user_model().objects.acreate(username="bob")
        assert (await comm.connect())[0]
        await comm.send_to(text_data=frame)
        answer = await comm.receive_json_from(timeout=10)
        await comm.disconnect()
        return answer

    try:
        answer = async_to_sync(talk)()
    finally:
        channel_layers.backends.clear()
    assert answer["type"] == "error", answer
    assert not Conversation.objects.exists() and not Message.objects.exists()


def test_the_console_socket_ignores_a_frame_that_is_not_json(settings) -> None:
    from asgiref.sync import async_to_sync
    from channels.layers import channel_layers
    from channels.testing import WebsocketCommunicator

    from controlplane.console.consumers import ConsoleConsumer

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends.clear()

    async def watch() -> None:
        comm = WebsocketCommunicator(ConsoleConsumer.as_asgi(), "/ws/console/")
        comm.scope["user"] = await get_user_model().objects.acreate(username="staff", is_staff=True)
        assert (await comm.connect())[0]
        assert (await comm.receive_json_from(timeout=10))["type"] == "snapshot"
        await comm.send_to(text_data="{")
        await comm.send_to(bytes_data=b"\xff")
        await comm.disconnect()  # raises what the consumer raised, if it did

    try:
        async_to_sync(watch)()
    finally:
        channel_layers.backends.clear()
