"""Text and JSON as every database the control plane runs on keeps them.

PostgreSQL refuses a NUL character in a text column ("PostgreSQL text fields cannot contain
NUL (0x00) bytes") and ``\\u0000`` anywhere in a jsonb value, keys included ("unsupported
Unicode escape sequence"); SQLite keeps both, so a write that works on a laptop failed in
production. Neither database takes a lone surrogate, which has no UTF-8 form.

What reaches a column without passing an API's validation goes through ``storable_text`` or
``storable_json`` first: an agent's reports (a task's or a role's detail, a role's metrics,
unknown inventory entries), the runtime's error text, and a model's generated text (a
byte-level tokenizer has a token for byte 0). Each such character becomes U+FFFD, the
replacement character, as a decoder shows a byte it cannot read; everything else is kept.
Input that an API or a socket validates is refused instead (``chat.protocol``, DRF's fields).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
_SURROGATES = range(0xD800, 0xE000)


def storable_text(text: str) -> str:
    """``text`` with each NUL and lone surrogate replaced by U+FFFD."""
    if "\x00" in text:
        text = text.replace("\x00", REPLACEMENT)
    try:
        text.encode()
    except UnicodeEncodeError:
        text = "".join(REPLACEMENT if ord(c) in _SURROGATES else c for c in text)
    return text


def storable_json(value: Any) -> Any:
    """``value`` (decoded JSON) with ``storable_text`` applied to every string in it, keys too."""
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable_json(k): storable_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable_json(v) for v in value]
    return value
