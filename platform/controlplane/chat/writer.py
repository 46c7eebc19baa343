"""The one writer of a chat answer: it runs the answer's generation, puts each token on the answer's
tape (``chat.tape``) for the pages that show it, and saves the answer when it ends.

A writer is not the page's socket: it lives in the web process, holds the answer's lease
(``writing.claim``) and goes on when the page goes away, for ``settings.CHAT_RESUME_GRACE_S``, so a
reload or a reconnection picks the answer up where it was; past that with no page watching, it stops
the generation (a closed page stopped it at once before). A stop from the page stops it at once.

When the web process writing an answer dies (a crash, a restart), its lease lapses after
``writing.LEASE_S`` and the first page following the answer (``consumers``) claims it: a writer
starts in that process from the tape. It stops the old generation, if main still runs it, and asks
main to go on from the tokens already written: the prompt and those tokens re-prefilled, the rest of
the token budget (the chat's answers are greedy, so this is the answer main would have gone on
with, as ``replay: prefill`` holds a migration to: ``reference_continue``).

Usage is counted here, once per answer, by whichever writer saves its end (``services.finish_answer``
saves the end only of an answer still being written): the prompt once, and every token of the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.db import DatabaseError

from controlplane.accounts.usage import Caller
from controlplane.database_away import waiting_for_the_database
from controlplane.deployments import generation, pauses
from controlplane.deployments.models import PauseCause
from controlplane.serving import completions
from controlplane.serving import metrics as served
from controlplane.serving.completions import ClusterGenerationError, ClusterUnavailable
from controlplane.serving.text import InputError, Sampling, tokenizer_for
from controlplane.shared_redis import ERRORS
from inference.runtime.textstream import IncrementalDecoder
from inference.wire.generation import Done, Token

from . import services, tape, writing
from .models import MessageStatus

log = logging.getLogger(__name__)

GREEDY = Sampling(temperature=0.0)
PAGE_CLOSED = "the page was closed"
MAIN_LINK_WAIT_S = 30.0  # past it a writer that took over sends anyway (and fails as any request would)
USER_STOPPED = "stopped"
_running: set[asyncio.Task] = set()  # this process's writers (held: a bare task may be collected)


@dataclasses.dataclass
class Answer:
    """What a writer has of its answer: the tokens so far and their text."""

    answer_id: int
    meta: tape.Meta
    model_path: str
    holder: str
    taken_over: bool = False  # from a writer that stopped: main may still run that writer's generation
    token_ids: list[int] = dataclasses.field(default_factory=list)
    generated: bool = False  # main ended the generation (the last piece is its tail)
    text: str = ""
    stopped_why: str = ""  # USER_STOPPED or PAGE_CLOSED, once the writer stops the generation
    overtaken: bool = False  # another writer has the answer: this one saves nothing
    cancelled: str = ""  # the request id the writer last cancelled itself


def begin(answer_id: int, meta: tape.Meta, model_path: str, holder: str) -> asyncio.Task:
    """Write a new answer in this process, as ``holder`` (``start`` made its tape and claimed it)."""
    return _spawn(Answer(answer_id, meta, model_path, holder=holder))


def start(answer_id: int, meta: tape.Meta) -> str:
    """A new answer's tape and the writer's claim on it (sync): the writer's holder id."""
    holder = _holder()
    tape.start(answer_id, meta)
    writing.watch(answer_id)  # the page that asked watches it
    if not writing.claim(answer_id, holder):
        raise RuntimeError(f"answer {answer_id} has a writer already")
    return holder


def _holder() -> str:
    return uuid.uuid4().hex


def _spawn(answer: Answer) -> asyncio.Task:
    task = asyncio.create_task(_write(answer), name=f"chat-answer-{answer.answer_id}")
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task


