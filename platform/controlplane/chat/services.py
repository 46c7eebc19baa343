"""Writes of the chat: a turn starts with the user's message saved, and ends with the answer saved.

The user's words are stored before anything can fail, so nothing they wrote is ever lost;
the answer is stored as it ended (complete, stopped, or failed with the reason).
"""

from __future__ import annotations

from collections.abc import Iterable

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from controlplane.storable import storable_json, storable_text

from . import writing
from .models import TITLE_CHARS, Conversation, Message, MessageStatus

SHOWN_METRICS = ("ttft_ms", "decode_tok_s", "recall", "generated_tokens")


class ChatError(ValueError):
    """A chat action that cannot be done; the message says why."""


@transaction.atomic
def start_turn(
    *, user: AbstractBaseUser, conversation_id: int | None, content: str
) -> tuple[Conversation, Message, list]:
    """Save the user's message (in a new conversation if none is given) and an empty answer."""
    if conversation_id is None:
        title = content.strip().splitlines()[0][:TITLE_CHARS]
        conversation = Conversation.objects.create(owner=user, title=title)
    else:
        conversation = Conversation.objects.filter(pk=conversation_id, owner=user).first()
        if conversation is None:
            raise ChatError(f"no conversation {conversation_id}")
        conversation.save(update_fields=["updated_at"])
    Message.objects.create(conversation=conversation, role="user", content=content)
    history = prompt_history(conversation.messages.all())
    answer = Message.objects.create(conversation=conversation, role="assistant", status=MessageStatus.STREAMING)
    writing.touch(answer.pk)
    return conversation, answer, history


def prompt_history(messages: Iterable[Message]) -> list[dict]:
    """The conversation the model is shown: every turn but those whose answer failed.

    A failed turn is left out whole (the question with its missing answer), so user and
    assistant still alternate, as instruct models' chat templates require (Mixtral-Instruct's
    refuses two user messages in a row).
    """
    history: list[dict] = []
    for message in messages:
        if message.role == "assistant" and message.status == MessageStatus.FAILED:
            if history and history[-1]["role"] == "user":
                history.pop()
            continue
        history.append({"role": message.role, "content": message.content})
    return history


def finish_turn(*, answer_id: int, content: str, status: str, metrics: dict | None = None, error: str = "") -> None:
    """Store the answer as it ended; generated text and the cluster's error text made storable."""
    shown = {k: (metrics or {}).get(k) for k in SHOWN_METRICS if (metrics or {}).get(k) is not None}
    Message.objects.filter(pk=answer_id).update(
        content=storable_text(content), status=status, metrics=storable_json(shown), error=storable_text(error)
    )
    writing.done(answer_id)


def save_partial(*, answer_id: int, content: str) -> None:
    """What an answer still being written has so far (it survives its writer), noted as being written."""
    Message.objects.filter(pk=answer_id, status=MessageStatus.STREAMING).update(content=storable_text(content))
    writing.touch(answer_id)


def set_model(*, answer_id: int, model_name: str) -> None:
    Message.objects.filter(pk=answer_id).update(model_name=model_name)
