"""Instruct models: chat messages become a prompt through the tokenizer's chat template.

The tiny checkpoint gets a Mixtral-Instruct-like template (``chat_template.jinja``, the file
Transformers 5 reads next to ``tokenizer_config.json``); the same function serves the chat
UI and ``/v1/chat/completions``, and a template that refuses the messages is the request's
fault (a 400 in OpenAI's error shape, an error line in the chat), never a 500.

The web process reads tokenizers without Transformers (``controlplane/serving/tokenizer.py``);
every id, text and prompt it makes is compared here with Transformers' ``AutoTokenizer``.
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
from controlplane.serving.text import InputError, encode_chat, render_chat
from controlplane.serving.tokenizer import TextTokenizer
from inference.modelio.families import FAMILIES
from inference.runtime.textstream import load_tokenizer
from inference.tools.tiny import BOS_ID, EOS_ID, make_tiny
from tests.paths import REPO

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


def reference_ids(reference, messages: list[dict]) -> list[int]:
    """Transformers' own prompt ids for ``messages``."""
    return reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


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
    tokenizer, reference = TextTokenizer(instruct_model), load_tokenizer(instruct_model)
    assert tokenizer.chat_template == reference.chat_template == INSTRUCT_TEMPLATE  # read from chat_template.jinja
    ids = encode_chat(tokenizer, [{"role": "user", "content": "hi there"}])
    assert ids == [BOS_ID, *reference("[INST] hi there [/INST]", add_special_tokens=False)["input_ids"]]
    assert ids == reference_ids(reference, [{"role": "user", "content": "hi there"}])
    assert ids.count(BOS_ID) == 1

    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "route me"},
    ]
    ids = encode_chat(tokenizer, turns)
    expected = [BOS_ID, *reference("[INST] hi [/INST]hello", add_special_tokens=False)["input_ids"], EOS_ID]
    expected += reference("[INST] route me [/INST]", add_special_tokens=False)["input_ids"]
    assert ids == expected
    assert ids == reference_ids(reference, turns)


