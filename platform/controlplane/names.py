"""The one rule for names users give things (nodes, models): safe in URLs, files and logs."""

from rest_framework import serializers

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
NAME_RULE = "1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"


def name_field() -> serializers.RegexField:
    return serializers.RegexField(NAME_PATTERN, max_length=100, error_messages={"invalid": f"use {NAME_RULE}"})
