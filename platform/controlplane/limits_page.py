"""docs/limits.md, rendered from its template and the declarations of the limits it lists.

    python -m controlplane.limits_page            # write docs/limits.md
    python -m controlplane.limits_page --check    # fail while docs/limits.md is not what it renders

The template (``limits_page.md`` beside this module) holds the page's prose and its tables;
every limit's value in it is a directive, replaced by the value its declaration holds, so
that no value is typed twice:

- ``{{ bounds }}``: the table of request bounds (``controlplane.serving.bounds.markdown_table``);
- ``{{ grammar_limits }}``: the table of the limits a grammar is compiled and decoded under
  (``inference.wire.grammar.GRAMMAR_LIMITS``);
- ``{{ value: MODULE:NAME | FORMAT }}``: a declared value, e.g.
  ``controlplane.nodes.inventory:MAX_GPUS`` or ``controlplane.serving.bounds:JOB_PROMPTS.limit``
  (after the colon, attributes or mapping keys, dotted);
- ``{{ setting: NAME | FORMAT }}``: a setting of ``config/settings/base.py`` as a server started
  without any ``ODMOE_*`` variable has it (its default), e.g. ``MAX_REQUEST_BYTES`` or
  ``REST_FRAMEWORK.DEFAULT_THROTTLE_RATES.user``.

``FORMAT`` is ``,`` (thousands separated: 20,000) or ``size`` (bytes in KiB or MiB where whole:
16 MiB); without one, the value as Python writes it. A new row of a table is a new line of the
template, its values directives. ``tests/controlplane/test_bounds.py`` fails while the page is
stale.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import runpy
import sys
from pathlib import Path

from controlplane.serving.bounds import markdown_table
from inference.wire.grammar import GRAMMAR_LIMITS

TEMPLATE = Path(__file__).with_name("limits_page.md")
PAGE = Path(__file__).resolve().parents[2] / "docs" / "limits.md"
SETTINGS_FILE = Path(__file__).with_name("config") / "settings" / "base.py"
ENVIRONMENT_PREFIX = "ODMOE_"
HEADER = (
    "<!-- Rendered from platform/controlplane/limits_page.md by `python -m controlplane.limits_page`: "
    "edit the template, not this page. -->\n"
)
DIRECTIVE = re.compile(r"\{\{\s*(\w+)\s*(?::\s*([^|}]+?))?\s*(?:\|\s*([^}]+?))?\s*\}\}")


class RenderError(ValueError):
    """A directive of the template that names nothing, or a format that does not exist."""


def server_defaults() -> dict[str, object]:
    """``config/settings/base.py``'s settings as a server started without any ``ODMOE_*`` variable has them."""
    hidden = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith(ENVIRONMENT_PREFIX)}
    try:
        return runpy.run_path(str(SETTINGS_FILE))
    finally:
        os.environ.update(hidden)


def render(template: str | None = None) -> str:
    """The page: the template with every directive replaced."""
    text = TEMPLATE.read_text() if template is None else template
    settings: dict[str, object] = {}

    def replace(match: re.Match[str]) -> str:
        kind, target, spec = match.group(1), match.group(2), match.group(3)
        if kind == "bounds" and target is None:
            return markdown_table().rstrip("\n")
        if kind == "grammar_limits" and target is None:
            return grammar_table()
        if kind == "value" and target and ":" in target:
            module, _, path = target.partition(":")
            return formatted(_lookup(importlib.import_module(module), path, match.group(0)), spec)
        if kind == "setting" and target:
            if not settings:
                settings.update(server_defaults())
            return formatted(_lookup(settings, target, match.group(0)), spec)
        raise RenderError(f"{match.group(0)}: not a directive of this template (see controlplane.limits_page)")

    return HEADER + DIRECTIVE.sub(replace, text)


def grammar_table() -> str:
    """The grammar limits: llguidance's name for each, its value here, when it is met, and why."""
    rows = ["| limit (llguidance's) | at most | met | why |", "|---|---|---|---|"]
    for limit in GRAMMAR_LIMITS:
        met = "at the compile" if limit.checked == "compile" else "at each token"
        why = limit.why.replace("|", "\\|")
        rows.append(f"| `{limit.name}` | {limit.value:,} {limit.unit} | {met} | {why} |")
    return "\n".join(rows)


def _lookup(root: object, path: str, directive: str) -> object:
    value = root
    for name in path.split("."):
        try:
            value = value[name] if isinstance(value, dict) else getattr(value, name)
        except (KeyError, AttributeError):
            raise RenderError(f"{directive}: no {name!r} in {path}") from None
    return value


def formatted(value: object, spec: str | None) -> str:
    """A value as the page writes it (``FORMAT`` above)."""
    if spec is None:
        return str(value)
    if spec == "," and isinstance(value, int):
        return f"{value:,}"
    if spec == "size" and isinstance(value, int):
        for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
            if value >= size and value % size == 0:
                return f"{value // size} {unit}"
        return f"{value:,} bytes"
    raise RenderError(f"no format {spec!r} for {value!r}: ',' or 'size' for an integer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; fail while the page is stale")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if PAGE.read_text() != page:
            print(f"{PAGE} is stale: run python -m controlplane.limits_page", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