def test_without_a_template_messages_are_concatenated(tiny_model: Path) -> None:
    tokenizer, reference = TextTokenizer(tiny_model), load_tokenizer(tiny_model)
    assert not tokenizer.chat_template and not reference.chat_template
    ids = encode_chat(tokenizer, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert ids == reference("system: be brief\nuser: hi\nassistant:")["input_ids"]
    assert ids.count(BOS_ID) == 1 and ids[0] == BOS_ID


def test_a_template_that_refuses_the_messages_is_an_input_error(strict_model: Path) -> None:
    with pytest.raises(InputError, match="System role not supported") as refused:
        encode_chat(TextTokenizer(strict_model), [{"role": "system", "content": "x"}])
    assert (refused.value.param, refused.value.code) == ("messages", "chat_template_error")


# A template that uses every piece of Transformers' environment: the special tokens, tojson with
# its options (and no HTML escaping), namespace, dict, loop controls, trim/lstrip blocks, and
# the {% generation %} tag of assistant masks.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(count=0) %}
{% for m in messages %}
    {% if m['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    {% if ns.count > 4 %}{% break %}{% endif %}
    <{{ m['role'] }}> {{ m['content'] | tojson }} {{ m | tojson(indent=2, sort_keys=True) }}
    {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% endif %}
{% endfor %}
{{ dict(a=1, b=unk_token) | tojson(separators=(',', ':')) }}
{% if add_generation_prompt %}<assistant>{% endif %}"""

CONVERSATION = [
    {"role": "system", "content": "be <brief> & kind"},
    {"role": "user", "content": 'héllo "quoted" \u2603'},
    {"role": "assistant", "content": "hi!  two  spaces"},
    {"role": "user", "content": "<script>x</script>"},
]
TEXTS = ["Hello, world!", "  leading and trailing  ", "héllo ☃ 日本語 🙂", "a\nb\tc", "<s>inside</s>", "don't ."]


def models_to_compare() -> list[tuple[str, str]]:
    """(name, how it is made): the demo model, every family's tiny model, and tokenizer configs that
    set BOS/EOS or clean-up flags."""
    return [
        ("demo", ""),
        *((f, "") for f in FAMILIES),
        ("mixtral", "bos-eos"),
        ("mixtral", "no-post-processor"),
        ("mixtral", "clean-up"),
    ]


@pytest.fixture(scope="module", params=models_to_compare(), ids=lambda p: "-".join(x for x in p if x))
def compared_model(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name, variant = request.param
    if name == "demo":
        source = REPO / "platform" / "demo-model"
        copy = tmp_path_factory.mktemp("demo") / "model"
        copy.mkdir()
        for file in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            shutil.copy(source / file, copy / file)
    else:
        copy = make_tiny(tmp_path_factory.mktemp(name) / "model", seed=0, layers=1, family=name)
    config_file = copy / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if variant == "bos-eos":
        config |= {"add_bos_token": False, "add_eos_token": True}
    elif variant == "no-post-processor":
        config |= {"add_bos_token": True}
        backend = json.loads((copy / "tokenizer.json").read_text())
        (copy / "tokenizer.json").write_text(json.dumps(backend | {"post_processor": None}))
    elif variant == "clean-up":
        config |= {"clean_up_tokenization_spaces": True}
    config_file.write_text(json.dumps(config))
    (copy / "chat_template.jinja").write_text(RICH_TEMPLATE)
    return copy


def test_the_web_tokenizer_matches_transformers(compared_model: Path) -> None:
    tokenizer, reference = TextTokenizer(compared_model), load_tokenizer(compared_model)
    assert tokenizer.special_tokens == reference.special_tokens_map
    assert tokenizer.get_vocab() == reference.get_vocab()
    for text in TEXTS:
        for special in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=special)
            assert ids == reference(text, add_special_tokens=special)["input_ids"], (text, special)
            for skip in (True, False):
                assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
                    ids, skip_special_tokens=skip
                ), (text, skip)
    for turns in (CONVERSATION, CONVERSATION[:2], CONVERSATION * 2):
        for prompt in (True, False):
            rendered = tokenizer.render_chat(turns, add_generation_prompt=prompt)
            assert rendered == reference.apply_chat_template(turns, add_generation_prompt=prompt, tokenize=False)
        assert encode_chat(tokenizer, turns) == reference_ids(reference, turns)


def test_a_tokens_bytes_are_the_text_transformers_decodes_it_into(compared_model: Path) -> None:
    """``token_bytes`` (the logprobs' ``token`` and ``bytes``), token by token, make the text
    Transformers decodes the ids into, partial characters included; SentencePiece's decoder alone
    drops the space a text's first word starts with."""
    tokenizer, reference = TextTokenizer(compared_model), load_tokenizer(compared_model)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        joined = b"".join(tokenizer.token_bytes(t) for t in ids).decode()
        decoded = reference.decode(ids, clean_up_tokenization_spaces=False)
        assert joined in (decoded, " " + decoded), (text, joined, decoded)
    assert tokenizer.token_bytes(len(tokenizer.get_vocab()) + 10) == b""


def test_strftime_now_and_raise_exception_are_there_as_in_transformers(instruct_model: Path, tmp_path: Path) -> None:
    dated = with_template(instruct_model, tmp_path, "{{ strftime_now('%Y') }}{{ raise_exception('no ' ~ 1) }}")
    with pytest.raises(InputError, match="no 1") as refused:
        render_chat(TextTokenizer(dated), [{"role": "user", "content": "x"}])
    assert refused.value.code == "chat_template_error"
    (dated / "chat_template.jinja").write_text("{{ strftime_now('%Y') }}")
    year = TextTokenizer(dated).render_chat([{"role": "user", "content": "x"}])
    assert year == load_tokenizer(dated).apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)


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
