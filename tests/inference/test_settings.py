"""The settings declaration (``inference.settings``) is what validation checks, field by field."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from inference.settings import DEFAULTS, INFO, SpecError, validate_settings
from tests.paths import REPO


def out_of_bounds(name: str) -> object | None:
    """A value of the setting's type that its declared choices or range refuse; None if it has neither."""
    item = INFO[name]
    if item.choices:
        return "no-such-" + name
    if item.minimum is not None:
        below = item.minimum if item.exclusive else item.minimum - 1
        return float(below) if item.type is not int else int(below)
    return None


BOUNDED = [name for name in INFO if out_of_bounds(name) is not None]


def test_the_defaults_are_valid_settings() -> None:
    assert validate_settings(DEFAULTS) is DEFAULTS


@pytest.mark.parametrize("name", BOUNDED)
def test_a_value_outside_what_a_setting_declares_is_refused_by_name(name: str) -> None:
    with pytest.raises(SpecError, match=name):
        validate_settings(dataclasses.replace(DEFAULTS, **{name: out_of_bounds(name)}))


def test_a_range_with_a_maximum_refuses_past_it() -> None:
    for name, item in INFO.items():
        if item.maximum is not None:
            with pytest.raises(SpecError, match=f"{name} must be from"):
                validate_settings(dataclasses.replace(DEFAULTS, **{name: item.type(item.maximum + 1)}))


def test_the_declaration_imports_no_torch() -> None:
    code = "import sys, inference.settings; print('torch' in sys.modules, 'transformers' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]


@pytest.mark.parametrize(
    ("strategy", "predictor"), [("odmoe", "next-gate"), ("reactive", ""), ("full-cache", ""), ("importance", "")]
)
def test_drafts_are_refused_where_no_shadow_drafts_or_the_strategy_is_not_exact(strategy: str, predictor: str) -> None:
    settings = dataclasses.replace(DEFAULTS, draft_tokens=4, strategy=strategy, predictor=predictor)
    with pytest.raises(SpecError, match="draft_tokens needs the shadow predictor"):
        validate_settings(settings)


def test_drafts_are_taken_under_odmoe_with_its_shadow() -> None:
    assert validate_settings(dataclasses.replace(DEFAULTS, draft_tokens=4)).draft_tokens == 4


def test_a_settings_help_names_no_file_and_the_module_it_names_exists() -> None:
    """A setting's doc is the API's and the admin's help text (a model column's help text is in its
    migrations): it names no module, so moving one changes no help text; ``code`` names it instead."""
    for item in INFO.values():
        assert not re.search(r"\.py\b|\b(inference|controlplane|benchmarks)\.\w", item.doc), item.name
        if item.code:
            module = REPO / item.code.replace(".", "/")
            assert module.with_suffix(".py").is_file() or (module / "__init__.py").is_file(), (item.name, item.code)
