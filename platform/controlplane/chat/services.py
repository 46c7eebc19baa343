"""Writes of the chat: a turn starts with the user's message saved, and ends with the answer saved.

The user's words are stored before anything can fail, so nothing they wrote is ever lost;
the answer is stored as it ended (complete, stopped, or failed with the reason).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from controlplane.accounts.services import record_usage
from controlplane.accounts.usage import Caller
from controlplane.deployments import generation
from controlplane.deployments.generation import ClusterUnavailable
from controlplane.deployments.models import Deployment
from controlplane.nodes import liveness
from controlplane.shared_redis import ERRORS
from controlplane.storable import storable_json, storable_text

from . import protocol, tape, writing
from .models import TITLE_CHARS, Conversation, Message, MessageStatus

log = logging.getLogger(__name__)

# ``taken_over_at``: where each writer that took the answer over began (``chat.writer``).
SHOWN_METRICS = ("ttft_ms", "decode_tok_s", "recall", "generated_tokens", "taken_over_at")


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


@dataclass(frozen=True)
class Usage:
    """An answer's tokens, counted to its user under the deployment's name."""

    caller: Caller
    deployment: str
    prompt_tokens: int
    completion_tokens: int


def finish_answer(
    *,
    answer_id: int,
    status: str,
    content: str | None = None,
    metrics: dict | None = None,
    error: str = "",
    usage: Usage | None = None,
) -> bool:
    """Store the end of an answer still being written (generated text and the cluster's error text
    made storable), and count its tokens, in one transaction; False when it had ended already (another
    writer saved it): nothing is stored or counted twice. ``content`` None keeps what was saved so
    far; ``usage`` None counts nothing."""
    shown = {k: (metrics or {}).get(k) for k in SHOWN_METRICS if (metrics or {}).get(k) is not None}
    fields = {"status": status, "metrics": storable_json(shown), "error": storable_text(error)}
    if content is not None:
        fields["content"] = storable_text(content)
    with transaction.atomic():
        saved = Message.objects.filter(pk=answer_id, status=MessageStatus.STREAMING).update(**fields)
        if saved and usage is not None:
            record_usage(
                caller=usage.caller,
                deployment=usage.deployment,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
            )
    writing.done(answer_id)
    return bool(saved)


def answer_end(*, answer_id: int) -> dict:
    """What a page is told at an answer's end, from the answer as stored: ``done``, and the ``error``
    shown before it (empty when none)."""
    answer = Message.objects.get(pk=answer_id)
    done = protocol.done(answer.pk, answer.content, answer.status, answer.metrics)
    return {"done": done, "error": answer.error}


def followable(*, user: AbstractBaseUser, answer_id: int) -> Message | None:
    """The user's own answer ``answer_id`` (None: no such answer of theirs)."""
    return Message.objects.filter(pk=answer_id, role="assistant", conversation__owner=user).first()


def is_streaming(*, answer_id: int) -> bool:
    return Message.objects.filter(pk=answer_id, status=MessageStatus.STREAMING).exists()


def main_heard_since(*, deployment_id: int, since: float) -> bool:
    """Whether the agent of the deployment's main node was heard after ``since`` (Unix time): its link
    is up in some web process, so what is sent to it gets there."""
    try:
        node_id = generation.main_node(deployment_id)
    except ClusterUnavailable:
        return False
    return liveness.heard_at([node_id]).get(node_id, 0.0) > since


def deployment_model_path(*, deployment_id: int | None) -> str | None:
    """The checkpoint a deployment serves (None: no such deployment)."""
    deployment = Deployment.objects.select_related("model").filter(pk=deployment_id).first()
    return deployment.model.path if deployment is not None else None


def settle_interrupted() -> list[int]:
    """Every answer whose writer stopped and that no page took over (``writing.orphans``): failed with
    ``writing.INTERRUPTED``, its text as far as its tape has it, its generation stopped if main still
    runs it, and its tokens counted; the ids of those settled now."""
    settled = []
    for answer_id in writing.orphans():
        try:
            meta, pieces = tape.read_meta(answer_id), tape.pieces(answer_id)
        except ERRORS:
            meta, pieces = None, []
        usage = None
        if meta is not None:
            with contextlib.suppress(ClusterUnavailable, *ERRORS):
                generation.cancel(meta.deployment_id, meta.request_id)
            usage = Usage(Caller(meta.user_id), meta.deployment, len(meta.prompt_ids), len(tape.token_ids(pieces)))
        content = "".join(piece.text for piece in pieces) if pieces else None
        if finish_answer(
            answer_id=answer_id,
            content=content,
            status=MessageStatus.FAILED,
            metrics={},
            error=writing.INTERRUPTED,
            usage=usage,
        ):
            settled.append(answer_id)
    if settled:
        log.warning("chat answers whose writer stopped, now failed: %s", ", ".join(map(str, settled)))
    return settled


def save_partial(*, answer_id: int, content: str) -> None:
    """What an answer still being written has so far (it survives its writer), noted as being written."""
    Message.objects.filter(pk=answer_id, status=MessageStatus.STREAMING).update(content=storable_text(content))
    writing.touch(answer_id)


def set_model(*, answer_id: int, model_name: str) -> None:
    Message.objects.filter(pk=answer_id).update(model_name=model_name)
