"""pydantic's validation errors in pitstop's words: one message style for every bad value.

pydantic says ``Input should be a valid integer``; the engine's own checks
say ``max_tokens must be an integer in [1, ...], got ...``. A request body
that fails the strict models of :mod:`pitstop.server.protocol` is answered
in the second style: the field's path, what it must be, what it was.

>>> validation_message([{"type": "int_type", "loc": ("max_tokens",), "input": 1.5}])
('max_tokens', 'max_tokens must be an integer, got a number 1.5')
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# pydantic's error type -> what the value must be
_EXPECTED = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "none_required": "null",
}

# the member tags pydantic puts in the location of a union's errors -> their words
_UNION_MEMBERS = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "list[str]": "a list of strings",
    "list[int]": "a list of token ids (integers)",
    "list[list[int]]": "a list of lists of token ids",
    "list[ContentPart]": "a list of content parts",
    "dict[str,any]": "an object",
}


def json_kind(value: Any) -> str:
    """The JSON type of a parsed value, with its article (``a bool``, ``an object``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _shown(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _path(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _field_loc(errors: Sequence[dict[str, Any]]) -> tuple[Any, ...]:
    """The location the errors share: a union's errors part at the member tags."""
    locs = [tuple(e.get("loc", ())) for e in errors]
    common = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(common), len(loc)) and common[n] == loc[n]:
            n += 1
        common = common[:n]
    return common


def validation_message(errors: Sequence[dict[str, Any]]) -> tuple[str | None, str]:
    """``(param, message)`` for pydantic's ``errors()`` of one request body.

    ``param`` is the top-level field (OpenAI's ``param``); the message names
    the whole path (``messages[0].role``), what the value must be and what it
    was. Only the first field that failed is described.
    """
    if not errors:
        return None, "the request body is invalid"
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    # A union fails once per member; describe the field, not each member.
    group = [e for e in errors if tuple(e.get("loc", ()))[:1] == loc[:1]]
    field = _field_loc(group) if len(group) > 1 else loc
    members = [
        str(tuple(e["loc"])[len(field)])
        for e in group
        if len(e.get("loc", ())) > len(field) and isinstance(e["loc"][len(field)], str)
    ]
    if not members:  # not a union: the first error's own place
        field = loc
    name = _path(field) or "the body"
    param = str(field[0]) if field else None
    kind = first.get("type", "")
    ctx = first.get("ctx") or {}
    value = first.get("input")
    got = f"got {json_kind(value)} {_shown(value)}" if value is not None else "got null"
    if members:
        expected = " or ".join(dict.fromkeys(_UNION_MEMBERS.get(m, m) for m in members))
        return param, f"{name} must be {expected}, {got}"
    if kind == "missing":
        return param, f"{name} is required"
    if kind == "extra_forbidden":
        return param, f"{name} is not a field pitstop knows"
    if kind == "literal_error":
        return param, f"{name} must be one of {ctx.get('expected', '?')}, {got}"
    if kind == "too_short":
        return param, f"{name} must hold at least {ctx.get('min_length')} item(s), got none"
    if kind == "too_long":
        return param, f"{name} must hold at most {ctx.get('max_length')} item(s)"
    if kind in _EXPECTED:
        return param, f"{name} must be {_EXPECTED[kind]}, {got}"
    # Anything else: pydantic's own words, after the field's name.
    return param, f"{name} is invalid ({first.get('msg', kind)}), {got}"
