"""What the agent sends up its link fits the frame the control plane takes.

The control plane closes the link (1009) on a frame past its cap (``ODMOE_MAX_REQUEST_BYTES``,
16 MiB by default), which it announces in its answer to the handshake
(``inference.wire.link.SERVER_FRAME_LIMIT_HEADER``), and every generation on the link would fail
with it. Most events are small; those that grow with a request are a generation's: the first
token carries the prompt's logprobs where a request asked for them (about 180 bytes a prompt
token: a long-context model's whole prompt passes 16 MiB), and the result carries the per-step
metrics (at most ``MAX_METRICS_BYTES``, which a lowered cap may still be under). So an event
whose frame would not fit is replaced, here, by what fits (``fit``): a result with fewer of its
steps' metrics, or else the generation's ``Failed(too_large)`` naming both sizes; any other event
is left out, with a log line. The link and every other generation on it go on.
"""

from __future__ import annotations

import json

import msgspec

from agent.generations import bounded_metrics
from inference.wire.base import WireStruct
from inference.wire.generation import Done, Failed, Token
from inference.wire.link import frame_bytes

MAX_ERROR_CHARS = 1000  # a failure's reason, where even it would not fit


def encode(message: WireStruct) -> str:
    """The text frame ``message`` goes up the link as."""
    return json.dumps(message.to_json())


def fit(message: WireStruct, limit: int) -> WireStruct | None:
    """``message`` if its frame holds at most ``limit`` bytes; else what goes instead: a result
    with its per-step metrics cut to fit, a generation's ``Failed(too_large)`` where that cannot
    fit (or for a token), a failure with a shorter reason; None (nothing) for any other event."""
    size = frame_bytes(encode(message))
    if size <= limit:
        return message
    if isinstance(message, Done):
        bare = frame_bytes(encode(msgspec.structs.replace(message, metrics={})))
        cut = msgspec.structs.replace(message, metrics=bounded_metrics(message.metrics, limit - bare))
        if frame_bytes(encode(cut)) <= limit:
            return cut
    if isinstance(message, Token | Done):
        error = (
            f"the generation's {message.TAG} event takes {size} bytes on the link, more than the {limit} bytes "
            "the control plane takes in one frame: ask for less (a shorter prompt with echo and logprobs)"
        )
        return Failed(request_id=message.request_id, error=error, too_large=True)
    if isinstance(message, Failed) and len(message.error) > MAX_ERROR_CHARS:
        return msgspec.structs.replace(message, error=message.error[:MAX_ERROR_CHARS])
    return None
