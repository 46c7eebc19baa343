"""A deployment's settings as DRF fields, derived from their one declaration (``inference.settings``).

Each serializer that takes a setting (create, suggest, estimate, change alignment) asks
``setting_field`` for it (creating a deployment takes every column of ``SETTINGS_COLUMNS``,
``ColumnSettingsInput``), so its default, its allowed values or range and its help text are
the declaration's and are never spelled again here. What only the control plane adds is
said where it is passed: a column's upper bound (``MAX_PERIOD``), or one user's bound below
main's queue (``max_per_user``).
"""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from inference.settings import info

from .models import MAX_PER_USER, SETTINGS_COLUMNS

MAX_PERIOD = 2**31 - 1  # the most the alignment periods' columns (PositiveIntegerField) hold on every database

# Bounds a setting has only on the control plane, by name.
_CONTROL_PLANE_BOUNDS: dict[str, dict[str, int]] = {
    "token_period": {"max_value": MAX_PERIOD},
    "kv_period": {"max_value": MAX_PERIOD},
    "max_per_user": {"max_value": MAX_PER_USER},
}


def setting_field(name: str, *, required: bool = False, **overrides: Any) -> serializers.Field:
    """The DRF field of the setting ``name``: the declaration's default (none if ``required``),
    choices or range, and its doc as help text; ``overrides`` are passed on as they are."""
    item = info(name)
    options: dict[str, Any] = {"help_text": item.doc}
    if not required:
        options["default"] = item.default
    if item.choices:
        field_class: type[serializers.Field] = serializers.ChoiceField
        allowed = ", ".join(item.choices) + (' or ""' if item.blank else "")
        # DRF's own message names no allowed value; this one names them all.
        message = f'"{{input}}" is not a valid {name}; allowed: {allowed}'
        options |= {"choices": item.choices, "allow_blank": item.blank, "error_messages": {"invalid_choice": message}}
    elif item.type is bool:
        field_class = serializers.BooleanField
    elif item.type is int:
        field_class = serializers.IntegerField
        options |= _bounds(item.minimum, item.maximum) | _CONTROL_PLANE_BOUNDS.get(name, {})
    elif item.type is float:
        field_class = serializers.FloatField
        options |= _bounds(item.minimum, item.maximum)
    else:
        field_class = serializers.CharField
    return field_class(**(options | overrides))


def _bounds(minimum: float | None, maximum: float | None) -> dict[str, float]:
    bounds = {}
    if minimum is not None:
        bounds["min_value"] = minimum
    if maximum is not None:
        bounds["max_value"] = maximum
    return bounds


# The base of an input that takes every setting a deployment keeps as a column, in the columns'
# order (DRF lists a base's fields before a subclass's own): a column added to
# ``SETTINGS_COLUMNS`` is taken here with no line more.
ColumnSettingsInput: type[serializers.Serializer] = type(
    "ColumnSettingsInput", (serializers.Serializer,), {name: setting_field(name) for name in SETTINGS_COLUMNS}
)
