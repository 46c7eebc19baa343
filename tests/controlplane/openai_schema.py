"""OpenAI's published schemas for what the API answers, pinned, and a check against them.

``data/openai-schemas.json`` holds the response schemas of OpenAI's OpenAPI document (the
``openai/openai-openapi`` repository, MIT licensed; its commit is in the file's ``source``), cut to
the schemas that ``ROOTS`` name and every schema they refer to, so that the tests carry 0.3 MB
instead of 3 MB. ``conforms(name, obj)`` validates an answer against one root schema as OpenAPI
3.1 reads it (JSON Schema 2020-12), with the document's leftover ``nullable: true`` read as OpenAPI
3.0 meant it (``nullable_read``).

To pin another version of the document:

    python -m tests.controlplane.openai_schema path/to/openapi.json COMMIT
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

PINNED = Path(__file__).parent / "data" / "openai-schemas.json"
REPOSITORY = "https://github.com/openai/openai-openapi"
# What this API answers, by OpenAI's names: each response body, each streamed chunk, each error.
ROOTS = (
    "ListModelsResponse",
    "Model",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ErrorResponse",
    "Response",
    "ResponseStreamEvent",
)
URI = "urn:openai-openapi"


def _refs(node: object):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def cut(document: dict, roots: tuple[str, ...] = ROOTS) -> dict[str, object]:
    """``roots`` and every schema they refer to, from an OpenAPI document's components."""
    schemas = document["components"]["schemas"]
    kept: dict[str, object] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in kept:
            continue
        kept[name] = schemas[name]
        prefix = "#/components/schemas/"
        for ref in _refs(schemas[name]):
            if not ref.startswith(prefix):
                raise ValueError(f"{name} refers outside the components' schemas: {ref}")
            todo.append(ref.removeprefix(prefix))
    return dict(sorted(kept.items()))


def nullable_read(node: object) -> object:
    """The schemas with OpenAPI 3.0's ``nullable: true``, which the 3.1 document still uses in places
    and JSON Schema ignores, read as it means: null is allowed as well."""
    if isinstance(node, list):
        return [nullable_read(value) for value in node]
    if not isinstance(node, dict):
        return node
    read = {key: nullable_read(value) for key, value in node.items() if key != "nullable"}
    if node.get("nullable") is True:
        return {"anyOf": [read, {"type": "null"}]}
    return read


@cache
def _validators() -> dict[str, jsonschema.protocols.Validator]:
    pinned = json.loads(PINNED.read_text())
    document = {"components": {"schemas": nullable_read(pinned["schemas"])}}
    registry = Registry().with_resource(URI, Resource.from_contents(document, default_specification=DRAFT202012))
    return {
        name: jsonschema.Draft202012Validator({"$ref": f"{URI}#/components/schemas/{name}"}, registry=registry)
        for name in ROOTS
    }


def problems(name: str, obj: object) -> list[str]:
    """Where ``obj`` departs from OpenAI's schema ``name`` (none: it conforms); of a union (``anyOf``,
    ``oneOf``) that nothing matched, the branch that came closest, as jsonschema judges it."""
    return [line for error in _validators()[name].iter_errors(obj) for line in _explained(error)]


def _explained(error: jsonschema.ValidationError) -> list[str]:
    """An error, or for a union the errors of its branch whose ``type`` matched (the fewest first)."""
    if not error.context:
        return [f"{'/'.join(str(p) for p in error.absolute_path) or '(top)'}: {error.message[:300]}"]
    branches: dict[object, list[jsonschema.ValidationError]] = {}
    for inner in error.context:
        branches.setdefault(inner.schema_path[0], []).append(inner)

    def mismatch(errors: list[jsonschema.ValidationError]) -> tuple[bool, int]:
        on_type = any(list(e.relative_path) == ["type"] or e.validator == "type" for e in errors)
        return on_type, len(errors)

    closest = min(branches.values(), key=mismatch)
    return [line for inner in closest for line in _explained(inner)]


def conforms(name: str, obj: object) -> None:
    """Fail, saying where, unless ``obj`` keeps to OpenAI's schema ``name``."""
    found = problems(name, obj)
    assert not found, f"{name}: " + "; ".join(found)


def main(argv: list[str]) -> None:
    source, commit = Path(argv[0]), argv[1]
    pinned = {
        "source": {
            "repository": REPOSITORY,
            "commit": commit,
            "path": "openapi.json",
            "license": "MIT (Copyright (c) OpenAI)",
        },
        "schemas": cut(json.loads(source.read_text())),
    }
    PINNED.write_text(json.dumps(pinned, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
