"""Limits: the edge's cap on request bodies and websocket frames, login lockout (django-axes), DRF
throttles per user and per address (the OpenAI API's too), CSRF for browser sessions on /v1, the
prompt's length before tokenizing, the per-user caps on job prompts and chat messages, and the
parse-time bound on one request's generations. (Main's own bound on a user's generations is
tested in tests/test_batching*.py and end to end in test_serving_e2e.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.test import Client
from rest_framework.test import APIClient

from controlplane import throttles
from controlplane.accounts.services import create_api_key
from tests.controlplane.live import database_url

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


def test_a_request_for_more_generations_than_one_user_may_have_is_a_400_at_parse_time(tiny_model) -> None:
    """The bound is the deployment's (``max_per_user``); a request within it is not refused here
    (main queues a user's generations past its batch, and refuses past the bound with a 429)."""
    from controlplane.artifacts.services import register_model
    from controlplane.deployments.models import Deployment, DeploymentStatus

    model = register_model(name="tiny", path=str(tiny_model))
    Deployment.objects.create(name="d", model=model, status=DeploymentStatus.READY, max_per_user=4)
    _, key = create_api_key(user=get_user_model().objects.create_user("user"))

    def ask(path: str, body: dict):
        body = json.dumps({"model": "d", "max_tokens": 4, **body})
        return Client().post(path, body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}")

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    too_many_choices = ask("/v1/chat/completions", {**chat, "n": 5})
    assert too_many_choices.status_code == 400 and too_many_choices.json()["error"]["param"] == "n"
    assert "from 1 to 4" in too_many_choices.json()["error"]["message"]
    too_many_prompts = ask("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2})
    assert too_many_prompts.status_code == 400 and too_many_prompts.json()["error"]["param"] == "prompt"
    # Within the bound: past the parse, to the cluster (this deployment has no main: 503).
    for path, body in [("/v1/chat/completions", {**chat, "n": 4}), ("/v1/completions", {"prompt": ["a", "b"], "n": 2})]:
        within = ask(path, body)
        assert within.status_code == 503 and within.json()["error"]["code"] == "model_not_ready", within.content


# --- the edge: request bodies and websocket frames past the cap -----------------------------------

MIB = 2**20


def http_scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


def test_a_declared_body_past_the_cap_is_a_413_before_a_byte_of_it_is_read(settings) -> None:
    """A 200 MB enrollment, padded JSON that the view would take: refused from its header alone,
    the body never sent, and no node made (before, Django read it all and the view enrolled)."""
    from asgiref.testing import ApplicationCommunicator

    from controlplane.config.asgi import application
    from controlplane.nodes.models import Node
    from controlplane.nodes.services import create_join_token

    _, token = create_join_token(created_by=None)
    enroll = json.dumps({"token": token, "name": "box", "inventory": {}}).encode()

    async def post(path: str, length: int, body: bytes | None = None) -> tuple[dict, dict]:
        comm = ApplicationCommunicator(application, http_scope(path, [(b"content-length", str(length).encode())]))
        if body is not None:
            await comm.send_input({"type": "http.request", "body": body, "more_body": False})
        start = await comm.receive_output(timeout=30)  # without a body: answered with none of it sent
        answer = await comm.receive_output(timeout=5)
        await comm.wait(timeout=5)
        return start, json.loads(answer["body"])

    start, body = asyncio.run(post("/api/agents/enroll", 200 * 10**6))
    assert start["status"] == 413 and (b"connection", b"close") in start["headers"]
    assert body == {
        "detail": f"the request body is larger than {settings.MAX_REQUEST_BYTES} bytes, the most this server takes"
    }
    _, unknown = asyncio.run(post("/no-such-page", 200 * 10**6))
    assert "larger than" in unknown["detail"]
    _, openai_shaped = asyncio.run(post("/v1/completions", settings.MAX_REQUEST_BYTES + 1))
    assert openai_shaped["error"]["type"] == "invalid_request_error"
    assert openai_shaped["error"]["code"] == "request_too_large" and openai_shaped["error"]["param"] is None
    assert not Node.objects.exists()
    # At the cap, the same body is read and the view runs: the cap is where it says.
    padded = enroll + b" " * (settings.MAX_REQUEST_BYTES - len(enroll))
    start, enrolled = asyncio.run(post("/api/agents/enroll", len(padded), padded))
    assert start["status"] == 201 and Node.objects.get().pk == uuid.UUID(enrolled["node_id"])


def test_a_chunked_body_is_counted_as_it_comes_and_refused_once_past_the_cap(settings) -> None:
    """No Content-Length: the body is read a chunk at a time and refused at the first byte past the
    cap; the chunks after it are never read."""
    from asgiref.testing import ApplicationCommunicator

    from controlplane.config.asgi import application

    chunks = settings.MAX_REQUEST_BYTES // MIB + 20

    async def post() -> tuple[int, dict, int]:
        comm = ApplicationCommunicator(application, http_scope("/v1/chat/completions", []))
        sent = 0
        while sent < chunks:
            await comm.send_input({"type": "http.request", "body": b" " * MIB, "more_body": True})
            sent += 1
            while not comm.input_queue.empty():  # the app took the chunk...
                await asyncio.sleep(0.001)
            if not await comm.receive_nothing(timeout=0.2):  # ...and answered, or asks for more
                break
        start = await comm.receive_output(timeout=5)
        body = await comm.receive_output(timeout=5)
        await comm.wait(timeout=5)  # the app is done, though the client promised more
        return sent, start, json.loads(body["body"])

    sent, start, body = asyncio.run(post())
    assert start["status"] == 413 and body["error"]["code"] == "request_too_large"
    assert sent == settings.MAX_REQUEST_BYTES // MIB + 1  # the chunk that passed the cap, and no more


def test_a_websocket_frame_past_the_cap_closes_the_socket_before_a_consumer_reads_it(settings) -> None:
    from channels.layers import channel_layers
    from channels.testing import WebsocketCommunicator

    from controlplane.config.asgi import application
    from controlplane.nodes.models import NodeStatus
    from controlplane.nodes.services import create_join_token, enroll_node
    from inference.wire.link import AGENT_PROTOCOL, LINK_PATH, PROTOCOL_HEADER

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends.clear()
    _, token = create_join_token(created_by=None)
    node, secret = enroll_node(token=token, name="box", inventory={})
    heartbeat = json.dumps({"type": "heartbeat", "inventory": {"hostname": "x" * settings.MAX_REQUEST_BYTES}})

    async def link() -> dict:
        comm = WebsocketCommunicator(
            application,
            LINK_PATH,
            headers=[
                (b"authorization", f"Node {node.pk}:{secret}".encode()),
                (PROTOCOL_HEADER.lower().encode(), str(AGENT_PROTOCOL).encode()),
            ],
        )
        assert (await comm.connect())[0]
        await comm.send_to(text_data=heartbeat)
        closed = await comm.receive_output(timeout=5)
        await comm.wait(timeout=5)
        return closed

    try:
        closed = asyncio.run(link())
    finally:
        channel_layers.backends.clear()
    assert closed == {"type": "websocket.close", "code": 1009}
    node.refresh_from_db()
    assert node.inventory == {} and node.status == NodeStatus.OFFLINE  # the frame was never handled


@pytest.mark.slow
def test_uvicorn_answers_a_declared_200_mb_body_at_once_and_stops_a_chunked_one(tmp_path) -> None:
    """The server as deployed: a client announcing 200 MB gets its 413 without sending any of it,
    and one streaming chunks without end is cut off just past the cap (1 MiB here, from
    ODMOE_MAX_REQUEST_BYTES). Before, Django read both bodies whole, for a URL that does not exist."""
    import socket

    from controlplane.ops.processes import ProcessGroup, python_env
    from inference.runtime.launcher import free_port
    from tests.controlplane.live import Api, LiveControlPlane

    env = python_env(
        DJANGO_SETTINGS_MODULE="controlplane.config.settings.test",
        DATABASE_URL=database_url(),
        ODMOE_VAR_DIR=str(tmp_path / "var"),
        ODMOE_MAX_REQUEST_BYTES=str(MIB),
    )
    port = free_port()
    with ProcessGroup(tmp_path / "logs", env) as group:
        LiveControlPlane(group, port, Api(f"http://127.0.0.1:{port}", ""), tmp_path / "agents").start_server()

        def answer_of(sock: socket.socket) -> bytes:
            answer = b""
            while piece := sock.recv(65536):  # until the server closes the connection
                answer += piece
            return answer

        def request(head: str) -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(f"POST /no-such-page HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\n".encode())
            return sock

        with request(f"Content-Length: {200 * 10**6}\r\n") as sock:
            answer = answer_of(sock)
        assert answer.startswith(b"HTTP/1.1 413") and b"larger than 1048576 bytes" in answer

        sent = 0
        with request("Transfer-Encoding: chunked\r\n") as sock:
            chunk = b"%x\r\n%s\r\n" % (64 * 1024, b" " * 64 * 1024)
            # The server closes with the rest unread, so its kernel resets the connection: a client
            # still sending learns it from a failed send (a proxy in front lingers, and relays the 413).
            with contextlib.suppress(OSError):
                while sent < 200 * MIB:
                    sock.sendall(chunk)
                    sent += 64 * 1024
        assert sent < 16 * MIB, sent  # the cap, and what the kernels' buffers took on top of it
        group.check()  # the server is still up


# --- /v1: the prompt's length before it is tokenized --------------------------------------------


def test_text_past_the_context_in_characters_is_refused_and_text_that_can_fit_is_not(tiny_model) -> None:
    """The bound is the context (less max_tokens) times the longest token's characters: text made
    of that token's text, as many times as there is room, fits exactly and passes; one character
    more cannot fit in any tokenization and is refused."""
    from controlplane.serving.text import InputError, check_text_fits, longest_token_chars, tokenizer_for

    tokenizer = tokenizer_for(str(tiny_model))
    longest = longest_token_chars(tokenizer)
    piece = max(tokenizer.get_vocab(), key=len)
    text = tokenizer.decode([tokenizer.get_vocab()[piece]])
    assert len(text) == longest
    context, max_tokens = 1024, 16
    room = context - max_tokens
    fitting = text * (room - 1)  # and the BOS token the tokenizer adds
    assert len(tokenizer.encode(fitting)) == room  # it fits, exactly...
    check_text_fits(tokenizer, [fitting], max_tokens, context, param="prompt")  # ...and passes
    check_text_fits(tokenizer, [text * room], max_tokens, context, param="prompt")  # the bound itself passes
    with pytest.raises(InputError, match="at least 1009 tokens") as refused:
        check_text_fits(tokenizer, [text * room + "x"], max_tokens, context, param="prompt")
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "prompt"
    check_text_fits(tokenizer, ["x" * 10**7], max_tokens, None, param="prompt")  # no known context: no bound


def test_the_openai_api_refuses_a_prompt_too_long_in_characters_without_tokenizing_it(tiny_model) -> None:
    """A 2.4 MB prompt took 1.6 s of the server's CPU to tokenize before it was found too long for
    the tiny model's 1024 tokens; now its length alone refuses it (the message counts characters:
    a conversation's as the template writes it, here the plain ``role: content`` lines). This
    one is within the request bounds (``serving.bounds``), which refuse a 2.4 MB prompt before
    the context is looked at."""
    from controlplane.artifacts.services import register_model
    from controlplane.deployments.models import Deployment, DeploymentStatus
    from controlplane.serving.text import chat_text, tokenizer_for

    model = register_model(name="tiny", path=str(tiny_model))
    Deployment.objects.create(name="d", model=model, status=DeploymentStatus.READY)
    _, key = create_api_key(user=get_user_model().objects.create_user("user"))
    huge = "hello world " * 80_000
    conversation = [{"role": "user", "content": huge}]
    asks = [
        ("/v1/completions", {"prompt": huge}, "prompt", len(huge)),
        ("/v1/completions", {"prompt": ["hi", huge]}, "prompt", len(huge)),
        (
            "/v1/chat/completions",
            {"messages": conversation},
            "messages",
            len(chat_text(tokenizer_for(str(tiny_model)), conversation)),
        ),
    ]
    for path, ask, param, chars in asks:
        body = json.dumps({"model": "d", "max_tokens": 8, **ask})
        response = Client().post(path, body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}")
        assert response.status_code == 400, response.content[:300]
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param
        assert f"the prompt has {chars} characters" in error["message"]


# --- /v1: throttled as the REST API is, and CSRF for browser sessions --------------------------------


def test_the_openai_api_counts_against_the_rest_apis_throttle_and_answers_in_openais_shape(monkeypatch) -> None:
    rates = {"user": "3/minute", "anon": "2/minute"}
    monkeypatch.setattr(throttles.UserThrottle, "THROTTLE_RATES", rates)
    monkeypatch.setattr(throttles.AnonThrottle, "THROTTLE_RATES", rates)
    staff = get_user_model().objects.create_user("admin", is_staff=True)
    _, key = create_api_key(user=staff)
    rest = APIClient()
    rest.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert rest.get("/api/nodes").status_code == 200
    openai_calls = [Client().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {key}") for _ in range(3)]
    assert [r.status_code for r in openai_calls] == [200, 200, 429]  # the same count as the REST API's
    refused = openai_calls[-1]
    assert int(refused["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    body = json.dumps({"model": "m", "prompt": "hi"})
    completion = Client().post(
        "/v1/completions", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
    )
    assert completion.status_code == 429  # refused before the body is looked at
    assert rest.get("/api/nodes").status_code == 429
    _, other = create_api_key(user=get_user_model().objects.create_user("other"))
    assert Client().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {other}").status_code == 200  # per user


def test_calls_go_through_uncounted_while_redis_cannot_count_them(settings, monkeypatch) -> None:
    """The counts in a Redis that refuses connections (a restart): the API answers and a chat message
    is taken, as if under the rate, rather than a 500 or a chat socket closed mid-message."""
    from controlplane.throttles import chat_message_wait
    from inference.runtime.launcher import free_port

    rates = {"user": "1/minute", "anon": "1/minute", "chat": "1/minute"}
    for throttle in (throttles.UserThrottle, throttles.AnonThrottle, throttles.ChatMessageThrottle):
        monkeypatch.setattr(throttle, "THROTTLE_RATES", rates)
    alice = get_user_model().objects.create_user("alice", is_staff=True)
    _, key = create_api_key(user=alice)
    nowhere = {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
    }
    settings.CACHES = {**settings.CACHES, "default": nowhere}
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert [client.get("/api/nodes").status_code for _ in range(2)] == [200, 200]  # past 1/minute: not counted
    assert [chat_message_wait(alice) for _ in range(2)] == [None, None]


def test_anonymous_calls_are_held_to_the_anonymous_rate_alone(monkeypatch) -> None:
    """The user rate counts users: an address's anonymous calls (boxes enrolling behind one address)
    go on past it, up to the anonymous rate."""
    rates = {"user": "2/minute", "anon": "4/minute"}
    monkeypatch.setattr(throttles.UserThrottle, "THROTTLE_RATES", rates)
    monkeypatch.setattr(throttles.AnonThrottle, "THROTTLE_RATES", rates)
    guess = {"token": "odmoe_join_not-a-token", "name": "box"}
    anonymous = [APIClient().post("/api/agents/enroll", guess, format="json").status_code for _ in range(5)]
    assert anonymous == [400, 400, 400, 400, 429]


def test_calls_without_a_valid_key_are_throttled_by_their_address_as_anonymous_ones(monkeypatch) -> None:
    """Before, a call with no key or a wrong one was answered 401 before any throttle: guessing keys
    (each guess a database lookup) had no rate at all."""
    rates = {"user": "100/minute", "anon": "2/minute"}
    monkeypatch.setattr(throttles.UserThrottle, "THROTTLE_RATES", rates)
    monkeypatch.setattr(throttles.AnonThrottle, "THROTTLE_RATES", rates)
    guesses = [Client().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer odmoe-key-guess{i}") for i in range(3)]
    assert [r.status_code for r in guesses] == [401, 401, 429]
    assert guesses[-1].json()["error"]["code"] == "rate_limit_exceeded" and int(guesses[-1]["Retry-After"]) >= 1
    assert Client().post("/v1/completions", "{}", content_type="application/json").status_code == 429  # no key
    _, key = create_api_key(user=get_user_model().objects.create_user("holder"))
    assert Client().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 200  # a user's own count


def test_rest_calls_without_a_valid_credential_are_throttled_by_their_address_as_anonymous_ones(monkeypatch) -> None:
    """Before, DRF checked the credential and the view's permissions before its throttles: 70 calls
    to /api/jobs with made-up keys all got 401, none 429, and each one was a database lookup."""
    from controlplane.nodes.services import create_join_token, enroll_node

    rates = {"user": "100/minute", "anon": "2/minute"}
    monkeypatch.setattr(throttles.UserThrottle, "THROTTLE_RATES", rates)
    monkeypatch.setattr(throttles.AnonThrottle, "THROTTLE_RATES", rates)
    guesses = [APIClient().get("/api/jobs", HTTP_AUTHORIZATION=f"Bearer odmoe-key-guess{i}") for i in range(3)]
    assert [r.status_code for r in guesses] == [401, 401, 429]
    assert int(guesses[-1]["Retry-After"]) >= 1 and "throttled" in guesses[-1].json()["detail"]
    assert APIClient().get("/api/jobs").status_code == 429  # no credential at all: the same address's count
    assert APIClient().get("/api/agents/me", HTTP_AUTHORIZATION="Node 1:not-a-credential").status_code == 429
    assert APIClient(REMOTE_ADDR="10.9.0.1").get("/api/jobs").status_code == 401  # another address: its own count
    _, key = create_api_key(user=get_user_model().objects.create_user("holder"))
    assert APIClient().get("/api/jobs", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 200  # a user's own count
    _, token = create_join_token(created_by=None)
    node, secret = enroll_node(token=token, name="box", inventory={})
    agent = [APIClient().get("/api/agents/me", HTTP_AUTHORIZATION=f"Node {node.pk}:{secret}") for _ in range(4)]
    assert [r.status_code for r in agent] == [200] * 4  # an agent is never counted


def test_rest_calls_refused_for_a_permission_count_against_their_users_rate(monkeypatch) -> None:
    """A user's calls that a view refuses (403: not staff) count too, once each, as their allowed calls do."""
    rates = {"user": "3/minute", "anon": "100/minute"}
    monkeypatch.setattr(throttles.UserThrottle, "THROTTLE_RATES", rates)
    monkeypatch.setattr(throttles.AnonThrottle, "THROTTLE_RATES", rates)
    _, key = create_api_key(user=get_user_model().objects.create_user("plain"))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    answers = [client.get(path) for path in ("/api/jobs", "/api/nodes", "/api/nodes", "/api/jobs")]
    assert [r.status_code for r in answers] == [200, 403, 403, 429]
    assert int(answers[-1]["Retry-After"]) >= 1


def test_a_browser_session_needs_a_csrf_token_for_the_openai_api_and_an_api_key_does_not() -> None:
    """Before, any page on another site could make a logged-in user's browser run generations."""
    user = get_user_model().objects.create_user("reader", password=PASSWORD)
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(user)
    body = json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    forged = browser.post("/v1/chat/completions", body, content_type="application/json")
    assert forged.status_code == 403, forged.content
    assert forged.json()["error"]["code"] == "csrf_failed" and "CSRF" in forged.json()["error"]["message"]
    assert browser.get("/v1/models").status_code == 200  # reading needs no token
    browser.get("/accounts/login/")  # a page of ours sets the CSRF cookie
    token = browser.cookies["csrftoken"].value
    same_site = browser.post("/v1/chat/completions", body, content_type="application/json", HTTP_X_CSRFTOKEN=token)
    assert same_site.status_code == 404 and same_site.json()["error"]["code"] == "model_not_found"  # past the check
    _, key = create_api_key(user=user)
    program = Client(enforce_csrf_checks=True).post(
        "/v1/chat/completions", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
    )
    assert program.status_code == 404


# --- per-user caps: prompts in a user's active jobs --------------------------------------------------


def test_a_users_jobs_hold_at_most_the_cap_of_prompts_queued_or_running(settings, tiny_model) -> None:
    from controlplane.artifacts.services import register_model
    from controlplane.deployments.models import Deployment, DeploymentStatus
    from controlplane.serving.models import Job, JobOutput
    from tests.controlplane.live import purge_stale_tasks

    settings.MAX_ACTIVE_JOB_PROMPTS_PER_USER = 5
    model = register_model(name="tiny", path=str(tiny_model))
    Deployment.objects.create(name="d", model=model, status=DeploymentStatus.READY)
    users = get_user_model().objects
    alice, bob = APIClient(), APIClient()
    alice.credentials(HTTP_AUTHORIZATION=f"Bearer {create_api_key(user=users.create_user('alice'))[1]}")
    bob.credentials(HTTP_AUTHORIZATION=f"Bearer {create_api_key(user=users.create_user('bob'))[1]}")

    def submit(client: APIClient, prompts: int):
        return client.post("/api/jobs", {"model": "d", "prompts": ["hi"] * prompts, "max_tokens": 4}, format="json")

    try:
        first = submit(alice, 3)
        assert first.status_code == 201
        refused = submit(alice, 3)
        assert refused.status_code == 429, refused.content
        assert refused.json()["detail"].startswith("your jobs already have 3 prompts queued or running")
        assert (Job.objects.count(), JobOutput.objects.count()) == (1, 3)  # nothing of it was stored
        assert submit(alice, 2).status_code == 201  # up to the cap
        assert submit(bob, 3).status_code == 201  # a cap per user
        assert alice.post(f"/api/jobs/{first.json()['id']}/cancel").status_code == 200
        assert submit(alice, 3).status_code == 201  # cancelled prompts no longer count
    finally:
        purge_stale_tasks()  # queued for a worker this test has not


# --- per-user caps: chat messages per minute --------------------------------------------------------


def test_the_chat_refuses_a_users_messages_past_the_rate_and_stores_nothing_of_them(monkeypatch, settings) -> None:
    """No deployment is ready, so each message taken is stored with an answer that failed; the
    third within the minute is refused before anything of it is stored, and says so (the page
    then gives the text back to its box)."""
    from asgiref.sync import async_to_sync
    from channels.layers import channel_layers
    from channels.testing import WebsocketCommunicator

    from controlplane.chat.consumers import ChatConsumer
    from controlplane.chat.models import Message

    monkeypatch.setattr(throttles.ChatMessageThrottle, "THROTTLE_RATES", {"chat": "2/minute"})
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends.clear()
    users = get_user_model().objects

    async def talk(user, messages: int) -> list[dict]:
        comm = WebsocketCommunicator(ChatConsumer.as_asgi(), "/ws/chat/")
        comm.scope["user"] = user
        assert (await comm.connect())[0]
        last = []
        for i in range(messages):
            await comm.send_json_to({"type": "send", "conversation": None, "content": f"question {i}"})
            events = [await comm.receive_json_from(timeout=10)]
            while events[-1]["type"] != "done" and not events[-1].get("refused"):
                events.append(await comm.receive_json_from(timeout=10))
            last = events
        await comm.disconnect()
        return last

    try:
        refused = async_to_sync(talk)(users.create_user("alice"), 3)
        assert (
            refused == [{"type": "error", "detail": refused[0]["detail"], "refused": True}]
            and "faster than this server takes them" in refused[0]["detail"]
        )
        stored = list(Message.objects.order_by("pk").values_list("role", "content"))
        assert stored == [("user", "question 0"), ("assistant", ""), ("user", "question 1"), ("assistant", "")]
        (done,) = [e for e in async_to_sync(talk)(users.create_user("bob"), 1) if e["type"] == "done"]
        assert done["status"] == "failed"  # taken (and answered: no deployment); bob has a count of his own
    finally:
        channel_layers.backends.clear()
