"""Fast predicates for values decoded from JSON, built once from type hints.

The deployment's specs (``inference.runtime.spec``) declare their fields with plain hints (``int``, ``str | None``,
``list[int]``...); ``checker(hint)`` turns a hint into a predicate that says whether a
decoded value has that type (``bool`` is not an ``int`` here, an ``int`` is a ``float``).
Nested dataclasses are not covered: they are checked on their own.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any

Checker = Callable[[Any], bool]


def checker(hint: Any) -> Checker:
    if isinstance(hint, types.UnionType):
        arms = [checker(arm) for arm in hint.__args__]
        return lambda v: any(arm(v) for arm in arms)
    if hint is type(None):
        return lambda v: v is None
    if hint is bool:
        return lambda v: v is True or v is False
    if hint is int:
        return lambda v: type(v) is int
    if hint is float:
        return lambda v: type(v) is float or type(v) is int
    if hint is str:
        return lambda v: type(v) is str
    if hint is dict or typing.get_origin(hint) is dict:
        return lambda v: type(v) is dict
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if item is int:
            return lambda v: type(v) is list and all(type(x) is int for x in v)
        check_item = checker(item)
        return lambda v: type(v) is list and all(check_item(x) for x in v)
    return lambda v: False
