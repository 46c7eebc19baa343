"""What travels on the chat websocket (``/ws/chat``), both ways, as JSON objects with a ``type``.

Browser → server: ``{"type": "send", "conversation": ID | null, "content": TEXT, "max_tokens": N?}``,
``{"type": "stop"}`` and ``{"type": "resume", "answer": ID, "after": N}`` (a page whose socket
closed mid-answer, or that was reloaded, asks for the answer from its piece ``N`` on). Server →
browser: ``conversation`` (the conversation the answer belongs to, and the answer's id), ``token``
(a piece of text, with its ``index`` in the answer), ``done`` (the saved answer with its figures) and
``error`` (a reason to show; with ``"refused": true`` when the message was turned away and
nothing of it stored, so the page gives the text back; with ``"answer": ID`` when that answer cannot
be followed, so the page stops waiting for it). ``parse_client`` validates what
arrives and says what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.serving.bounds import CHAT_MAX_TOKENS, CHAT_MESSAGE_CHARS

# The longest frame a valid message can be: its content with every character escaped as JSON
# may write it (\ud83d\ude00, 12 characters for one), and room for the other fields. A longer
# frame is refused before it is decoded (the edge caps every frame at MAX_REQUEST_BYTES).
MAX_FRAME_CHARS = 12 * CHAT_MESSAGE_CHARS.limit + 1024
DEFAULT_MAX_TOKENS = 128


class ProtocolError(ValueError):
    """A browser message that is not valid; the message says why."""


@dataclass(frozen=True)
class Send:
    conversation: int | None
    content: str
    max_tokens: int = DEFAULT_MAX_TOKENS


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Resume:
    answer: int
    after: int  # the pieces of it the page has


def parse_client(obj: object) -> Send | Stop | Resume:
    if not isinstance(obj, dict):
        raise ProtocolError("a message must be a JSON object")
    kind = obj.get("type")
    if kind == "stop":
        return Stop()
    if kind == "resume":
        answer, after = obj.get("answer"), obj.get("after", 0)
        if not _whole(answer) or answer < 1:
            raise ProtocolError("answer must be the id of an answer")
        if not _whole(after) or not 0 <= after <= CHAT_MAX_TOKENS.limit:
            raise ProtocolError(f"after must be between 0 and {CHAT_MAX_TOKENS.limit}")
        return Resume(answer, after)
    if kind != "send":
        raise ProtocolError(f"unknown message type {kind!r:.40}")
    content, conversation = obj.get("content"), obj.get("conversation")
    max_tokens = obj.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not isinstance(content, str) or not content.strip():
        raise ProtocolError("write a message first")
    if len(content) > CHAT_MESSAGE_CHARS.limit:
        raise ProtocolError(f"a message is at most {CHAT_MESSAGE_CHARS.limit} characters, this one has {len(content)}")
    if not _storable(content):
        raise ProtocolError("a message cannot hold a NUL character or a lone surrogate")
    if conversation is not None and (not isinstance(conversation, int) or isinstance(conversation, bool)):
        raise ProtocolError("conversation must be an id or null")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= CHAT_MAX_TOKENS.limit:
        raise ProtocolError(f"max_tokens must be between 1 and {CHAT_MAX_TOKENS.limit}")
    return Send(conversation, content, max_tokens)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _storable(text: str) -> bool:
    """Whether a database keeps ``text`` as it is: no lone surrogate (not UTF-8), no NUL (PostgreSQL refuses it)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def token(text: str, index: int) -> dict:
    return {"type": "token", "text": text, "index": index}


def conversation(conversation_id: int, title: str, answer_id: int) -> dict:
    return {"type": "conversation", "id": conversation_id, "title": title, "answer": answer_id}


def done(message_id: int, content: str, status: str, metrics: dict) -> dict:
    return {"type": "done", "message_id": message_id, "content": content, "status": status, "metrics": metrics}


def error(detail: str) -> dict:
    return {"type": "error", "detail": detail}


def lost(answer_id: int, detail: str) -> dict:
    """An error that ends the page's wait for answer ``answer_id``: it cannot be followed (none of the
    user's has that id)."""
    return {"type": "error", "detail": detail, "answer": answer_id}


def refused(detail: str) -> dict:
    """An error that turns a ``send`` away before anything of it is stored: the page keeps the text."""
    return {"type": "error", "detail": detail, "refused": True}
