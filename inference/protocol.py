"""Every message the runtime's processes exchange over ZeroMQ, and how it is framed.

A message travels as ``[header, *tensor_frames]``: the header is msgpack (type, deployment
id, sender, sequence number, the message's plain fields and a dtype/shape descriptor per
tensor), and each tensor follows as its own raw frame so that big hidden states and KV
blocks are never copied into the header, and nothing is ever pickled.

Messages are frozen dataclasses declared once here; ``decode`` validates the header
against the declared field types and raises ``ProtocolError`` on anything malformed, so a
receiver can log and drop it.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import torch
import zmq

from inference.generation_fields import GenerationFields
from inference.typecheck import Checker, checker, is_optional

PROTOCOL_VERSION = 1

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_DIMS = 8
_MAX_DIM = 2**40  # far beyond any real tensor; rejects shapes whose size would overflow


class ProtocolError(ValueError):
    """A frame sequence that is not a valid message of this protocol."""


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of every message: who sent it, for which deployment, in which order."""

    TYPE: ClassVar[str] = ""
    TENSORS: ClassVar[tuple[str, ...]] = ()

    deployment: str = ""
    sender: str = ""
    seq: int = 0
    # Emulated links only: when the receiver may hand the message on (time.monotonic seconds,
    # system-wide on Linux); 0 = at once. Stamped per hop by the sending transport.
    deliver_at: float = 0.0


_REGISTRY: dict[str, type[Message]] = {}


def message(cls: type[Message]) -> type[Message]:
    """Register a message class under its ``TYPE``."""
    assert cls.TYPE and cls.TYPE not in _REGISTRY, cls
    _REGISTRY[cls.TYPE] = cls
    return cls


# --- lifecycle and health -------------------------------------------------------------


@message
@dataclass(frozen=True, kw_only=True)
class Ping(Message):
    """Health question. ``nonce``, the asker's number for it, comes back in the Pong."""

    TYPE = "ping"
    nonce: int = 0


@message
@dataclass(frozen=True, kw_only=True)
class Pong(Message):
    """Health answer. ``ready`` is true once the role can serve; ``detail`` says why not.

    The role's memory, measured when it answers: ``host_bytes`` and ``peak_host_bytes`` its
    process's resident set now and at its highest, ``device_bytes`` what it holds on its GPU
    (0 on a CPU). ``nonce`` is the Ping's: an asker tells its answer from those to earlier pings.
    """

    TYPE = "pong"
    role: str
    ready: bool
    detail: str = ""
    host_bytes: int = 0
    peak_host_bytes: int = 0
    device_bytes: int = 0
    nonce: int = 0


@message
@dataclass(frozen=True, kw_only=True)
class Shutdown(Message):
    TYPE = "shutdown"


# --- client <-> main --------------------------------------------------------------------


@message
@dataclass(frozen=True, kw_only=True)
class GenerateRequest(Message, GenerationFields):
    """A client asks main for a generation (its fields: ``inference.generation_fields``)."""

    TYPE = "generate"
    request_id: str


@message
@dataclass(frozen=True, kw_only=True)
class TokenEvent(Message):
    """A generated token, with what the step that made it did per layer (``metrics.step_report``)."""

    TYPE = "token"
    request_id: str
    index: int
    token_id: int
    step: dict | None = None


@message
@dataclass(frozen=True, kw_only=True)
class GenerateDone(Message):
    TYPE = "done"
    request_id: str
    token_ids: list[int]
    finish_reason: str
    metrics: dict


@message
@dataclass(frozen=True, kw_only=True)
class GenerateError(Message):
    """A generation main did not run or could not finish; ``busy``: its batch and queue were full;
    ``too_many_generations``: its user already had the most generations one user may have in main."""

    TYPE = "error"
    request_id: str
    error: str
    busy: bool = False
    too_many_generations: bool = False


@message
@dataclass(frozen=True, kw_only=True)
class Cancel(Message):
    TYPE = "cancel"
    request_id: str


@message
@dataclass(frozen=True, kw_only=True)
class SetAlignment(Message):
    """Change the shadow's alignment periods; applies from the next decode step on.

    A period of 0 means never align. Sent by a client to main, and by main to the shadow
    with ``from_step`` filled in.
    """

    TYPE = "set_alignment"
    token_period: int
    kv_period: int
    from_step: int = 0


# --- main -> workers / shadow -------------------------------------------------------------


@message
@dataclass(frozen=True, kw_only=True)
class Begin(Message):
    """A session starts (the first of a batch of sequences): workers reset and prefetch their prefill experts."""

    TYPE = "begin"
    request_id: str
    prompt_len: int
    max_new_tokens: int