async def take_over(answer_id: int) -> asyncio.Task | None:
    """Become the writer of ``answer_id`` if its writer stopped (its lease lapsed); the writer's
    task, or None when a writer still holds it. Redis errors are raised."""
    holder = _holder()
    if not await asyncio.to_thread(writing.claim, answer_id, holder):
        return None
    try:
        await asyncio.to_thread(writing.touch, answer_id)  # being written again: not an orphan to settle
        meta = await asyncio.to_thread(tape.read_meta, answer_id)
        deployment = await waiting_for_the_database(
            services.deployment_model_path, deployment_id=meta.deployment_id if meta else None
        )
    except BaseException:
        with contextlib.suppress(*ERRORS):
            await asyncio.to_thread(writing.release, answer_id, holder)
        raise
    if meta is None or deployment is None:
        # Nothing to go on from (Redis lost the meta, the deployment is gone): saved as interrupted.
        await database_sync_to_async(services.finish_answer, thread_sensitive=False)(
            answer_id=answer_id, status=MessageStatus.FAILED, error=writing.INTERRUPTED
        )
        await tape.append_end(answer_id, await _end_from_database(answer_id))
        await asyncio.to_thread(writing.release, answer_id, holder)
        return None
    log.warning("chat answer %s: its writer stopped; this process writes the rest", answer_id)
    served.CHAT_TAKEOVERS.inc()
    return _spawn(Answer(answer_id, meta, deployment, holder=holder, taken_over=True))


async def stop(answer_id: int) -> None:
    """The user stopped the answer: its generation stops now, and no writer starts another."""
    if not await asyncio.to_thread(tape.mark_stopped, answer_id):
        return
    meta = await asyncio.to_thread(tape.read_meta, answer_id)  # after the mark: the generation running now
    if meta is not None:
        with contextlib.suppress(ClusterUnavailable):
            await generation.acancel(meta.deployment_id, meta.request_id)


async def _write(answer: Answer) -> None:
    answer_id = answer.answer_id
    try:
        ended = await asyncio.to_thread(tape.ended, answer_id) is not None
        if not ended and not await _still_streaming(answer_id):  # settled meanwhile (``settle_interrupted``)
            with contextlib.suppress(tape.Overtaken):
                await tape.append_end(answer_id, await _end_from_database(answer_id))
            ended = True
        prior = [] if ended else await asyncio.to_thread(tape.pieces, answer_id)
    except (*ERRORS, DatabaseError):  # away past its wait: the next writer (or beat) settles it
        log.exception("chat answer %s: its tape or its row could not be read", answer_id)
        ended = True
    if ended:  # nothing left to write: the pages following it have its end, or read it again
        with contextlib.suppress(*ERRORS):
            await asyncio.to_thread(writing.release, answer_id, answer.holder)
        return
    answer.token_ids = tape.token_ids(prior)
    answer.generated = bool(prior) and prior[-1].token_id == tape.NO_TOKEN  # main's end came
    answer.text = "".join(piece.text for piece in prior)
    status, metrics, error = MessageStatus.FAILED, {}, ""
    keeping = asyncio.create_task(_keep(answer))
    try:
        status, metrics = await _generate(answer)
    except tape.Overtaken:
        log.warning("chat answer %s: another writer has it; this one stops", answer_id)
        await _cancel_current(answer)
        return
    except (ClusterUnavailable, ClusterGenerationError, InputError) as exc:
        error = str(exc)
    except asyncio.CancelledError:
        # This process is going away: the answer is not over, the next writer goes on from the tape.
        with contextlib.suppress(*ERRORS):
            writing.release(answer_id, answer.holder)
        raise
    except Exception as exc:
        log.exception("chat answer %s: its writer failed", answer_id)
        error = f"the answer could not be written: {exc}"
    finally:
        keeping.cancel()
    if answer.overtaken:
        return
    if answer.stopped_why == PAGE_CLOSED and status == MessageStatus.STOPPED:
        error = PAGE_CLOSED
    await _finish(answer, status, metrics, error)


