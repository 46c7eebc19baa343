"""A chat answer whose web process stopped mid-answer (``controlplane.chat.writing``): its partial text
was saved as it came, and it is failed, saying why, instead of staying "being written" forever; an
answer whose writer is alive, however long it waits for a token, is left alone. The answer's tape
(``chat.tape``) takes each piece once and is read from where a page left off, after the answer's end
too; one writer holds an answer at a time; a page follows only its own user's answers. (The whole
answer across a closed page, a stopped writer and a restarted web server: ``test_serving_e2e``,
``test_browser``.)"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.utils import timezone

from controlplane.accounts.usage import Caller
from controlplane.chat import services, tape, writing
from controlplane.chat.models import Message, MessageStatus
from controlplane.chat.tasks import settle_interrupted_answers_task
from controlplane.shared_redis import client

pytestmark = pytest.mark.django_db


def test_an_answer_whose_writer_stopped_fails_saying_why_and_keeps_its_partial_text(
    channel_layer_on_test_redis,
) -> None:
    user = get_user_model().objects.create_user("carol")
    answers = {}
    for name in ("orphan", "alive", "young", "done"):
        _, answer, _ = services.start_turn(user=user, conversation_id=None, content=f"question {name}")
        answers[name] = answer.pk
    services.save_partial(answer_id=answers["orphan"], content="the first half of")
    services.finish_answer(answer_id=answers["done"], content="whole", status=MessageStatus.COMPLETE)
    old = timezone.now() - timedelta(seconds=writing.STALE_S * 2)
    Message.objects.filter(pk__in=[answers["orphan"], answers["alive"], answers["done"]]).update(created_at=old)
    client().zadd(writing.KEY, {str(answers["orphan"]): 1.0})  # its writer last touched it long ago (a crash)
    writing.touch(answers["alive"])  # still being written (it waits for its first token)

    assert settle_interrupted_answers_task() == [answers["orphan"]]  # what the beat task does
    orphan = Message.objects.get(pk=answers["orphan"])
    assert orphan.status == MessageStatus.FAILED and orphan.error == writing.INTERRUPTED
    assert orphan.content == "the first half of"  # saved as it came
    assert Message.objects.get(pk=answers["alive"]).status == MessageStatus.STREAMING
    assert Message.objects.get(pk=answers["young"]).status == MessageStatus.STREAMING  # younger than STALE_S
    assert Message.objects.get(pk=answers["done"]).status == MessageStatus.COMPLETE
    assert Message.objects.filter(role="user", content="question orphan").exists()  # the question kept
    assert client().zscore(writing.KEY, str(answers["done"])) is None  # an ended answer is not held
    assert settle_interrupted_answers_task() == []  # once
    services.save_partial(answer_id=answers["orphan"], content="more")  # a late writer changes a settled answer not
    assert Message.objects.get(pk=answers["orphan"]).content == "the first half of"


def test_nothing_is_settled_while_redis_cannot_tell_which_answers_are_being_written(settings) -> None:
    user = get_user_model().objects.create_user("dave")
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    _, answer, _ = services.start_turn(user=user, conversation_id=None, content="hello")
    Message.objects.filter(pk=answer.pk).update(created_at=timezone.now() - timedelta(seconds=writing.STALE_S * 2))
    assert services.settle_interrupted() == []
    assert Message.objects.get(pk=answer.pk).status == MessageStatus.STREAMING


def test_a_settled_answer_keeps_the_text_its_tape_has_and_its_tokens_are_counted_once(
    channel_layer_on_test_redis,
) -> None:
    """The writer died after putting pieces on the tape it had not saved yet: the settled answer has them,
    and its tokens are counted to its user once however often the beat task runs."""
    from controlplane.accounts.models import TokenUsage

    user = get_user_model().objects.create_user("erin")
    _, answer, _ = services.start_turn(user=user, conversation_id=None, content="question")
    meta = tape.Meta(
        deployment_id=999, deployment="gone", user_id=user.pk, prompt_ids=[1, 2, 3], max_tokens=8, request_id="r"
    )
    tape.start(answer.pk, meta)
    for index, text in enumerate(["Hel", "lo", " the", "re"]):
        async_to_sync(tape.append)(answer.pk, tape.Piece(index, 100 + index, text))
    services.save_partial(answer_id=answer.pk, content="Hel")  # saved before the last pieces came
    Message.objects.filter(pk=answer.pk).update(created_at=timezone.now() - timedelta(seconds=writing.STALE_S * 2))
    client().zadd(writing.KEY, {str(answer.pk): 1.0})

    assert services.settle_interrupted() == [answer.pk]  # its deployment is gone: nothing to cancel
    settled = Message.objects.get(pk=answer.pk)
    assert (settled.status, settled.content, settled.error) == (
        MessageStatus.FAILED,
        "Hello there",
        writing.INTERRUPTED,
    )
    assert services.settle_interrupted() == []
    (usage,) = TokenUsage.objects.filter(user=user)
    assert (usage.deployment, usage.prompt_tokens, usage.completion_tokens, usage.generations) == ("gone", 3, 4, 1)
    # A writer that comes late saves nothing over it, and counts nothing more.
    late = services.Usage(Caller(user.pk), "gone", 3, 8)
    assert not services.finish_answer(
        answer_id=answer.pk, content="x", status=MessageStatus.COMPLETE, metrics={}, error="", usage=late
    )
    assert TokenUsage.objects.get(user=user).completion_tokens == 4


def test_each_piece_goes_on_the_tape_once_and_a_reader_resumes_after_the_pieces_it_has(
    channel_layer_on_test_redis,
) -> None:
    async def write_and_read() -> tuple[list, list]:
        meta = tape.Meta(deployment_id=1, deployment="d", user_id=1, prompt_ids=[1], max_tokens=4, request_id="r")
        await asyncio.to_thread(tape.start, 424242, meta)
        for index, text in enumerate(["a", "b", "c"]):
            await tape.append(424242, tape.Piece(index, index, text))
        with pytest.raises(tape.Overtaken):  # a second writer's piece 1: refused, the first one's kept
            await tape.append(424242, tape.Piece(1, 7, "B"))
        await tape.append_end(424242, {"done": {"type": "done"}, "error": ""})
        with pytest.raises(tape.Overtaken):
            await tape.append(424242, tape.Piece(3, 3, "late"))  # nothing after the end
        from_start = [item async for item in tape.follow(424242, 0)]
        after_two = [item async for item in tape.follow(424242, 2)]
        return from_start, after_two

    from_start, after_two = async_to_sync(write_and_read)()
    assert [p.text for p in from_start[:-1]] == ["a", "b", "c"] and isinstance(from_start[-1], tape.End)
    assert [p.text for p in after_two[:-1]] == ["c"] and after_two[-1].message == {
        "done": {"type": "done"},
        "error": "",
    }
    assert tape.token_ids(tape.pieces(424242)) == [0, 1, 2]


def test_one_writer_holds_an_answer_until_it_lets_go_or_its_lease_lapses(channel_layer_on_test_redis) -> None:
    assert writing.claim(515151, "first")
    assert not writing.claim(515151, "second")  # held
    assert writing.renew(515151, "first") and not writing.renew(515151, "second")
    writing.release(515151, "second")  # not its to release
    assert not writing.claim(515151, "second")
    writing.release(515151, "first")
    assert writing.claim(515151, "second")
    client().pexpire("odmoe:chat:answer:515151:writer", 1)  # as if its holder stopped renewing
    time.sleep(0.01)
    assert writing.claim(515151, "third") and not writing.renew(515151, "second")


def test_a_page_follows_only_its_own_users_answers_and_an_ended_one_is_told_from_the_database(
    transactional_db, channel_layer_on_test_redis
) -> None:
    from channels.testing import WebsocketCommunicator

    from controlplane.chat.consumers import ChatConsumer

    owner = get_user_model().objects.create_user("frank")
    other = get_user_model().objects.create_user("grace")
    _, answer, _ = services.start_turn(user=owner, conversation_id=None, content="mine")
    services.finish_answer(answer_id=answer.pk, content="the whole answer", status=MessageStatus.COMPLETE)

    async def resume(user, message: dict) -> list[dict]:
        comm = WebsocketCommunicator(ChatConsumer.as_asgi(), "/ws/chat/")
        comm.scope["user"] = user
        assert (await comm.connect())[0]
        await comm.send_json_to(message)
        received = [await comm.receive_json_from(timeout=10)]
        await comm.disconnect()
        return received

    (told,) = async_to_sync(resume)(owner, {"type": "resume", "answer": answer.pk, "after": 3})
    assert (told["type"], told["content"], told["status"]) == ("done", "the whole answer", "complete")
    (refused,) = async_to_sync(resume)(other, {"type": "resume", "answer": answer.pk, "after": 0})
    assert refused == {"type": "error", "detail": f"no answer {answer.pk}", "answer": answer.pk}  # not even its end
    for bad in ({"answer": "1"}, {"answer": 0}, {"answer": answer.pk, "after": -1}, {"answer": True}):
        (error,) = async_to_sync(resume)(owner, {"type": "resume", **bad})
        assert error["type"] == "error" and "must be" in error["detail"]


def test_a_page_that_comes_back_after_the_end_is_shown_the_pieces_it_missed_then_the_end(
    transactional_db, channel_layer_on_test_redis
) -> None:
    """The page's socket closed after piece 0 and the answer ended before it asked again (a short
    answer on a fast cluster): it is shown the pieces from 1 on, each once, then the end, and what it
    was shown reads as the saved answer. It was told the end alone, its text short of the answer's."""
    from channels.testing import WebsocketCommunicator

    from controlplane.chat.consumers import ChatConsumer

    owner = get_user_model().objects.create_user("ivan")
    _, answer, _ = services.start_turn(user=owner, conversation_id=None, content="question")
    meta = tape.Meta(deployment_id=1, deployment="d", user_id=owner.pk, prompt_ids=[1], max_tokens=8, request_id="r")
    tape.start(answer.pk, meta)
    # Piece 1 ends inside a character (no text of its own); main's end is the last piece.
    for index, (token_id, text) in enumerate([(10, "Hel"), (11, ""), (12, "lo"), (13, " there"), (tape.NO_TOKEN, "")]):
        async_to_sync(tape.append)(answer.pk, tape.Piece(index, token_id, text))
    services.finish_answer(answer_id=answer.pk, content="Hello there", status=MessageStatus.COMPLETE)
    async_to_sync(tape.append_end)(answer.pk, services.answer_end(answer_id=answer.pk))

    async def comes_back() -> list[dict]:
        comm = WebsocketCommunicator(ChatConsumer.as_asgi(), "/ws/chat/")
        comm.scope["user"] = owner
        assert (await comm.connect())[0]
        await comm.send_json_to({"type": "resume", "answer": answer.pk, "after": 1})
        received = [await comm.receive_json_from(timeout=10)]
        while received[-1]["type"] != "done":
            received.append(await comm.receive_json_from(timeout=10))
        await comm.disconnect()
        return received

    *shown, done = async_to_sync(comes_back)()
    assert [(event["type"], event["index"]) for event in shown] == [("token", 2), ("token", 3)]
    assert "Hel" + "".join(event["text"] for event in shown) == done["content"] == "Hello there"
    assert done["status"] == "complete"


