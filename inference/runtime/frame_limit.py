"""The biggest frame a deployment's roles can legitimately send each other, from the model's sizes.

Every role's sockets refuse anything bigger (ZeroMQ's ``MAXMSGSIZE``: the peer is disconnected
before the frame is read into memory), so a peer cannot make a role allocate without bound. The
largest honest frames are a whole prompt's hidden-state rows (``ExpertRequest.rows``,
``ExpertResult.output``) and main's KV cache for every layer and position (``Align``: the first
alignment after a long prompt), at four bytes an element (the widest dtype a frame carries),
and the msgpack header, which holds at most a prompt's worth of small integers, or, on a
first ``Token`` that carries them, the prompt's logprobs (``MAX_TOP_LOGPROBS`` alternatives a
token at most).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from inference.wire.generation import MAX_TOP_LOGPROBS

WIDEST_ELEMENT_BYTES = 4  # float32 / int32; token ids (int64) are counted on their own below
HEADER_BYTES_PER_TOKEN = 9 * 4  # msgpack int64 is 9 bytes; experts, counts and offsets per row at most
# A prompt token's logprobs: its id and logprob, and the most alternatives (id, logprob) a
# request may ask for: msgpack ids are at most 9 bytes, floats 9, each array header 1 to 5.
LOGPROB_HEADER_BYTES_PER_TOKEN = (MAX_TOP_LOGPROBS + 1) * (9 + 9 + 1) + 2 * 5
SLACK_BYTES = 1 << 20  # the header's fixed fields, descriptors and names


def max_frame_bytes(config: Mapping) -> int:
    """The frame limit for a model with this ``config.json``."""
    tokens = int(config.get("max_position_embeddings", 4096))
    hidden = int(config["hidden_size"])
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    rows = tokens * hidden * WIDEST_ELEMENT_BYTES
    kv = layers * kv_heads * tokens * head_dim * WIDEST_ELEMENT_BYTES
    token_ids = tokens * 8
    header = tokens * max(HEADER_BYTES_PER_TOKEN, LOGPROB_HEADER_BYTES_PER_TOKEN)
    return max(rows, kv, token_ids, header) + SLACK_BYTES


def max_frame_bytes_of(shard_dir: str | Path) -> int | None:
    """The limit for the model whose ``config.json`` is in ``shard_dir``; None when there is none."""
    path = Path(shard_dir) / "config.json"
    if not path.is_file():
        return None
    return max_frame_bytes(json.loads(path.read_text()))
