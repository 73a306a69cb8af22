"""Structured outputs: constrain generated text to a JSON schema, a regex, a choice or a grammar.

This module is the request side: :class:`StructuredOutputs` (in vLLM's
``SamplingParams``) and its checks, made where a request enters: exactly one
of ``json`` (a schema, as a dict or JSON text), ``json_object`` (any JSON
object), ``regex``, ``choice`` (one of a list of strings), ``grammar`` (Lark,
llguidance's dialect, or GBNF, llama.cpp's and vLLM's) or ``structural_tag``
(vLLM's object: JSON schemas between begin and end tags inside free text).
JSON takes vLLM's whitespace options (``disable_any_whitespace``,
``whitespace_pattern``) and ``disable_additional_properties``.

The compiler is a plugin of the ``grammar`` kind
(:mod:`pitstop.plugin_system.grammar`: a backend makes one matcher per
constrained sample and fills each step's allowed-token bitmask), picked by
``EngineConfig.grammar``; ``llguidance`` is shipped
(``pitstop.plugins.grammars.llguidance``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from pitstop.errors import fail_request as _fail

_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

GRAMMAR_SYNTAXES = ("auto", "lark", "gbnf")
"""The values of ``StructuredOutputs.grammar_syntax`` (auto: told apart by the rule heads)."""

# A GBNF rule head is ``name ::=``; a Lark one is ``name:`` (``?name:``, ``NAME.2:``,
# ``name[lazy]:``) or a ``%llguidance`` / ``%import`` directive.
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z][A-Za-z0-9_-]*\s*::=")
_LARK_RULE = re.compile(
    r"(?m)^\s*(%llguidance\b|%import\b|[?!]?[A-Za-z_][A-Za-z0-9_]*(\.-?[0-9]+)?(\[[^\]]*\])?\s*:(?!:))"
)


@attrs.frozen(kw_only=True)
class StructuredOutputs:
    """A constraint on the generated text; set exactly one field.

    ``json``: a JSON schema (dict, or its JSON text); ``json_object``: True
    for any JSON object; ``regex``: a regular expression the whole output
    matches; ``choice``: the output is exactly one of these strings;
    ``grammar``: a grammar in Lark (llguidance's dialect, ``start: ...``) or
    GBNF (``root ::= ...``), told apart by its rule heads unless
    ``grammar_syntax`` says ``"lark"`` or ``"gbnf"``; ``structural_tag``:
    vLLM's ``{"type": "structural_tag", "structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`` (a dict or its JSON text): free text in
    which each trigger opens a JSON value of that schema closed by ``end``.

    JSON whitespace (``json`` and ``json_object`` only): by default the
    separators ``json.dumps`` writes (``", "``, ``": "``);
    ``whitespace_flexible`` allows any JSON whitespace, ``whitespace_pattern``
    (a regex) the whitespace it matches, ``disable_any_whitespace`` none at
    all (``","``, ``":"``). ``disable_additional_properties`` adds
    ``"additionalProperties": false`` to every object schema that does not
    say. ``disable_fallback`` is accepted for vLLM code (pitstop never falls
    back to another backend).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = attrs.field(
        default=None, converter=lambda v: tuple(v) if isinstance(v, list) else v
    )
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    grammar_syntax: str = "auto"
    whitespace_flexible: bool = False
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> StructuredOutputs:
        # attrs' __init__ would refuse an unknown keyword with a bare TypeError
        _check_field_names(kwargs)
        return super().__new__(cls)

    def __attrs_post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            _fail(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar, structural_tag; got {', '.join(given) or 'none'}"
            )
        for flag in (
            "json_object",
            "whitespace_flexible",
            "disable_any_whitespace",
            "disable_additional_properties",
            "disable_fallback",
        ):
            if not isinstance(getattr(self, flag), bool):
                _fail(f"structured_outputs.{flag} must be true or false")
        self._check_json_options()
        if self.grammar_syntax not in GRAMMAR_SYNTAXES:
            _fail(
                f"structured_outputs.grammar_syntax must be one of {', '.join(GRAMMAR_SYNTAXES)}, "
                f"got {self.grammar_syntax!r}"
            )
        if self.grammar_syntax != "auto" and self.grammar is None:
            _fail("structured_outputs.grammar_syntax applies to a grammar; set grammar too")
        if self.structural_tag is not None:
            structural_tag_of(self.structural_tag)  # refuses a malformed one here
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    _fail(f"structured_outputs.json is not valid JSON: {exc}")
            if not isinstance(schema, dict | bool):
                _fail(
                    "structured_outputs.json must be a JSON schema (an object), got "
                    f"{type(schema).__name__}"
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, tuple)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                _fail("structured_outputs.choice must be a non-empty list of non-empty strings")

    def _check_json_options(self) -> None:
        json_options = [
            name
            for name in (
                "whitespace_flexible",
                "disable_any_whitespace",
                "disable_additional_properties",
            )
            if getattr(self, name)
        ] + (["whitespace_pattern"] if self.whitespace_pattern is not None else [])
        if json_options and self.json is None and not self.json_object:
            _fail(
                f"structured_outputs.{json_options[0]} applies to JSON output only (json or "
                f"json_object), not to {self.kind}; remove it"
            )
        whitespace = [n for n in json_options if n != "disable_additional_properties"]
        if len(whitespace) > 1:
            _fail(
                f"structured_outputs.{whitespace[0]} and {whitespace[1]} both set the JSON "
                "whitespace; give one of them"
            )
        pattern = self.whitespace_pattern
        if pattern is not None:
            if not isinstance(pattern, str) or not pattern:
                _fail("structured_outputs.whitespace_pattern must be a non-empty regex string")
            try:
                re.compile(pattern)
            except re.error as exc:
                _fail(f"structured_outputs.whitespace_pattern is not a valid regex: {exc}")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice, grammar or structural_tag."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        """A string that is equal for equal constraints (the compile cache's key)."""
        value: Any = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag") and isinstance(value, str):
            value = json.loads(value)
        options = [
            self.whitespace_flexible,
            self.whitespace_pattern,
            self.disable_any_whitespace,
            self.disable_additional_properties,
            self.grammar_syntax,
        ]
        return json.dumps([self.kind, value, options], sort_keys=True, ensure_ascii=False)

    def json_schema(self) -> Any:
        """The schema a ``json`` or ``json_object`` constraint compiles: ``json`` (parsed from
        its text) or ``{"type": "object"}``, closed by ``disable_additional_properties``."""
        schema: Any = {"type": "object"} if self.json_object else self.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        return closed_objects(schema) if self.disable_additional_properties else schema

    def syntax(self) -> str:
        """The syntax ``grammar`` is written in: ``grammar_syntax``, or (``"auto"``) the one
        its rule heads say (:func:`detect_grammar_syntax`)."""
        assert self.grammar is not None
        if self.grammar_syntax != "auto":
            return self.grammar_syntax
        return detect_grammar_syntax(self.grammar)


def detect_grammar_syntax(grammar: str) -> str:
    """``"gbnf"`` when ``grammar``'s rules are written ``name ::= ...``, else ``"lark"``."""
    if _GBNF_RULE.search(grammar) and not _LARK_RULE.search(grammar):
        return "gbnf"
    return "lark"


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that lacks it."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def structural_tag_of(value: Any) -> list[tuple[str, str, Any, str]]:
    """vLLM's structural tag as ``(trigger, begin, schema, end)`` per structure, or a clear error.

    The accepted form is ``{"type": "structural_tag", "structures": [{"begin":
    str, "schema": object, "end": str}, ...], "triggers": [str, ...]}`` (its
    JSON text too); each ``begin`` must start with one of the triggers.
    """
    where = "structured_outputs.structural_tag"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            _fail(f"{where} is not valid JSON: {exc}")
    if not isinstance(value, dict):
        _fail(f"{where} must be an object (or its JSON text), got {type(value).__name__}")
    if "format" in value:
        _fail(
            f"{where} in xgrammar's newer form (a 'format' object) is not supported; send "
            "{'type': 'structural_tag', 'structures': [{'begin', 'schema', 'end'}], 'triggers': [...]}"
        )
    unknown = sorted(set(value) - {"type", "structures", "triggers"})
    if unknown or value.get("type", "structural_tag") != "structural_tag":
        _fail(
            f"{where} takes type 'structural_tag', structures and triggers; got "
            f"{unknown or [value.get('type')]}"
        )
    structures, triggers = value.get("structures"), value.get("triggers")
    if (
        not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) and t for t in triggers)
    ):
        _fail(f"{where}.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        _fail(f"{where}.structures must be a non-empty list of {{begin, schema, end}} objects")
    out = []
    for i, item in enumerate(structures):
        if not isinstance(item, dict) or set(item) != {"begin", "schema", "end"}:
            _fail(f"{where}.structures[{i}] must be an object with exactly begin, schema and end")
        begin, schema, end = item["begin"], item["schema"], item["end"]
        if not isinstance(begin, str) or not isinstance(end, str):
            _fail(f"{where}.structures[{i}].begin and end must be strings")
        if not isinstance(schema, dict | bool):
            _fail(f"{where}.structures[{i}].schema must be a JSON schema (an object)")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            _fail(f"{where}.structures[{i}].begin {begin!r} starts with none of the triggers")
        out.append((trigger, begin, schema, end))
    return out


def _check_field_names(values: dict[str, Any]) -> None:
    unknown = sorted(set(values) - {f.name for f in attrs.fields(StructuredOutputs)})
    if unknown:
        _fail(
            f"structured_outputs has no field {unknown[0]!r}; use one of "
            "json, json_object, regex, choice, grammar, structural_tag (and "
            "grammar_syntax, whitespace_flexible, whitespace_pattern, "
            "disable_any_whitespace, disable_additional_properties, disable_fallback)"
        )


def structured_outputs_of(value: Any) -> StructuredOutputs | None:
    """``SamplingParams.structured_outputs`` from a :class:`StructuredOutputs`, a dict or None."""
    if value is None or isinstance(value, StructuredOutputs):
        return value
    if isinstance(value, dict):
        _check_field_names(value)
        return StructuredOutputs(**value)
    _fail(
        "structured_outputs must be a StructuredOutputs or a dict such as {'json': schema}, got "
        f"{type(value).__name__}"
    )
    return None  # unreachable
