"""The chat websocket: a user's message in, the answer's tokens out as the cluster makes them.

Only logged-in users connect (the session cookie); one answer at a time per socket, and at
most ``DEFAULT_THROTTLE_RATES["chat"]`` messages a user (past it a message is refused before
anything of it is stored); a ``stop`` message really stops the generation on the cluster, and
so does closing the page.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.accounts.usage import Caller
from controlplane.deployments import generation
from controlplane.serving import completions
from controlplane.serving import metrics as served
from controlplane.serving.bounds import CHAT_MESSAGE_CHARS, check_messages_size
from controlplane.serving.completions import ClusterGenerationError, ClusterUnavailable, CompletionResult, TextDelta
from controlplane.serving.text import (
    InputError,
    Sampling,
    chat_text,
    check_lengths,
    check_text_fits,
    encode_chat_text,
)
from controlplane.throttles import chat_message_wait

from . import protocol, services, writing
from .models import MessageStatus

log = logging.getLogger(__name__)

CLOSE_UNAUTHENTICATED = 4401
GREEDY = Sampling(temperature=0.0)


class ChatConsumer(AsyncJsonWebsocketConsumer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.answering: asyncio.Task | None = None
        self.running: tuple[int, str] | None = None  # (deployment id, request id) of the generation in flight
        self.partial = ""  # the answer being written, so far

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self._stop_generation()
        if self.answering is not None:
            self.answering.cancel()

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        """A frame that is not JSON text gets an error like a malformed message: Channels' own JSON
        consumer raises on it (a binary or empty frame, text that is not JSON, nests too deep or
        holds an integer past Python's digit limit), which closed the socket as a server error."""
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
            await self._stop_generation()
        elif self.answering is not None and not self.answering.done():
            await self.send_json(protocol.refused("an answer is still being written: wait for it or stop it"))
        elif (wait := await sync_to_async(chat_message_wait)(self.scope["user"])) is not None:
            # Refused before anything is stored; the page keeps what was written.
            detail = f"you are sending messages faster than this server takes them; try again in {math.ceil(wait)} s"
            await self.send_json(protocol.refused(detail))
        else:
            self.answering = asyncio.create_task(self._answer(message))

    async def _stop_generation(self) -> None:
        if self.running is not None:
            with contextlib.suppress(ClusterUnavailable):
                await generation.acancel(*self.running)

    async def _answer(self, send: protocol.Send) -> None:
        user = self.scope["user"]
        try:
            conversation, answer, history = await database_sync_to_async(services.start_turn)(
                user=user, conversation_id=send.conversation, content=send.content
            )
        except services.ChatError as exc:
            await self.send_json(protocol.refused(str(exc)))
            return
        await self.send_json(protocol.conversation(conversation.pk, conversation.title))
        text, status, metrics, error = "", MessageStatus.FAILED, {}, ""
        self.partial = ""
        keeping = asyncio.create_task(self._keep_writing(answer.pk))
        try:
            target, prompt_ids = await database_sync_to_async(_prepare, thread_sensitive=False)(
                history, send.max_tokens
            )
            await database_sync_to_async(services.set_model)(answer_id=answer.pk, model_name=target.name)
            request_id = completions.new_request_id()
            self.running = (target.deployment_id, request_id)
            # Main bounds the user's generations (the API's and jobs' too): past it, ClusterGenerationError.
            stream = completions.astream(
                target, prompt_ids, send.max_tokens, GREEDY, caller=Caller(user.pk), request_id=request_id
            )
            async for item in stream:
                if isinstance(item, TextDelta):
                    text += item.text
                    self.partial = text
                    await self.send_json(protocol.token(item.text))
                elif isinstance(item, CompletionResult):
                    text, metrics = item.text, item.metrics
                    status = MessageStatus.STOPPED if item.finish_reason == "cancelled" else MessageStatus.COMPLETE
                    served.record("chat", ok=True, prompt_tokens=item.prompt_tokens, metrics=item.metrics)
        except (ClusterUnavailable, ClusterGenerationError, InputError) as exc:
            error = str(exc)
            served.record("chat", ok=False)
        except asyncio.CancelledError:
            status, error = MessageStatus.STOPPED, "the page was closed"
            raise
        finally:
            self.running = None
            keeping.cancel()
            await database_sync_to_async(services.finish_turn)(
                answer_id=answer.pk, content=text, status=status, metrics=metrics, error=error
            )
        if error:
            await self.send_json(protocol.error(error))
        shown = {k: metrics.get(k) for k in services.SHOWN_METRICS if metrics.get(k) is not None}
        await self.send_json(protocol.done(answer.pk, text, status, shown))

    async def _keep_writing(self, answer_id: int) -> None:
        """While the answer is being written, every ``writing.TOUCH_S``: what it has so far saved (it
        outlives this process) and the answer noted as still being written, even while no token comes
        (a queue, a long prefill), so that no other process takes it for one whose writer died."""
        while True:
            await asyncio.sleep(writing.TOUCH_S)
            await database_sync_to_async(services.save_partial)(answer_id=answer_id, content=self.partial)


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
