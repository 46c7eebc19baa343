"""A deployment's settings as command-line options, derived from their one declaration
(``inference.settings``), as ``controlplane.deployments.fields`` derives the API's fields.

``add_setting_flags`` gives a parser one option per setting named: ``--max-batch`` for
``max_batch``, its default, its choices and its doc as help are the declaration's; a boolean is a
switch that turns its default over (``--hybrid``, ``--no-speculate``). The values are checked
together by ``validate_settings`` once parsed, as a spec file's are.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Iterable

from inference.settings import info

# Options kept under the name they had before they were derived.
ALIASES = {"timeout_s": ("--timeout",)}


def flag_of(name: str) -> str:
    """The option of setting ``name``: ``--max-batch``; a boolean true by default, ``--no-speculate``."""
    item = info(name)
    dashed = name.replace("_", "-")
    return f"--no-{dashed}" if item.type is bool and item.default else f"--{dashed}"


def add_setting_flags(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """One option per setting of ``names``, each parsed into ``args.<name>``."""
    for name in names:
        item = info(name)
        helped = item.doc.replace("%", "%%")  # argparse formats help with %
        flags = (flag_of(name), *ALIASES.get(name, ()))
        if item.type is bool:
            action = "store_false" if item.default else "store_true"
            parser.add_argument(*flags, dest=name, action=action, help=helped)
            continue
        options: dict = {"dest": name, "default": item.default, "help": f"{helped} (default: {item.default!r})"}
        if item.choices:
            options["choices"] = (*item.choices, "") if item.blank else item.choices
        elif item.type in (int, float):
            options["type"] = item.type
        elif item.nullable:  # ``float | None``: the option parses as the arm that is not None
            (arm,) = (t for t in typing.get_args(item.type) if t is not type(None))
            options["type"] = arm
        parser.add_argument(*flags, **options)


def settings_of(args: argparse.Namespace, names: Iterable[str]) -> dict:
    """The settings ``add_setting_flags`` parsed, by name."""
    return {name: getattr(args, name) for name in names}
