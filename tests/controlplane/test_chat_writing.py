"""A chat answer whose web process stopped mid-answer (``controlplane.chat.writing``): its partial text
was saved as it came, and it is failed, saying why, instead of staying "being written" forever; an
answer whose writer is alive, however long it waits for a token, is left alone."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from controlplane.chat import services, writing
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
    services.finish_turn(answer_id=answers["done"], content="whole", status=MessageStatus.COMPLETE)
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
    assert writing.settle_interrupted() == []
    assert Message.objects.get(pk=answer.pk).status == MessageStatus.STREAMING
