"""A request that meets the database away (``controlplane.database_away``): a 503 with Retry-After in
the API's own error shape, never a 500; the next request, the database back, is served."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time
from collections.abc import Callable, Iterator

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client, RequestFactory
from django.urls import get_resolver

from controlplane import database_away as database_away_module
from controlplane.accounts.services import create_api_key
from controlplane.database_away import AWAY, waited_for_the_database
from inference.runtime.launcher import free_port

pytestmark = pytest.mark.django_db(transaction=True)


@contextlib.contextmanager
def database_away() -> Iterator[None]:
    """The database unreachable, as while PostgreSQL restarts: a closed port (SQLite: no such file)."""
    saved = dict(connection.settings_dict)
    connection.close()
    if connection.vendor == "sqlite":
        connection.settings_dict["NAME"] = "/nonexistent/odmoe/db.sqlite3"
    else:
        connection.settings_dict["PORT"] = str(free_port())
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)


def test_an_api_call_that_meets_the_database_away_is_told_to_try_again() -> None:
    _, key = create_api_key(user=get_user_model().objects.create_user("staff", is_staff=True))
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
    with database_away():
        rest, openai = client.get("/api/nodes"), client.get("/v1/models")
    assert (rest.status_code, rest["Retry-After"]) == (503, "2") and "try again shortly" in rest.json()["detail"]
    assert openai.status_code == 503 and openai.json()["error"]["type"] == "database_unavailable"
    assert client.get("/api/nodes").status_code == 200  # back: served


def test_a_chat_message_sent_while_the_database_is_away_is_given_back_not_left_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Away past the wait (``DATABASE_WAIT_S``, 1 s here), the page's send is refused, saying why,
    before anything is stored: the page keeps the text."""
    from asgiref.sync import async_to_sync
    from channels.testing import WebsocketCommunicator

    from controlplane.chat.consumers import ChatConsumer
    from controlplane.chat.models import Message

    alice = get_user_model().objects.create_user("alice")

    async def send_while_away() -> dict:
        comm = WebsocketCommunicator(ChatConsumer.as_asgi(), "/ws/chat/")
        comm.scope["user"] = alice
        assert (await comm.connect())[0]
        await comm.send_json_to({"type": "send", "conversation": None, "content": "hello", "max_tokens": 8})
        answer = await comm.receive_json_from(timeout=10)
        await comm.disconnect()
        return answer

    monkeypatch.setattr(database_away_module, "DATABASE_WAIT_S", 1.0)
    with database_away():
        answer = async_to_sync(send_while_away)()
    assert answer["type"] == "error" and answer["refused"] and "try again" in answer["detail"], answer
    assert not Message.objects.exists()


def test_a_chat_message_sent_while_the_database_restarts_waits_for_it_and_is_taken() -> None:
    """Away for a moment, as while PostgreSQL restarts (under load, 4 s): the send waits for the
    database before anything of it is stored, then is taken (stored once, its conversation told), not
    refused."""
    from asgiref.sync import async_to_sync
    from channels.testing import WebsocketCommunicator

    from controlplane.chat.consumers import ChatConsumer
    from controlplane.chat.models import Message

    alice = get_user_model().objects.create_user("alice")

    async def send_while_restarting(back: Callable[[], None]) -> dict:
        comm = WebsocketCommunicator(ChatConsumer.as_asgi(), "/ws/chat/")
        comm.scope["user"] = alice
        assert (await comm.connect())[0]
        await comm.send_json_to({"type": "send", "conversation": None, "content": "hello", "max_tokens": 8})
        assert await comm.receive_nothing(timeout=1.5)  # waiting for the database, not refused
        back()
        answer = await comm.receive_json_from(timeout=20)
        await comm.disconnect()
        return answer

    restored = dict(connection.settings_dict)
    with database_away():
        settings, away = connection.settings_dict, dict(connection.settings_dict)
        saved = {key: value for key, value in restored.items() if settings.get(key) != value}

        def back() -> None:  # the database answers again (the dict every thread's connection reads)
            settings.update(saved)

        answer = async_to_sync(send_while_restarting)(back)
        settings.update(away)  # as the context left it, for its own restore
    assert answer["type"] == "conversation", answer
    question, reply = Message.objects.order_by("pk")
    assert (question.role, question.content, reply.role) == ("user", "hello", "assistant")


def test_the_database_away_outside_a_view_is_the_same_503() -> None:
    """Raised past the views' middleware (another middleware, a response rendered late), the error
    reaches the project's ``handler500``: the database away is the 503, anything else Django's 500."""
    handler = get_resolver().resolve_error_handler(500)
    request = RequestFactory().get("/v1/models")
    with database_away():
        try:
            connection.ensure_connection()
        except AWAY:
            away = handler(request)
        else:
            raise AssertionError("the database answered with its port closed")
    assert (away.status_code, away["Retry-After"]) == (503, "2")
    assert json.loads(away.content)["error"]["type"] == "database_unavailable"
    try:
        raise ValueError("a bug")
    except ValueError:
        assert handler(request).status_code == 500


def test_synchronous_work_waits_for_the_database_to_come_back() -> None:
    """A job's write after its generation (``serving.jobs.run_output``) waits out a restart: under
    load, two prompts' answers were lost to PostgreSQL's restart, their task failed and their job
    never ended (``load-restarts-jobs-1``)."""
    get_user_model().objects.create_user("alice")
    tries: list[float] = []

    def count_users() -> int:
        tries.append(time.monotonic())
        return get_user_model().objects.count()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with database_away():
            waiting = pool.submit(waited_for_the_database, count_users)
            time.sleep(1.0)
            assert not waiting.done() and len(tries) >= 2  # tried, and tried again
        assert waiting.result(timeout=30) == 1  # back: the next try went through
    with database_away(), database_wait(0.5), pytest.raises(AWAY):  # away past its wait: raised
        waited_for_the_database(count_users)


@contextlib.contextmanager
def database_wait(seconds: float) -> Iterator[None]:
    """``DATABASE_WAIT_S`` shortened for the test."""
    from controlplane import database_away as module

    saved, module.DATABASE_WAIT_S = module.DATABASE_WAIT_S, seconds
    try:
        yield
    finally:
        module.DATABASE_WAIT_S = saved
