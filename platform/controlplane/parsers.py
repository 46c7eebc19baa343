"""The REST API's JSON parser: DRF's, with a body nested deeper than Python's JSON parser goes
a 400 like any other malformed body (DRF's own catches only ValueError: the RecursionError was a 500)."""

from __future__ import annotations

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class JSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - nested too deeply") from None
