"""The chat websocket: a user's message in, the answer's tokens out as the cluster makes them.

Only logged-in users connect (the session cookie), each with at most
``settings.CHAT_PAGES_PER_USER`` sockets open in one web process (``chat.pages``); one answer at a
time per socket, and at most ``DEFAULT_THROTTLE_RATES["chat"]`` messages a user (past it a message
is refused before anything of it is stored). The answer is written by its writer (``chat.writer``),
not by the socket: the socket follows the answer's tape (``chat.tape``), and a page that comes back
(``resume``: a reconnection, a reload, another web worker after one restarted) follows it again
from where it was (one that ended meanwhile: the pieces the page missed, then its end). A ``stop``
message really stops the generation on the cluster; closing the page stops it when no page has come
back within ``settings.CHAT_RESUME_GRACE_S``. A socket following an answer whose writer died takes
the writing over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable

from asgiref.sync import sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.database_away import AWAY, once_connected, waiting_for_the_database
from controlplane.serving import completions
from controlplane.serving import metrics as served
from controlplane.serving.bounds import CHAT_MESSAGE_CHARS, check_messages_size
from controlplane.serving.completions import ClusterUnavailable
from controlplane.serving.text import InputError, chat_text, check_lengths, check_text_fits, encode_chat_text
from controlplane.shared_redis import ERRORS
from controlplane.throttles import chat_message_wait

from . import pages, protocol, services, tape, writer, writing
from .models import MessageStatus

log = logging.getLogger(__name__)

CLOSE_UNAUTHENTICATED = 4401
RETRY_S = 1.0  # how long a page's follower waits before reading a tape Redis failed to give
NO_CHANNEL_LAYER = "none: a chat socket takes no channel"  # an alias CHANNEL_LAYERS never names


class ChatConsumer(AsyncJsonWebsocketConsumer):
    # A chat socket takes no channel of the channel layer: the answer's writer, not the socket, talks
    # to the cluster. A consumer with one cancels its channel's receive when its socket closes, and a
    # receive cancelled while it pops loses what it took from Redis, whichever of the process's
    # channels it was for (channels_redis#366, ``deployments.generation``): closing a chat page failed
    # another answer written in the same process, its next token never coming. No layer is configured
    # under this alias, so Channels gives the consumer none.
    channel_layer_alias = NO_CHANNEL_LAYER

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.answering: asyncio.Task | None = None  # starting an answer, then following it
        self.following: int | None = None  # the answer this page shows, while it is written
        self.answer_id: int | None = None  # the answer ``answering`` is for, once stored
        self.counted: int | None = None  # the user this page counts to (``pages``), while it is open

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        await self.accept()
        if not pages.enter(user.pk):  # the user's other pages go on
            await self.close(code=pages.CLOSE_TOO_MANY_PAGES, reason=pages.too_many())
            return
        self.counted = user.pk

    async def disconnect(self, code: int) -> None:
        if self.counted is not None:
            pages.leave(self.counted)
            self.counted = None
        # The answer goes on (``writer``): the page may come back for it.
        if self.answering is not None:
            self.answering.cancel()

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        """A frame that is not JSON text gets an error like a malformed message: Channels' own JSON
        consumer raises on it (a binary or empty frame, text that is not JSON, nests too deep or
        holds an integer past Python's digit limit), which closed the socket as a server error."""
        if self.counted is None:  # a page refused past the bound, already closed: nothing it sends is read
            return
        try:
            if not text_data:
                raise ValueError("a message must be a JSON text frame")
            if len(text_data) > protocol.MAX_FRAME_CHARS:
                raise ValueError(f"a message is at most {CHAT_MESSAGE_CHARS.limit} characters")
            content = await self.decode_json(text_data)
        except (ValueError, RecursionError) as exc:
            await self.send_json(protocol.error(f"not a JSON message: {exc}"))
            return
        await self.receive_json(content, **kwargs)

    async def receive_json(self, content, **kwargs) -> None:
        try:
            message = protocol.parse_client(content)
        except protocol.ProtocolError as exc:
            await self.send_json(protocol.error(str(exc)))
            return
        if isinstance(message, protocol.Stop):
            await self._stop()
        elif self.answering is not None and not self.answering.done():
            await self.send_json(protocol.refused("an answer is still being written: wait for it or stop it"))
        elif isinstance(message, protocol.Resume):
            self.answer_id = message.answer
            self.answering = asyncio.create_task(self._told_if_it_fails(self._resume(message)))
        elif (wait := await sync_to_async(chat_message_wait)(self.scope["user"])) is not None:
            # Refused before anything is stored; the page keeps what was written.
            detail = f"you are sending messages faster than this server takes them; try again in {math.ceil(wait)} s"
            await self.send_json(protocol.refused(detail))
        else:
            self.answer_id = None  # none stored yet
            self.answering = asyncio.create_task(self._told_if_it_fails(self._answer(message)))

    async def _told_if_it_fails(self, work: Awaitable[None]) -> None:
        """An answer's work, run beside the socket: if it fails past what it handles (a bug, the
        database away longer than it waits), the page is told so rather than left waiting in silence."""
        try:
            await work
        except Exception as exc:
            log.exception("chat answer %s: its page's work failed", self.answer_id)
            detail = f"the answer could not be written ({exc}); try again"
            with contextlib.suppress(Exception):  # the socket may be gone too
                if self.answer_id is None:  # nothing stored: the page keeps what was written
                    await self.send_json(protocol.refused(detail))
                else:  # the page stops waiting for it
                    await self.send_json(protocol.lost(self.answer_id, detail))

    async def _stop(self) -> None:
        if self.following is not None:
            try:
                await writer.stop(self.following)
            except ERRORS as exc:
                await self.send_json(protocol.error(f"the answer could not be stopped now ({exc}); try again"))

    async def _answer(self, send: protocol.Send) -> None:
        user = self.scope["user"]
        try:  # not tried again: a try whose reply was lost may have stored the question
            conversation, answer, history = await once_connected(  # away (restarting): waited for
                services.start_turn, user=user, conversation_id=send.conversation, content=send.content
            )
        except services.ChatError as exc:
            await self.send_json(protocol.refused(str(exc)))
            return
        except AWAY as exc:  # away past the wait, or gone after it: refused, the page keeps what was written
            await self.send_json(protocol.refused(f"the database cannot be reached right now ({exc}); try again"))
            return
        self.answer_id = answer.pk
        await self.send_json(protocol.conversation(conversation.pk, conversation.title, answer.pk))
        try:
            target, prompt_ids = await waiting_for_the_database(_prepare, history, send.max_tokens)
            await waiting_for_the_database(services.set_model, answer_id=answer.pk, model_name=target.name)
            meta = tape.Meta(
                deployment_id=target.deployment_id,
                deployment=target.name,
                user_id=user.pk,
                prompt_ids=prompt_ids,
                max_tokens=send.max_tokens,
                request_id=completions.new_request_id(),
            )
            holder = await asyncio.to_thread(writer.start, answer.pk, meta)
        except (ClusterUnavailable, InputError) as exc:
            await self._failed(answer.pk, str(exc))
            return
        except ERRORS as exc:
            await self._failed(answer.pk, f"the answer cannot be kept while Redis is away ({exc}); try again")
            return
        except AWAY as exc:
            await self._failed(answer.pk, f"the database cannot be reached right now ({exc}); try again")
            return
        writer.begin(answer.pk, meta, target.model_path, holder)
        await self._follow(answer.pk, 0)

    async def _failed(self, answer_id: int, error: str) -> None:
        """An answer that failed before its writer started: saved so, and the page told."""
        served.record("chat", ok=False)
        await waiting_for_the_database(
            services.finish_answer, answer_id=answer_id, content="", status=MessageStatus.FAILED, error=error
        )
        await self._send_end(await waiting_for_the_database(services.answer_end, answer_id=answer_id))

    async def _resume(self, resume: protocol.Resume) -> None:
        """The page asks again for an answer it was shown in part: the rest, or its end."""
        answer = await waiting_for_the_database(services.followable, user=self.scope["user"], answer_id=resume.answer)
        if answer is None:
            await self.send_json(protocol.lost(resume.answer, f"no answer {resume.answer}"))
            return
        served.CHAT_RESUMES.inc()
        if answer.status != MessageStatus.STREAMING:
            await self._show_ended(answer.pk, resume.after)
            return
        await self._follow(answer.pk, resume.after)

    async def _show_ended(self, answer_id: int, after: int) -> None:
        """An answer that ended while the page was away: the pieces from ``after`` on that its tape still
        has, then its end. Its writer puts every piece on the tape before it saves the end, so none the
        page missed is left out; a tape gone (expired, or Redis away) leaves the end alone, which holds
        the whole answer."""
        try:
            missed = await asyncio.to_thread(tape.pieces, answer_id, after)
        except ERRORS as exc:
            log.warning("chat answer %s: its tape could not be read (%s); its end alone is shown", answer_id, exc)
            missed = []
        for piece in missed:
            if piece.text:
                await self.send_json(protocol.token(piece.text, piece.index))
        await self._send_end(await waiting_for_the_database(services.answer_end, answer_id=answer_id))

    async def _follow(self, answer_id: int, after: int) -> None:
        """Show the answer from its piece ``after`` to its end, as its writer puts it on the tape.
        Every ``writing.TOUCH_S`` the page says it watches, and takes the writing over if the writer
        stopped (its web process died)."""
        self.following, checked = answer_id, 0.0
        try:
            while True:
                try:
                    async for item in tape.follow(answer_id, after):
                        if isinstance(item, tape.End):
                            await self._send_end(item.message)
                            return
                        if isinstance(item, tape.Piece):
                            after = item.index + 1
                            if item.text:
                                await self.send_json(protocol.token(item.text, item.index))
                        if time.monotonic() - checked >= writing.TOUCH_S:
                            checked = time.monotonic()
                            await asyncio.to_thread(writing.watch, answer_id)
                            await self._take_over_if_orphaned(answer_id)
                except ERRORS as exc:  # Redis restarting: the answer is kept, read on when it is back
                    log.warning("chat answer %s: its tape could not be read (%s); trying again", answer_id, exc)
                    await asyncio.sleep(RETRY_S)
        finally:
            self.following = None

    async def _take_over_if_orphaned(self, answer_id: int) -> None:
        try:
            await writer.take_over(answer_id)
        except ERRORS:
            raise
        except Exception:  # the page goes on following; the next look tries again
            log.exception("chat answer %s: its writing could not be taken over", answer_id)

    async def _send_end(self, end: dict) -> None:
        if end.get("error"):
            await self.send_json(protocol.error(end["error"]))
        await self.send_json(end["done"])


def _prepare(history: list[dict], max_tokens: int):
    """The deployment and prompt ids of a conversation, held to the request bounds and the context."""
    target = completions.find_target()
    try:
        check_messages_size(history)  # a conversation grows turn by turn: bounded as the API's is
        # A conversation too long for the context in characters, as its template writes it, is not even tokenized.
        text = chat_text(target.tokenizer, history)
        check_text_fits(target.tokenizer, [text], max_tokens, target.context, param="messages")
        prompt_ids = encode_chat_text(target.tokenizer, text)
        check_lengths(len(prompt_ids), max_tokens, target.context)
    except InputError as exc:
        raise InputError(f"{exc}; start a new conversation", param=exc.param, code=exc.code) from None
    return target, prompt_ids