def test_a_stop_before_the_answer_has_a_tape_writes_nothing_and_a_partial_meta_is_none(
    channel_layer_on_test_redis,
) -> None:
    assert tape.mark_stopped(737373) is False
    assert not client().exists("odmoe:chat:answer:737373:meta")  # no hash without a deployment or an expiry
    client().hset("odmoe:chat:answer:737373:meta", "stopped", 1)  # as an older stop could leave one
    assert tape.read_meta(737373) is None  # nothing a writer can go on from; no KeyError


def test_an_answer_whose_writer_holds_its_lease_is_not_settled_however_late_its_last_touch(
    channel_layer_on_test_redis,
) -> None:
    user = get_user_model().objects.create_user("heidi")
    _, answer, _ = services.start_turn(user=user, conversation_id=None, content="question")
    Message.objects.filter(pk=answer.pk).update(created_at=timezone.now() - timedelta(seconds=writing.STALE_S * 2))
    client().zadd(writing.KEY, {str(answer.pk): 1.0})  # last touched long ago...
    assert writing.claim(answer.pk, "a writer that just took it over")  # ...but a writer holds it now
    assert services.settle_interrupted() == []
    assert Message.objects.get(pk=answer.pk).status == MessageStatus.STREAMING


def test_a_writer_waits_out_a_redis_restart_and_the_tape_keeps_every_piece(tmp_path, settings) -> None:
    """Redis stopped between two pieces and started again half a second later (its append-only file,
    as in production): the piece waits for it and goes on the tape once, after the one before."""
    from controlplane.ops.processes import ProcessGroup, python_env
    from deploy.prodcheck import start_redis

    meta = tape.Meta(deployment_id=1, deployment="d", user_id=1, prompt_ids=[1], max_tokens=4, request_id="r")
    with ProcessGroup(tmp_path / "logs", python_env()) as group:
        settings.REDIS_URL = start_redis(group, tmp_path)
        tape.start(636363, meta)
        (server,) = group.children
        argv = list(server.process.args)

        async def across_a_restart() -> None:
            await tape.append(636363, tape.Piece(0, 10, "a"))
            group.stop(server)  # a clean stop: the append-only file has piece 0
            appending = asyncio.create_task(tape.append(636363, tape.Piece(1, 11, "b")))
            await asyncio.sleep(0.5)
            assert not appending.done()  # waiting for Redis, not given up
            group.start("redis", argv)
            await asyncio.wait_for(appending, tape.REDIS_WAIT_S)

        async_to_sync(across_a_restart)()
        assert tape.token_ids(tape.pieces(636363)) == [10, 11]
