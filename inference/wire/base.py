"""The two bases of every wire message, and the marker for a tensor field.

``WireStruct`` is what every message is: frozen, keyword-only, strict about unknown fields,
tagged. ``Message`` adds the envelope that the runtime's transport stamps on every ZeroMQ
send (deployment, sender, sequence number, emulated delivery time); a message that crosses
ZeroMQ derives from it.
"""

from __future__ import annotations

import abc
from typing import ClassVar, TypeVar

import msgspec


class Tensor(abc.ABC):  # noqa: B024 - a marker, not an interface
    """Marks a field that holds a ``torch.Tensor``; declared here without importing torch.

    ``inference.runtime.protocol`` registers ``torch.Tensor`` as a virtual subclass, so a decoded
    message's tensor field is validated as a tensor, and sends its bytes as a raw frame
    after the header (the header carries only its dtype and shape).
    """


class WireStruct(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag_field="type",
):
    """A message: its ``type`` tag names its class on the wire.

    ``TYPE`` is the tag the runtime's ZeroMQ header carries (``"t"``); it is the msgspec tag
    (the agent link's ``"type"``) unless a class declares both, as the generation events do,
    whose names on the two transports predate their merging.
    """

    TYPE: ClassVar[str] = ""
    TAG: ClassVar[str] = ""  # the msgspec tag: what the agent link's "type" says
    TENSORS: ClassVar[tuple[str, ...]] = ()  # the fields that hold tensors, in declaration order

    def to_json(self) -> dict:
        """The message as a JSON-ready object, ``{"type": tag, ...fields}``."""
        return msgspec.to_builtins(self)


class Message(WireStruct, kw_only=True):
    """Base of every message that crosses ZeroMQ: who sent it, for which deployment, in which order."""

    deployment: str = ""
    sender: str = ""
    seq: int = 0
    # Emulated links only: when the receiver may hand the message on (time.monotonic seconds,
    # system-wide on Linux); 0 = at once. Stamped per hop by the sending transport.
    deliver_at: float = 0.0


def own_fields(cls: type[Message]) -> tuple[str, ...]:
    """The fields ``cls`` declares beyond ``Message``'s envelope, in declaration order."""
    return tuple(name for name in cls.__struct_fields__ if name not in Message.__struct_fields__)


M = TypeVar("M", bound=type[WireStruct])


def declared(*classes: M) -> tuple[M, ...]:
    """``classes``, each given its ``TAG`` and its ``TYPE``: its tag, unless the class declares a
    ``TYPE`` of its own."""
    for cls in classes:
        cls.TAG = cls.__struct_config__.tag
        if "TYPE" not in cls.__dict__:
            cls.TYPE = cls.__struct_config__.tag
    return classes