async def _generate(answer: Answer) -> tuple[str, dict]:
    """Main writes the answer (the rest of it, when taken over); its status and metrics at the end."""
    meta, answer_id = answer.meta, answer.answer_id
    if meta.stopped:
        return MessageStatus.STOPPED, {}
    budget = meta.max_tokens - len(answer.token_ids)
    if budget <= 0 or answer.generated:
        return MessageStatus.COMPLETE, {}
    request_id = meta.request_id
    if answer.taken_over:  # main may still run the stopped writer's generation: it is stopped first
        await _wait_for_main_link(meta.deployment_id)
        with contextlib.suppress(ClusterUnavailable):
            await generation.acancel(meta.deployment_id, meta.request_id)
        request_id, resumed_at = completions.new_request_id(), (*meta.resumed_at, len(answer.token_ids))
        now = await asyncio.to_thread(tape.continue_with, answer_id, request_id, resumed_at)
        if now is None or now.stopped:  # stopped while main was down: a stop cancels the request it reads
            return MessageStatus.STOPPED, {}
        answer.meta = meta = now
    tokenizer = await sync_to_async(tokenizer_for, thread_sensitive=False)(answer.model_path)
    decoder = IncrementalDecoder(tokenizer)
    decoder.ids, decoder.emitted = list(answer.token_ids), answer.text
    request = completions.build_request(
        meta.prompt_ids + answer.token_ids, budget, GREEDY, request_id, Caller(meta.user_id)
    )
    pausing = answer.taken_over  # until its first piece: the page has waited since the stopped writer's last
    # Counted by the writer that saves the end (``_finish``), not per generation: once per answer.
    async for event in generation.astream(meta.deployment_id, request, caller=None):
        if isinstance(event, Token):
            piece = tape.Piece(len(answer.token_ids), event.token_id, decoder.add(event.token_id))
            since = await tape.append(answer_id, piece)
            answer.token_ids.append(event.token_id)
            answer.text = decoder.emitted
        elif isinstance(event, Done):
            # Main's end, on the tape (a writer taking over after it writes no more), with the text of
            # a last incomplete character if any.
            since = await tape.append(answer_id, tape.Piece(len(answer.token_ids), tape.NO_TOKEN, decoder.flush()))
            answer.text = decoder.emitted
        if pausing:
            pausing = False
            await _note_takeover(meta, since)
        if isinstance(event, Done):
            served.record("chat", ok=True, prompt_tokens=len(meta.prompt_ids), metrics=event.metrics)
            status = MessageStatus.STOPPED if event.finish_reason == "cancelled" else MessageStatus.COMPLETE
            return status, event.metrics
    raise ClusterGenerationError("the cluster ended the generation without a result")


async def _note_takeover(meta: tape.Meta, since: float | None) -> None:
    """The pause a takeover made, for the console: from the stopped writer's last piece (``since``
    seconds before this writer's first; None when it had written none)."""
    paused_ms = round(since * 1000, 1) if since is not None else None
    pause = pauses.Pause(PauseCause.WEB_RESTART, meta.resumed_at[-1], paused_ms, "prefill from the tape")
    await pauses.keep(meta.deployment_id, meta.request_id, [pause])


async def _wait_for_main_link(deployment_id: int) -> None:
    """Until main's agent is heard again (at most ``MAIN_LINK_WAIT_S``): the web process that died may
    have held its link, and what is sent to main before its agent links again is lost."""
    since, deadline = time.time(), time.monotonic() + MAIN_LINK_WAIT_S
    heard = database_sync_to_async(services.main_heard_since, thread_sensitive=False)
    while time.monotonic() < deadline and not await heard(deployment_id=deployment_id, since=since):
        await asyncio.sleep(0.5)