@message
@dataclass(frozen=True, kw_only=True)
class SequenceJoin(Message):
    """A sequence joins the batch of session ``request_id``: its prefill is session step ``first_step``.

    Main runs several sequences in lockstep, one step each per session step, so the shadow's
    prediction for the sequence's step ``s`` is one for session step ``first_step + s``.
    """

    TYPE = "sequence_join"
    request_id: str
    sequence: str
    first_step: int


@message
@dataclass(frozen=True, kw_only=True)
class SequenceLeave(Message):
    """A sequence left the batch of session ``request_id``: session step ``last_step`` ran its
    last token. The session goes on with the others (its end is ``End``)."""

    TYPE = "sequence_leave"
    request_id: str
    sequence: str
    last_step: int


@message
@dataclass(frozen=True, kw_only=True)
class ShadowBegin(Message):
    """The shadow starts emulating a request: it prefills the prompt on its own."""

    TYPE = "shadow_begin"
    TENSORS = ("prompt_ids",)
    request_id: str
    max_new_tokens: int
    token_period: int
    kv_period: int
    prompt_ids: torch.Tensor


@message
@dataclass(frozen=True, kw_only=True)
class Align(Message):
    """Main's state at the start of decode step ``step``.

    Always carries main's progress; carries main's input token for the step when tokens
    are aligned at this step, and main's KV cache for positions ``[kv_from, kv_to)`` of
    every layer (``keys``/``values`` shaped [L, B, kvH, P, D]) when KV is aligned.
    """

    TYPE = "align"
    TENSORS = ("keys", "values")
    request_id: str
    step: int
    token: int | None = None
    kv_from: int = 0
    kv_to: int = 0
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None


@message
@dataclass(frozen=True, kw_only=True)
class ExpertRequest(Message):
    """Compute these experts for (step, layer); an empty list releases any prefetch.

    ``rows`` holds, segment after segment, hidden-state rows routed to ``experts[i]``:
    ``counts[i]`` rows starting at row ``offsets[i]`` of that expert's rows, and
    ``weights`` their routing weights. A long prefill arrives as several such requests
    (mini-batches); the worker keeps an expert on the device until a ``final`` request
    for it, the one carrying its last rows. ``previous_step_s`` is how long the session's
    previous step took as main timed it (0 for its first): every worker of a layer group hears
    the same periods, and finds its hybrid share from them (``inference.hybrid``).
    """

    TYPE = "expert_request"
    TENSORS = ("rows", "weights")
    request_id: str
    step: int
    layer: int
    experts: list[int]
    counts: list[int]
    offsets: list[int]
    final: bool = True
    previous_step_s: float = 0.0
    rows: torch.Tensor | None = None
    weights: torch.Tensor | None = None


@message
@dataclass(frozen=True, kw_only=True)
class End(Message):
    """The session (workers) or the sequence (shadow) is over: free everything and report statistics."""

    TYPE = "end"
    request_id: str


# --- workers / shadow -> main -------------------------------------------------------------


@message
@dataclass(frozen=True, kw_only=True)
class ExpertResult(Message):
    """Weighted expert outputs for the request's segments, in the order of its rows."""

    TYPE = "expert_result"
    TENSORS = ("output",)
    request_id: str
    step: int
    layer: int
    experts: list[int]
    counts: list[int]
    offsets: list[int]
    output: torch.Tensor
    wait_ms: float  # time spent waiting for experts to reach the device
    compute_ms: float  # time spent computing the experts
    hits: int
    misses: int
    # The worker's time from taking the request out of its inbox (decoded) to building this
    # answer: its wait and compute plus its own Python around them. Main's wait for the answer
    # less this is the hops (framing, encryption, ZeroMQ, wake-ups, an emulated link).
    handled_ms: float = 0.0
    # Of the hops, the worker's time with the request before that: from its frames off the
    # socket (or its emulated delivery; or its previous answer, if later) to taking it out of its
    # inbox, its decoding and whatever else the worker handled first. Optional like
    # ``handled_ms``: an older worker's counts as 0.
    received_ms: float = 0.0


@message
@dataclass(frozen=True, kw_only=True)
class WorkerStats(Message):
    TYPE = "worker_stats"
    request_id: str
    worker: int
    expert_bytes: int
    peak_decode_bytes: int
    peak_prefill_bytes: int
    loads: int
    hits: int
    misses: int
    wasted_loads: int
    load_ms: float
    # A "hot" expert store (inference.hotset): experts read from disk, and served from RAM.
    disk_reads: int = 0
    hot_hits: int = 0
    cpu_experts: int = 0  # hybrid execution: experts computed on the worker's CPU, not copied


@message
@dataclass(frozen=True, kw_only=True)
class Prediction(Message):
    """The shadow's routing for (step, layer): the experts main will most likely pick."""

    TYPE = "prediction"
    request_id: str
    step: int
    layer: int
    experts: list[int]
    version: int = 0


