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
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import torch

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
    TYPE = "ping"


@message
@dataclass(frozen=True, kw_only=True)
class Pong(Message):
    """Health answer. ``ready`` is true once the role can serve; ``detail`` says why not."""

    TYPE = "pong"
    role: str
    ready: bool
    detail: str = ""


@message
@dataclass(frozen=True, kw_only=True)
class Shutdown(Message):
    TYPE = "shutdown"


# --- client <-> main --------------------------------------------------------------------


@message
@dataclass(frozen=True, kw_only=True)
class GenerateRequest(Message):
    TYPE = "generate"
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


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
    TYPE = "error"
    request_id: str
    error: str


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
    """A new request starts: workers reset and prefetch their prefill experts."""

    TYPE = "begin"
    request_id: str
    prompt_len: int
    max_new_tokens: int


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
    for it, the one carrying its last rows.
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
    rows: torch.Tensor | None = None
    weights: torch.Tensor | None = None


@message
@dataclass(frozen=True, kw_only=True)
class End(Message):
    """The request is over: free everything and report statistics."""

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

_ENVELOPE = ("deployment", "sender", "seq")
_ELEMENT_SIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPES.values()}


@dataclass(frozen=True)
class _FieldSpec:
    name: str
    check: Checker
    required: bool
    tensor: bool


def encode(msg: Message, *, deployment: str | None = None, sender: str | None = None, seq: int | None = None) -> list:
    """Frames for ``msg``: the msgpack header, then one raw buffer per present tensor.

    ``deployment``, ``sender`` and ``seq``, when given, stamp the envelope instead of the
    message's own values (what a transport does on every send, without copying ``msg``).
    """
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": msg.TYPE}
    frames: list[Any] = []
    tensors: dict[str, Any] = {}
    for spec in _specs(type(msg)):
        value = getattr(msg, spec.name)
        if not spec.tensor:
            header[spec.name] = value
        elif value is not None:
            tensor = value.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            tensor = tensor.contiguous()
            if tensor.dtype not in _DTYPE_NAMES:
                raise ProtocolError(f"{msg.TYPE}.{spec.name}: dtype {tensor.dtype} cannot be sent")
            tensors[spec.name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)}
            # A uint8 view shares memory with the tensor: zmq sends it without a copy.
            frames.append(tensor.view(-1).view(torch.uint8).numpy() if tensor.numel() else b"")
    for name, value in zip(_ENVELOPE, (deployment, sender, seq), strict=True):
        if value is not None:
            header[name] = value
    header["tensors"] = tensors
    return [msgpack.packb(header, use_bin_type=True), *frames]


def decode(frames: list[Any]) -> Message:
    """Parse and validate ``frames``; raise ``ProtocolError`` if they are not a message."""
    if not frames:
        raise ProtocolError("empty message")
    try:
        header = msgpack.unpackb(_as_bytes(frames[0]), raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r:.40}, expected {PROTOCOL_VERSION}")
    type_name = header.get("t")
    cls = _REGISTRY.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r:.40}")
    described = header.get("tensors")
    if not isinstance(described, dict):
        raise ProtocolError(f"{cls.TYPE}: tensor descriptors missing")
    unknown = set(described) - set(cls.TENSORS)
    if unknown:
        raise ProtocolError(f"{cls.TYPE}: carries no tensor named {sorted(map(str, unknown))[0]!r:.40}")
    if len(frames) - 1 != len(described):
        raise ProtocolError(f"{cls.TYPE}: {len(described)} tensors described, {len(frames) - 1} frames sent")
    values: dict[str, Any] = {}
    frame_iter = iter(frames[1:])
    for spec in _specs(cls):
        if spec.tensor:
            if spec.name in described:
                values[spec.name] = _tensor(cls.TYPE, spec.name, described[spec.name], next(frame_iter))
            elif spec.required:
                raise ProtocolError(f"{cls.TYPE}: tensor {spec.name!r} missing")
            continue
        if spec.name not in header:
            if spec.required:
                raise ProtocolError(f"{cls.TYPE}: field {spec.name!r} missing")
            continue
        value = header[spec.name]
        if not spec.check(value):
            raise ProtocolError(f"{cls.TYPE}: field {spec.name!r} has a bad value {value!r:.80}")
        values[spec.name] = value
    return cls(**values)


def _tensor(type_name: str, name: str, desc: Any, frame: Any) -> torch.Tensor:
    if (
        not isinstance(desc, dict)
        or not isinstance(desc.get("dtype"), str)
        or desc["dtype"] not in _DTYPES
        or not isinstance(desc.get("shape"), list)
    ):
        raise ProtocolError(f"{type_name}.{name}: bad tensor descriptor {desc!r:.80}")
    dtype = _DTYPES[desc["dtype"]]
    shape = desc["shape"]
    if len(shape) > _MAX_DIMS or not all(type(d) is int and 0 <= d < _MAX_DIM for d in shape):
        raise ProtocolError(f"{type_name}.{name}: bad shape {shape!r:.80}")
    buffer = frame.buffer if hasattr(frame, "buffer") else frame
    numel = 1
    for d in shape:
        numel *= d
    if len(buffer) != numel * _ELEMENT_SIZE[dtype]:
        raise ProtocolError(f"{type_name}.{name}: {len(buffer)} bytes for shape {shape} {desc['dtype']}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # The frame's memory is read-only and owned by zmq; copy it so receivers may write.
    return torch.frombuffer(bytearray(buffer), dtype=dtype).reshape(shape)


def _as_bytes(frame: Any) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


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
__all__ += ["PROTOCOL_VERSION", "ProtocolError", "decode", "encode"]
