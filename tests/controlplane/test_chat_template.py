"""Instruct models: chat messages become a prompt through the tokenizer's chat template.

The tiny checkpoint gets a Mixtral-Instruct-like template (``chat_template.jinja``, the file
Transformers 5 reads next to ``tokenizer_config.json``); the same function serves the chat
UI and ``/v1/chat/completions``, and a template that refuses the messages is the request's
fault (a 400 in OpenAI's error shape, an error line in the chat), never a 500.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.test import Client

from controlplane.artifacts.services import register_model
from controlplane.chat.models import Message, MessageStatus
from controlplane.chat.services import prompt_history
from controlplane.deployments.models import Deployment, DeploymentStatus
from controlplane.serving.text import InputError, encode_chat
from inference.textstream import load_tokenizer
from inference.tiny import BOS_ID, EOS_ID

# Mixtral-Instruct's layout: one BOS, [INST] ... [/INST] around user turns, EOS after answers.
INSTRUCT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
# Like Mixtral-Instruct's real template, which raises on any role but user and assistant.
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}"
)


def with_template(tiny_model: Path, where: Path, template: str) -> Path:
    copy = where / "model"
    shutil.copytree(tiny_model, copy)
    (copy / "chat_template.jinja").write_text(template)
    return copy


@pytest.fixture(scope="module")
def instruct_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(tiny_model, tmp_path_factory.mktemp("instruct"), INSTRUCT_TEMPLATE)


@pytest.fixture(scope="module")
def strict_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(tiny_model, tmp_path_factory.mktemp("strict"), NO_SYSTEM_TEMPLATE)


def test_a_template_renders_the_prompt_with_exactly_one_bos(instruct_model: Path) -> None:
    tokenizer = load_tokenizer(instruct_model)
    assert tokenizer.chat_template == INSTRUCT_TEMPLATE  # read from chat_template.jinja
    ids = encode_chat(tokenizer, [{"role": "user", "content": "hi there"}])
    assert ids == [BOS_ID, *tokenizer("[INST] hi there [/INST]", add_special_tokens=False)["input_ids"]]
    assert ids.count(BOS_ID) == 1

    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "route me"},
    ]
    ids = encode_chat(tokenizer, turns)
    expected = [BOS_ID, *tokenizer("[INST] hi [/INST]hello", add_special_tokens=False)["input_ids"], EOS_ID]
    expected += tokenizer("[INST] route me [/INST]", add_special_tokens=False)["input_ids"]
    assert ids == expected


def test_without_a_template_messages_are_concatenated(tiny_model: Path) -> None:
    tokenizer = load_tokenizer(tiny_model)
    assert not tokenizer.chat_template
    ids = encode_chat(tokenizer, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert ids == tokenizer("system: be brief\nuser: hi\nassistant:")["input_ids"]
    assert ids.count(BOS_ID) == 1 and ids[0] == BOS_ID


def test_a_template_that_refuses_the_messages_is_an_input_error(strict_model: Path) -> None:
    with pytest.raises(InputError, match="System role not supported") as refused:
        encode_chat(load_tokenizer(strict_model), [{"role": "system", "content": "x"}])
    assert (refused.value.param, refused.value.code) == ("messages", "chat_template_error")


def test_a_failed_turn_is_left_out_of_the_prompt_whole() -> None:
    said = [
        Message(role="user", content="one"),
        Message(role="assistant", content="", status=MessageStatus.FAILED),
        Message(role="user", content="two"),
        Message(role="assistant", content="2", status=MessageStatus.STOPPED),
        Message(role="user", content="three"),
    ]
    assert prompt_history(said) == [
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "three"},
    ]


def ready_deployment(name: str, path: Path) -> Deployment:
    artifact = register_model(name=name, path=str(path))
    return Deployment.objects.create(name=name, model=artifact, status=DeploymentStatus.READY)


@pytest.fixture
def ready_strict(transactional_db, strict_model: Path) -> Deployment:
    return ready_deployment("strict", strict_model)


def test_the_openai_api_answers_a_template_error_with_a_400(ready_strict: Deployment) -> None:
    client = Client()
    client.force_login(get_user_model().objects.create_user("alice"))
    body = {"model": "strict", "messages": [{"role": "system", "content": "x"}], "max_tokens": 4}
    response = client.post("/v1/chat/completions", json.dumps(body), content_type="application/json")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "chat_template_error"
    assert error["param"] == "messages" and "System role not supported" in error["message"]


def test_the_chat_shows_a_template_error(settings, transactional_db, tiny_model: Path, tmp_path: Path) -> None:
    from channels.layers import channel_layers
    from channels.testing import WebsocketCommunicator

    from controlplane.chat.consumers import ChatConsumer

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends.clear()
    # A template that refuses every conversation the chat can send.
    ready_deployment("refuses", with_template(tiny_model, tmp_path, "{{ raise_exception('no chat here') }}"))

    async def talk() -> list[dict]:
        comm = WebsocketCommunicator(ChatConsumer.as_asgi(), "/ws/chat/")
        comm.scope["user"] = await get_user_model().objects.acreate(username="bob")
        assert (await comm.connect())[0]
        await comm.send_json_to({"type": "send", "conversation": None, "content": "hi"})
        events = []
        while not events or events[-1]["type"] != "done":
            events.append(await comm.receive_json_from(timeout=30))
        await comm.disconnect()
        return events

    try:
        events = async_to_sync(talk)()
    finally:
        channel_layers.backends.clear()
    errors = [e["detail"] for e in events if e["type"] == "error"]
    assert len(errors) == 1 and "chat template cannot render" in errors[0] and "no chat here" in errors[0]
    assert events[-1]["status"] == MessageStatus.FAILED
