"""HTTP byte ranges (RFC 9110 §14): what part of a shard file a resuming agent asks for."""

from __future__ import annotations

import re

_SINGLE_RANGE = re.compile(r"^bytes=([0-9]*)-([0-9]*)$")
# A position past any file: what a number of more than 19 digits stands for (int() refuses one of 4300).
BEYOND = 2**63


class RangeNotSatisfiable(ValueError):
    """The Range header asks for bytes the file does not have (HTTP 416)."""


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The inclusive (first, last) byte of a ``Range`` header, or None for the whole file.

    Only single ranges are served (all an agent resuming a download needs); a multi-range
    or malformed header is ignored, as RFC 9110 allows, and the whole file is sent.
    """
    if not header:
        return None
    match = _SINGLE_RANGE.match(header.strip())
    if match is None:
        return None
    first, last = match.groups()
    if not first and not last:
        return None
    if not first:  # "bytes=-N": the last N bytes
        length = _number(last)
        if length == 0:
            raise RangeNotSatisfiable("an empty suffix range")
        return max(0, size - length), size - 1
    start = _number(first)
    end = min(_number(last), size - 1) if last else size - 1
    if start >= size or end < start:
        raise RangeNotSatisfiable(f"bytes {start}-{last} of a {size}-byte file")
    return start, end


def _number(digits: str) -> int:
    """A byte position of the header; ``BEYOND`` for one with more digits than any file size has."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 19 else BEYOND