async def _keep(answer: Answer) -> None:
    """Every ``writing.TOUCH_S`` while the answer is written: its lease renewed, what it has so far
    saved (it outlives this process), and the generation stopped when the user stopped it, when no
    page has watched it for ``settings.CHAT_RESUME_GRACE_S``, or when another writer took it."""
    answer_id = answer.answer_id
    while True:
        await asyncio.sleep(writing.TOUCH_S)
        try:
            await database_sync_to_async(services.save_partial, thread_sensitive=False)(
                answer_id=answer_id, content=answer.text
            )
            held = await asyncio.to_thread(writing.renew, answer_id, answer.holder)
            if not held:  # lapsed (this loop stalled): still ours unless another writer claimed it
                held = await asyncio.to_thread(writing.claim, answer_id, answer.holder)
            meta = await asyncio.to_thread(tape.read_meta, answer_id)
            watched = await asyncio.to_thread(writing.watched, answer_id)
        except (*ERRORS, DatabaseError) as exc:  # Redis or PostgreSQL restarting: the answer goes on, as this loop
            log.warning("chat answer %s: its lease could not be renewed or its text saved (%s)", answer_id, exc)
            continue
        why = ""
        if not held:
            answer.overtaken = True
            log.warning("chat answer %s: another writer took it; this one stops", answer_id)
        elif meta is not None and meta.stopped:
            why = USER_STOPPED
        elif not watched:  # it lapses CHAT_RESUME_GRACE_S after a page last said so: none came back
            why = PAGE_CLOSED
        if (why or answer.overtaken) and answer.cancelled != answer.meta.request_id:
            answer.stopped_why = answer.stopped_why or why or USER_STOPPED
            answer.cancelled = answer.meta.request_id  # again if a takeover started another since
            await _cancel_current(answer)


async def _cancel_current(answer: Answer) -> None:
    with contextlib.suppress(ClusterUnavailable, *ERRORS):
        await generation.acancel(answer.meta.deployment_id, answer.meta.request_id)


async def _finish(answer: Answer, status: str, metrics: dict, error: str) -> None:
    """Save the end (and count the answer's tokens) if no one did; tell the pages; give up the lease.
    A writer whose lease another claimed meanwhile saves nothing: the answer is that writer's now."""
    answer_id, meta = answer.answer_id, answer.meta
    with contextlib.suppress(*ERRORS):  # Redis away: the guarded save still keeps it to one end
        held = await asyncio.to_thread(writing.renew, answer_id, answer.holder)
        if not held and not await asyncio.to_thread(writing.claim, answer_id, answer.holder):
            log.warning("chat answer %s: another writer took it before its end was saved", answer_id)
            return
    metrics = {**metrics, "generated_tokens": len(answer.token_ids)}  # every writer's, not the last one's
    if meta.resumed_at:
        metrics["taken_over_at"] = list(meta.resumed_at)
    usage = services.Usage(Caller(meta.user_id), meta.deployment, len(meta.prompt_ids), len(answer.token_ids))
    if error:
        served.record("chat", ok=False)
    # Keyword-argument call whose names line up with building/memory.py's MemoryPlan(...).
    await waiting_for_the_database(
        services.finish_answer,
        answer_id=answer_id,
        content=answer.text,
        status=status,
        metrics=metrics,
        error=error,
        usage=usage,
    )
    try:
        await tape.append_end(answer_id, await _end_from_database(answer_id))
    except tape.Overtaken:
        pass  # the end is on the tape already
    except ERRORS:
        log.exception("chat answer %s: its end could not be put on its tape", answer_id)
    with contextlib.suppress(*ERRORS):
        await asyncio.to_thread(writing.release, answer_id, answer.holder)


async def _end_from_database(answer_id: int) -> dict:
    """What the pages are told at the end: the answer as it was saved."""
    return await waiting_for_the_database(services.answer_end, answer_id=answer_id)


async def _still_streaming(answer_id: int) -> bool:
    return await waiting_for_the_database(services.is_streaming, answer_id=answer_id)
