"""How the runtime's messages (``inference.wire.runtime``) travel over ZeroMQ: the codec.

A message travels as ``[header, *tensor_frames]``: the header is msgpack (``v`` the protocol
version, ``t`` the message's ``TYPE``, the message's plain fields, the envelope, and a
dtype/shape descriptor per tensor under ``tensors``), and each tensor follows as its own raw
frame so that big hidden states and KV blocks are never copied into the header, and nothing
is ever pickled. Emulated links stamp ``deliver_at`` last, so that ``restamp_delivery`` can
change it in place.

The messages are declared once, torch-free, in ``inference.wire``; this module is the torch
side of them: ``decode`` checks the envelope and the tensors (dtype, shape within ``_MAX_DIMS``
and ``_MAX_DIM``, bytes against the shape), then lets msgspec's strict conversion validate
every field against its declaration, and raises ``ProtocolError`` on anything malformed, so
that a receiver can log and drop it.

Why this way: msgspec builds and checks a message in C (one ``convert`` per message, and one
``encode`` per header), where the hand-written plans this replaced looped over the fields in
Python.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec
import torch
import zmq

from inference.wire.base import Message, Tensor
from inference.wire.runtime import RUNTIME_MESSAGES

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

# A field declared ``Tensor`` holds a torch.Tensor: what msgspec checks a decoded one against.
Tensor.register(torch.Tensor)

_REGISTRY: dict[str, type[Message]] = {cls.TYPE: cls for cls in RUNTIME_MESSAGES}
assert len(_REGISTRY) == len(RUNTIME_MESSAGES), "two runtime messages share a TYPE"


class ProtocolError(ValueError):
    """A frame sequence that is not a valid message of this protocol."""


@dataclass(frozen=True)
class _Plan:
    """A message class compiled for framing."""

    fields: frozenset[str]  # every field's name, tensors included
    tensors: tuple[tuple[str, bool], ...]  # (name, required) per tensor field, declaration order
    tensor_names: frozenset[str]


def _plan(cls: type[Message]) -> _Plan:
    fields = msgspec.structs.fields(cls)
    tensors = tuple((f.name, f.required) for f in fields if f.name in cls.TENSORS)
    assert len(tensors) == len(cls.TENSORS), f"{cls.__name__}.TENSORS names a field it has not"
    return _Plan(frozenset(f.name for f in fields), tensors, frozenset(cls.TENSORS))


_PLANS: dict[type[Message], _Plan] = {cls: _plan(cls) for cls in RUNTIME_MESSAGES}
_EMPTY = b""
_FLOAT64 = 0xCB  # msgpack's float 64 marker
_BE_DOUBLE = struct.Struct(">d")
_ELEMENT_SIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPES.values()}
_pack = msgspec.msgpack.Encoder().encode


def _no_extensions(code: int, data: bytes) -> None:
    raise ValueError(f"msgpack extension type {code} is not part of this protocol")


def _unpack(header: bytes) -> Any:
    """The header's msgpack, as plain values: maps keyed by text only (at every depth, as
    ``msgpack``'s ``strict_map_key`` has it, which msgspec's decoder has not), no extension types
    (timestamps read as seconds), so that whatever decodes also encodes, and as JSON too."""
    return msgpack.unpackb(header, raw=False, ext_hook=_no_extensions, timestamp=1)


_asdict = msgspec.structs.asdict


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
    cls = type(msg)
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": cls.TYPE}
    header.update(_asdict(msg))
    # The delivery stamp is per hop: only a transport that emulates a link writes it.
    del header["deliver_at"]
    if deployment is not None:
        header["deployment"] = deployment
    if sender is not None:
        header["sender"] = sender
    if seq is not None:
        header["seq"] = seq
    tensors: dict[str, Any] = {}
    frames: list[Any] = [_EMPTY]
    for name in cls.TENSORS:
        value = header.pop(name)
        if value is not None:
            descriptor, frame = _tensor_frame(cls.TYPE, name, value)
            tensors[name] = descriptor
            frames.append(frame)
    header["tensors"] = tensors
    if deliver_at is not None:
        header["deliver_at"] = float(deliver_at)
    frames[0] = _pack(header)
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
        header = _unpack(_as_bytes(frames[0]))
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not msgpack: {exc}") from None
    if type(header) is not dict:
        raise ProtocolError("header is not a map")
    version = header.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r:.40}, expected {PROTOCOL_VERSION}")
    type_name = header.pop("t", None)
    cls = _REGISTRY.get(type_name) if type(type_name) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r:.40}")
    plan = _PLANS[cls]
    described = header.pop("tensors", None)
    if type(described) is not dict:
        raise ProtocolError(f"{cls.TYPE}: tensor descriptors missing")
    for name in described:
        if name not in plan.tensor_names:
            raise ProtocolError(f"{cls.TYPE}: carries no tensor named {str(name)!r:.40}")
    if len(frames) - 1 != len(described):
        raise ProtocolError(f"{cls.TYPE}: {len(described)} tensors described, {len(frames) - 1} frames sent")
    # Tensors travel only as frames: a tensor field in the header itself is not one.
    for name in plan.tensor_names & header.keys():
        del header[name]
    index = 1
    for name, required in plan.tensors:
        if name in described:
            header[name] = _tensor(cls.TYPE, name, described[name], frames[index])
            index += 1
        elif required:
            raise ProtocolError(f"{cls.TYPE}: tensor {name!r} missing")
    # A newer peer's fields (and the link's "type" tag) are not this message's: read past them.
    for name in header.keys() - plan.fields:
        del header[name]
    try:
        return msgspec.convert(header, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(_explain(cls, header, exc)) from None


_MISSING = re.compile(r"Object missing required field `(\w+)`")
_AT = re.compile(r"at `\$\.(\w+)")


def _explain(cls: type[Message], header: dict, exc: msgspec.ValidationError) -> str:
    """msgspec's reason, said as the rest of this module says it: which field, and its value."""
    reason = str(exc)
    if missing := _MISSING.match(reason):
        return f"{cls.TYPE}: field {missing[1]!r} missing"
    if at := _AT.search(reason):
        name = at[1]
        return f"{cls.TYPE}: field {name!r} has a bad value {header.get(name)!r:.80} ({reason})"
    return f"{cls.TYPE}: {reason}"


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


__all__ = ["PROTOCOL_VERSION", "ProtocolError", "decode", "encode", "restamp_delivery"]
