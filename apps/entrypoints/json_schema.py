"""A structural check of a JSON schema (a tool's ``parameters``), with no dependency.

A request's tool ``parameters`` must be a JSON schema whatever its
``tool_choice``: the chat template shows it to the model, ``"required"`` and a
named function compile it into a grammar, and a client that sent
``{"type": "objekt"}`` wants to hear so at once (OpenAI answers 400 too).
:func:`check_schema` walks the schema once (an explicit stack: linear in its
size, no recursion limit) and checks the keywords whose shape JSON Schema
(2020-12, and draft 7's ``definitions``) fixes; keywords it does not know pass,
as JSON Schema allows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pitstop.errors import fail_request as _fail

TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = (
    "additionalProperties",
    "items",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRINGS = ("title", "description", "pattern", "format", "$ref", "$id", "$schema")


def check_schema(schema: Any, where: str) -> None:
    """Refuse (naming the path) a ``schema`` that is not a JSON schema: not an object or a
    bool, an unknown ``type``, ``properties`` that is not an object of schemas, ``required``
    that is not a list of strings, and so on for the keywords listed above."""
    stack: list[tuple[Any, str]] = [(schema, where)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, bool):
            continue  # true: anything, false: nothing
        if not isinstance(node, dict):
            _fail(f"{path} must be a JSON schema (an object), got {_kind(node)}")
        _check_keywords(node, path)
        stack.extend(_children(node, path))


def _shown(value: Any, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters (an error never repeats a long input)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _kind(value: Any) -> str:
    return "a bool" if isinstance(value, bool) else type(value).__name__


def _check_keywords(node: dict[str, Any], path: str) -> None:
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not kinds and kind is not None or any(k not in TYPES for k in kinds):
        _fail(
            f"{path}.type must be one of {', '.join(TYPES)} (or a list of them), got {_shown(kind)}"
        )
    required = node.get("required")
    if required is not None and (
        not isinstance(required, list) or not all(isinstance(r, str) for r in required)
    ):
        _fail(f"{path}.required must be a list of property names (strings)")
    if "enum" in node and not isinstance(node["enum"], list):
        _fail(f"{path}.enum must be a list of values")
    for key in _COUNTS:
        value = node.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            _fail(f"{path}.{key} must be an integer >= 0, got {_shown(value)}")
    for key in _NUMBERS:
        value = node.get(key)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            _fail(f"{path}.{key} must be a number, got {_shown(value)}")
    for key in _STRINGS:
        if key in node and not isinstance(node[key], str):
            _fail(f"{path}.{key} must be a string")


def _children(node: dict[str, Any], path: str) -> Iterator[tuple[Any, str]]:
    """The sub-schemas of ``node`` with their paths; a keyword of the wrong shape is refused."""
    for key in _SCHEMA_MAPS:
        if key in node:
            value = node[key]
            if not isinstance(value, dict):
                _fail(f"{path}.{key} must be an object of named schemas")
            yield from ((sub, f"{path}.{key}.{name}") for name, sub in value.items())
    for key in _SCHEMA_LISTS:
        if key in node:
            value = node[key]
            if not isinstance(value, list) or (key != "prefixItems" and not value):
                _fail(f"{path}.{key} must be a non-empty list of schemas")
            yield from ((sub, f"{path}.{key}[{i}]") for i, sub in enumerate(value))
    for key in _SCHEMAS:
        if key in node:
            value = node[key]
            if key == "items" and isinstance(value, list):  # draft 7's tuple form
                yield from ((sub, f"{path}.items[{i}]") for i, sub in enumerate(value))
            else:
                yield value, f"{path}.{key}"