@message
@dataclass(frozen=True, kw_only=True)
class ShadowStats(Message):
    TYPE = "shadow_stats"
    request_id: str
    steps_done: int
    rewinds: int
    token_aligns: int
    kv_aligns: int
    speculations: int = 0  # steps run ahead of main on the shadow's own guess of main's token
    speculation_misses: int = 0  # ... of which the guess was wrong and the step was redone


# --- framing ----------------------------------------------------------------------------------
#
# Every message of a decode step passes here four times (main encodes a request, the worker
# decodes it, encodes its result, main decodes that), so each message class is compiled once
# into a ``_Plan``: which fields go into the header, which travel as frames, and a validator
# per field. Encoding and decoding then only loop over those tuples; no per-message reflection.

_ELEMENT_SIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPES.values()}
_EMPTY = b""
_FLOAT64 = 0xCB  # msgpack's float 64 marker
_BE_DOUBLE = struct.Struct(">d")


@dataclass(frozen=True)
class _FieldSpec:
    name: str
    check: Checker
    required: bool
    tensor: bool


@dataclass(frozen=True)
class _Plan:
    """A message class compiled for framing."""

    cls: type[Message]
    plain: tuple[str, ...]  # header fields, declaration order
    checks: tuple[tuple[str, Checker, bool], ...]  # (name, validator, required) per header field
    tensors: tuple[tuple[str, bool], ...]  # (name, required) per tensor field, declaration order
    tensor_names: frozenset[str]
    defaults: dict[str, Any]  # what an absent optional field is
    plain_init: bool  # True: build instances without running the generated __init__


_PLANS: dict[type[Message], _Plan] = {}


def encode(
    msg: Message,
    *,
    deployment: str | None = None,
    sender: str | None = None,
    seq: int | None = None,
    deliver_at: float | None = None,
) -> list:
    """Frames for ``msg``: the msgpack header, then one raw buffer per present tensor.

    ``deployment``, ``sender`` and ``seq``, when given, stamp the envelope instead of the
    message's own values (what a transport does on every send, without copying ``msg``).
    ``deliver_at`` is stamped only when given (an emulated link), as the header's last entry
    so that ``restamp_delivery`` can change it in place. Tensor frames share memory with the
    tensors (zmq copies small ones, sends big ones as they are).
    """
    plan = _PLANS.get(type(msg)) or _plan(type(msg))
    values = msg.__dict__
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": msg.TYPE}
    for name in plan.plain:
        header[name] = values[name]
    if deployment is not None:
        header["deployment"] = deployment
    if sender is not None:
        header["sender"] = sender
    if seq is not None:
        header["seq"] = seq
    tensors: dict[str, Any] = {}
    header["tensors"] = tensors
    frames: list[Any] = [b""]
    for name, _ in plan.tensors:
        value = values[name]
        if value is not None:
            descriptor, frame = _tensor_frame(msg.TYPE, name, value)
            tensors[name] = descriptor
            frames.append(frame)
    if deliver_at is not None:
        header["deliver_at"] = float(deliver_at)
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def restamp_delivery(header: bytes, deliver_at: float) -> bytes:
    """``header`` (from ``encode`` with a ``deliver_at``) with another delivery time, same size.

    msgpack writes a float as 0xcb and 8 big-endian bytes, and ``encode`` writes the stamp
    last, so the stamp is the header's last 8 bytes.
    """
    if len(header) < 9 or header[-9] != _FLOAT64:
        raise ValueError("the header carries no delivery stamp at its end")
    return header[:-8] + _BE_DOUBLE.pack(deliver_at)


def decode(frames: list[Any]) -> Message:
    """Parse and validate ``frames``; raise ``ProtocolError`` if they are not a message."""
    if not frames:
        raise ProtocolError("empty message")
    try:
        header = msgpack.unpackb(_as_bytes(frames[0]), raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not msgpack: {exc}") from None
    if type(header) is not dict:
        raise ProtocolError("header is not a map")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r:.40}, expected {PROTOCOL_VERSION}")
    type_name = header.get("t")
    cls = _REGISTRY.get(type_name) if type(type_name) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r:.40}")
    plan = _PLANS.get(cls) or _plan(cls)
    described = header.get("tensors")
    if type(described) is not dict:
        raise ProtocolError(f"{cls.TYPE}: tensor descriptors missing")
    for name in described:
        if name not in plan.tensor_names:
            raise ProtocolError(f"{cls.TYPE}: carries no tensor named {str(name)!r:.40}")
    if len(frames) - 1 != len(described):
        raise ProtocolError(f"{cls.TYPE}: {len(described)} tensors described, {len(frames) - 1} frames sent")
    values = dict(plan.defaults)
    for name, check, required in plan.checks:
        if name in header:
            value = header[name]
            if not check(value):
                raise ProtocolError(f"{cls.TYPE}: field {name!r} has a bad value {value!r:.80}")
            values[name] = value
        elif required:
            raise ProtocolError(f"{cls.TYPE}: field {name!r} missing")
    index = 1
    for name, required in plan.tensors:
        if name in described:
            values[name] = _tensor(cls.TYPE, name, described[name], frames[index])
            index += 1
        elif required:
            raise ProtocolError(f"{cls.TYPE}: tensor {name!r} missing")
    if not plan.plain_init:
        return cls(**values)
    # Every field was validated and defaulted above: fill the frozen instance directly,
    # which is what its generated __init__ would do, one setattr per field, only slower.
    msg = object.__new__(cls)
    msg.__dict__.update(values)
    return msg


