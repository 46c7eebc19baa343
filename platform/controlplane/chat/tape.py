"""A chat answer as it is written, kept in Redis so that it outlives the web process writing it and
the socket showing it: the answer's tape.

The writer (``chat.writer``) appends each token of the answer as a piece (its id and the text it
adds; main's end as a piece of ``NO_TOKEN``, with the text of a last incomplete character if any)
and, at the end, what the page is told then (``protocol.done``, with an error if any). Every
page showing the answer reads the tape (``follow``), from wherever it left off: a page whose socket
closed (a network blip, a reload, a web worker's restart) asks again from its last piece and misses
nothing, and sees nothing twice; one that asks again after the end reads the pieces it missed
(``pieces``). A writer that took over from one that died reads the pieces so far and goes on from
there.

A Redis restart does not end an answer: Redis keeps the tape (appendonly, ``deploy/redis``), and the
writer waits for it to answer again, up to ``REDIS_WAIT_S``, before giving a piece up (``_add``).

Entries have explicit stream ids: piece ``i`` is ``0-(i+1)``, the end ``1-0``, so that each is
written once (Redis refuses an id not past the last: ``Overtaken``) and a reader resumes after a
known piece. Beside the tape, a hash (``meta``) holds what a writer needs to go on: the deployment,
the prompt's token ids, the token budget, the user, the generation running now and whether the
user stopped it. Both expire ``KEEP_S`` after they were last written, and ``ENDED_KEEP_S`` after
the end: a page that comes back later reads the answer from the database.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import redis
import redis.asyncio
from django.conf import settings

from controlplane.shared_redis import UNREACHABLE, client

T = TypeVar("T")

KEEP_S = 24 * 3600  # longer than any answer takes
ENDED_KEEP_S = 600  # a page reconnecting after the end still gets it from the tape
READ_BLOCK_MS = 2000  # a reader wakes at least this often (``follow`` yields ``Idle``)
END_ID = "1-0"  # after every piece's id
# A writer waits this long for Redis to answer again (a restart: connection refused, then loading its
# append-only file) before it gives a piece up; under the lease's lapse (``writing.LEASE_S``), so no
# other writer can have taken the answer meanwhile.
REDIS_WAIT_S = 5.0
NO_TOKEN = -1  # the token id of the piece that marks main's end (its text: an incomplete character's)


class Overtaken(RuntimeError):
    """A piece with this index (or the end) is on the tape already: another writer has the answer."""


@dataclass(frozen=True)
class Piece:
    index: int
    token_id: int
    text: str


@dataclass(frozen=True)
class End:
    message: dict  # what the page is told at the end (``protocol.done``, with ``error`` if it failed)


@dataclass(frozen=True)
class Idle:
    """Nothing new within ``READ_BLOCK_MS``: the reader may look around (is the writer alive?)."""


@dataclass(frozen=True)
class Meta:
    deployment_id: int
    deployment: str  # its name, which usage is counted under
    user_id: int
    prompt_ids: list[int]
    max_tokens: int
    request_id: str  # the generation writing the answer now
    stopped: bool = False
    resumed_at: tuple[int, ...] = ()  # the piece at which each writer that took the answer over began


def _tape(answer_id: int) -> str:
    return f"odmoe:chat:answer:{answer_id}:tape"


def _meta(answer_id: int) -> str:
    return f"odmoe:chat:answer:{answer_id}:meta"


# XADD with the entry's own id (refused when not past the last), then both keys kept KEEP_S more.
# The meta keeps when the last entry was added (Redis' clock, one for every web process): the
# seconds since then are returned, what a writer that took the answer over paused it for.
_ADD = """
redis.call('XADD', KEYS[1], ARGV[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 0 then return false end
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
local last = redis.call('HGET', KEYS[2], 'added_at')
redis.call('HSET', KEYS[2], 'added_at', string.format('%.3f', now))
if not last then return false end
return string.format('%.3f', now - tonumber(last))
"""

# Only an answer that has a meta is changed: a stop before ``start`` leaves no partial hash.
_STOP = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
return redis.call('HSET', KEYS[1], 'stopped', 1) + 1
"""
_CONTINUE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
return redis.call('HSET', KEYS[1], 'request_id', ARGV[1], 'resumed_at', ARGV[2]) + 1
"""

_async_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _aclient() -> redis.asyncio.Redis:
    """This event loop's connection to ``REDIS_URL`` (an asyncio connection belongs to one loop)."""
    loop = asyncio.get_running_loop()
    held = _async_clients.get(loop)
    if held is None or held[0] != settings.REDIS_URL:
        timeout = READ_BLOCK_MS / 1000 + 3  # a blocked read returns before its socket times out
        held = (settings.REDIS_URL, redis.asyncio.Redis.from_url(settings.REDIS_URL, socket_timeout=timeout))
        _async_clients[loop] = held
    return held[1]


async def _cancellable(call: Awaitable[T]) -> T:
    """``call``'s result, unless the task awaiting it was cancelled meanwhile: redis-py's asyncio client
    (6.4.0) can swallow that cancellation and return the reply (a writer cancelled mid-answer went on
    to its end), so it is raised here."""
    result = await call
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    return result


def _piece_id(index: int) -> str:
    return f"0-{index + 1}"


# ---- the writer's side ----------------------------------------------------------------------


def start(answer_id: int, meta: Meta) -> None:
    """A new answer: its meta written, its tape empty."""
    fields = {
        "deployment_id": meta.deployment_id,
        "deployment": meta.deployment,
        "user_id": meta.user_id,
        "prompt_ids": json.dumps(meta.prompt_ids),
        "max_tokens": meta.max_tokens,
        "request_id": meta.request_id,
        "stopped": int(meta.stopped),
    }
    with client().pipeline() as pipe:
        pipe.delete(_tape(answer_id), _meta(answer_id))  # an answer id used before (another database)
        pipe.hset(_meta(answer_id), mapping=fields)
        pipe.expire(_meta(answer_id), KEEP_S)
        pipe.execute()


def read_meta(answer_id: int) -> Meta | None:
    """The answer's meta (None: it has none, or it expired)."""
    raw = {k.decode(): v.decode() for k, v in client().hgetall(_meta(answer_id)).items()}
    if not raw.keys() >= {"deployment_id", "deployment", "user_id", "prompt_ids", "max_tokens", "request_id"}:
        return None  # none, or not whole: nothing a writer can go on from
    return Meta(
        deployment_id=int(raw["deployment_id"]),
        deployment=raw["deployment"],
        user_id=int(raw["user_id"]),
        prompt_ids=[int(i) for i in json.loads(raw["prompt_ids"])],
        max_tokens=int(raw["max_tokens"]),
        request_id=raw["request_id"],
        stopped=raw.get("stopped") == "1",
        resumed_at=tuple(json.loads(raw.get("resumed_at", "[]"))),
    )


def continue_with(answer_id: int, request_id: str, resumed_at: tuple[int, ...]) -> Meta | None:
    """A writer that took the answer over names the generation that writes it from now on, and where
    each takeover began; the meta read after (a stop from then on cancels that generation, one from
    before shows as ``stopped``). None: the answer has no meta, and nothing is written."""
    if not client().eval(_CONTINUE, 1, _meta(answer_id), request_id, json.dumps(list(resumed_at))):
        return None
    return read_meta(answer_id)


def mark_stopped(answer_id: int) -> bool:
    """The user stopped the answer: no writer goes on with it. False: it has no meta, nothing written."""
    return bool(client().eval(_STOP, 1, _meta(answer_id)))


def pieces(answer_id: int, after: int = 0) -> list[Piece]:
    """Every piece on the tape after the first ``after``, in order (the end left out)."""
    entries = client().xrange(_tape(answer_id), _piece_id(after), f"0-{2**63 - 1}")
    return [_piece(entry_id, fields) for entry_id, fields in entries]


def token_ids(pieces: list[Piece]) -> list[int]:
    """The answer's tokens, from its pieces."""
    return [piece.token_id for piece in pieces if piece.token_id != NO_TOKEN]


def ended(answer_id: int) -> dict | None:
    """What the page is told at the answer's end, if the tape has it."""
    entries = client().xrange(_tape(answer_id), END_ID, END_ID)
    return json.loads(entries[0][1][b"end"]) if entries else None


async def append(answer_id: int, piece: Piece) -> float | None:
    """Piece ``piece.index`` on the tape; ``Overtaken`` if another writer put one there. The seconds
    since the piece before it was added (None for the first)."""
    fields = {"id": piece.token_id, "t": piece.text}
    return await _add(answer_id, _piece_id(piece.index), fields, KEEP_S)


async def append_end(answer_id: int, message: dict) -> None:
    """The end of the answer on the tape; it and the meta are kept ``ENDED_KEEP_S`` more."""
    await _add(answer_id, END_ID, {"end": json.dumps(message)}, ENDED_KEEP_S)


async def _add(answer_id: int, entry_id: str, fields: dict, keep_s: int) -> float | None:
    """Add one entry, waiting out a Redis restart (``REDIS_WAIT_S``). A try whose reply was lost may
    have added it: an entry found in its place is this writer's when it holds the same fields."""
    args = [entry_id, keep_s, *[item for pair in fields.items() for item in pair]]
    deadline, delay, tried = time.monotonic() + REDIS_WAIT_S, 0.1, False
    while True:
        try:
            since = await _cancellable(_aclient().eval(_ADD, 2, _tape(answer_id), _meta(answer_id), *args))
            return float(since) if since is not None else None
        except redis.ResponseError as exc:
            if "equal or smaller" not in str(exc):
                raise
            if tried and await _holds(answer_id, entry_id, fields):
                return None  # added by the try whose reply the restart lost
            raise Overtaken(f"answer {answer_id}: entry {entry_id} is written already") from None
        except UNREACHABLE:
            if time.monotonic() + delay > deadline:
                raise
        tried = True
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


async def _holds(answer_id: int, entry_id: str, fields: dict) -> bool:
    """Whether the tape's entry ``entry_id`` holds ``fields``."""
    found = await _cancellable(_aclient().xrange(_tape(answer_id), entry_id, entry_id))
    wanted = {str(key).encode(): str(value).encode() for key, value in fields.items()}
    return bool(found) and found[0][1] == wanted


# ---- a reader's side ------------------------------------------------------------------------


async def follow(answer_id: int, after: int) -> AsyncIterator[Piece | End | Idle]:
    """The pieces after the first ``after``, as they come, then the end; ``Idle`` whenever nothing
    came for ``READ_BLOCK_MS``. Redis errors are raised (the caller tries again from where it was)."""
    last = _piece_id(after - 1) if after > 0 else "0-0"
    while True:
        found = await _cancellable(_aclient().xread({_tape(answer_id): last}, block=READ_BLOCK_MS, count=256))
        if not found:
            yield Idle()
            continue
        for entry_id, fields in found[0][1]:
            last = entry_id.decode()
            if last == END_ID:
                yield End(json.loads(fields[b"end"]))
                return
            yield _piece(entry_id, fields)


def _piece(entry_id: bytes, fields: dict) -> Piece:
    index = int(entry_id.decode().partition("-")[2]) - 1
    return Piece(index, int(fields[b"id"]), fields[b"t"].decode())