def _tensor_frame(type_name: str, name: str, tensor: torch.Tensor) -> tuple[dict[str, Any], Any]:
    """(descriptor, frame) for one tensor; the frame shares the tensor's memory when it can."""
    dtype_name = _DTYPE_NAMES.get(tensor.dtype)
    if dtype_name is None:
        raise ProtocolError(f"{type_name}.{name}: dtype {tensor.dtype} cannot be sent")
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    descriptor = {"dtype": dtype_name, "shape": list(tensor.shape)}
    if not tensor.numel():
        return descriptor, _EMPTY
    if tensor.dtype is torch.bfloat16:  # numpy has no bfloat16; the bytes are what matter
        tensor = tensor.view(torch.int16)
    # A flat byte view: zmq sees its true length, and sends big tensors without a copy.
    return descriptor, memoryview(tensor.numpy()).cast("B")


def _tensor(type_name: str, name: str, desc: Any, frame: Any) -> torch.Tensor:
    dtype_name = desc.get("dtype") if type(desc) is dict else None
    dtype = _DTYPES.get(dtype_name) if type(dtype_name) is str else None
    shape = desc.get("shape") if dtype is not None else None
    if type(shape) is not list:
        raise ProtocolError(f"{type_name}.{name}: bad tensor descriptor {desc!r:.80}")
    numel = 1
    for d in shape:
        if type(d) is not int or not 0 <= d < _MAX_DIM:
            raise ProtocolError(f"{type_name}.{name}: bad shape {shape!r:.80}")
        numel *= d
    if len(shape) > _MAX_DIMS:
        raise ProtocolError(f"{type_name}.{name}: bad shape {shape!r:.80}")
    buffer = frame.buffer if type(frame) is zmq.Frame else memoryview(frame)
    if buffer.nbytes != numel * _ELEMENT_SIZE[dtype]:
        raise ProtocolError(f"{type_name}.{name}: {buffer.nbytes} bytes for shape {shape} {dtype_name}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # The frame's memory is read-only and owned by zmq; copy it so receivers may write.
    return torch.frombuffer(bytearray(buffer), dtype=dtype).view(shape)


def _as_bytes(frame: Any) -> bytes:
    if type(frame) is bytes:
        return frame
    return frame.bytes if type(frame) is zmq.Frame else bytes(frame)


def _plan(cls: type[Message]) -> _Plan:
    """Compile ``cls`` once: each field's validator from its type hints, its default, its role."""
    specs = _specs(cls)
    fields = dataclasses.fields(cls)
    plan = _Plan(
        cls=cls,
        # The delivery stamp is per hop: only a transport that emulates a link writes it.
        plain=tuple(s.name for s in specs if not s.tensor and s.name != "deliver_at"),
        checks=tuple((s.name, s.check, s.required) for s in specs if not s.tensor),
        tensors=tuple((s.name, s.required) for s in specs if s.tensor),
        tensor_names=frozenset(s.name for s in specs if s.tensor),
        defaults={f.name: f.default for f in fields if f.default is not dataclasses.MISSING},
        plain_init=all(f.default_factory is dataclasses.MISSING for f in fields) and not hasattr(cls, "__post_init__"),
    )
    _PLANS[cls] = plan
    return plan


@functools.cache
def _specs(cls: type[Message]) -> tuple[_FieldSpec, ...]:
    """Each field's validator, compiled once per message class from its type hints."""
    hints = typing.get_type_hints(cls, globalns={**globals(), "torch": torch})
    specs = []
    for f in dataclasses.fields(cls):
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        tensor = f.name in cls.TENSORS
        required = not is_optional(hints[f.name]) if tensor else not has_default
        specs.append(_FieldSpec(f.name, checker(hints[f.name]), required, tensor))
    return tuple(specs)


__all__ = [name for name, obj in list(globals().items()) if isinstance(obj, type) and issubclass(obj, Message)]
__all__ += ["PROTOCOL_VERSION", "ProtocolError", "decode", "encode", "restamp_delivery"]
