"""Structured outputs: constrain generated text to a JSON schema, a regex, a choice or a grammar.

pitstop uses `llguidance <https://github.com/guidance-ai/llguidance>`_ (a
maintained Rust library with CPU wheels on PyPI and no Python dependencies
beyond numpy/torch, which pitstop has anyway): it computes the mask of
allowed next tokens from a grammar over the model's tokenizer in tens of
microseconds, fills it for a whole batch at once on its own threads
(:func:`llguidance.torch.fill_next_token_bitmask_par`), and can roll its
state back. It is imported lazily: a request that asks for structured
outputs without it installed gets an :class:`InvalidRequestError` that says
``pip install 'pitstop[structured]'``.

The pieces:

- :class:`StructuredOutputs`, the request side (in ``SamplingParams``):
  exactly one of ``json`` (a schema, as a dict or JSON text),
  ``json_object`` (any JSON object), ``regex``, ``choice`` (one of a list of
  strings), ``grammar`` (Lark, llguidance's dialect, or GBNF, llama.cpp's
  and vLLM's: converted by llguidance's own converter) or
  ``structural_tag`` (vLLM's object: JSON schemas between begin and end tags
  inside free text). JSON takes vLLM's whitespace options
  (``disable_any_whitespace``, ``whitespace_pattern``) and
  ``disable_additional_properties``.
- :class:`GrammarCompiler`, one per engine: turns a spec into a compiled
  matcher once per distinct spec (an LRU cache; a request gets a deep copy),
  and fills one step's token bitmask for every constrained row.
- :class:`GrammarState`, one per constrained sequence: the matcher that
  follows the sequence's accepted tokens.
"""

from __future__ import annotations

import json
import re
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from pitstop.errors import InvalidRequestError
from pitstop.errors import fail_request as _fail

if TYPE_CHECKING:  # torch is imported where a mask is built: SamplingParams must not need it
    import torch

INSTALL_HINT = "pip install 'pitstop[structured]' (it installs llguidance)"

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
    say. ``disable_fallback`` is accepted for vLLM code (pitstop has one
    backend and never falls back).
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

    def json_options(self) -> dict[str, Any]:
        """llguidance's JSON compile options for this constraint's whitespace settings."""
        if self.disable_any_whitespace:
            return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        if self.whitespace_pattern is not None:
            return {"whitespace_flexible": True, "whitespace_pattern": self.whitespace_pattern}
        if self.whitespace_flexible:
            return {"whitespace_flexible": True}
        # as json.dumps writes it: no run of blanks for a small model to loop in
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def grammar_as_lark(self) -> str:
        """``grammar`` in Lark syntax (a GBNF grammar converted); a parse error names the syntax."""
        assert self.grammar is not None
        syntax = self.grammar_syntax
        if syntax == "auto":
            syntax = detect_grammar_syntax(self.grammar)
        if syntax == "lark":
            return self.grammar
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            return gbnf_to_lark(self.grammar)
        except Exception as exc:  # GbnfToLarkError, or a converter bug on odd input
            raise InvalidRequestError(
                "structured_outputs.grammar is not valid GBNF (read as GBNF because "
                + (
                    "grammar_syntax is 'gbnf'"
                    if self.grammar_syntax == "gbnf"
                    else "its rules are written 'name ::= ...'"
                )
                + f"): {exc}; fix the grammar, or send Lark ('start: ...') with "
                "grammar_syntax 'lark'"
            ) from None

    def to_grammar(self, llguidance: Any) -> str:
        """The llguidance grammar text of this constraint."""
        matcher = llguidance.LLMatcher
        if self.kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if self.json_object else self.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if self.disable_additional_properties:
                schema = closed_objects(schema)
            return matcher.grammar_from_json_schema(
                json.dumps(schema), defaults=self.json_options()
            )
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.regex)
        if self.kind == "choice":
            assert self.choice is not None
            return matcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
            )
        if self.kind == "structural_tag":
            tags = [
                llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end)
                for trigger, begin, schema, end in structural_tag_of(self.structural_tag)
            ]
            # Triggers are matched as text: "<tool_call>" is not assumed to be a special token.
            return matcher.grammar_from_lark(
                llguidance.StructTag.to_grammar(tags, assume_special=False)
            )
        return matcher.grammar_from_lark(self.grammar_as_lark())

    def syntax_hint(self) -> str:
        """How a compile error names what was expected (``Lark`` or ``GBNF`` for a grammar)."""
        if self.kind != "grammar":
            return ""
        assert self.grammar is not None
        syntax = self.grammar_syntax
        if syntax == "auto":
            syntax = detect_grammar_syntax(self.grammar)
        if syntax == "gbnf":
            return " (GBNF, converted to Lark by llguidance)"
        return (
            " (read as Lark, llguidance's dialect: rules 'name: ...' starting at 'start'; a GBNF "
            "grammar writes 'root ::= ...', or say grammar_syntax 'gbnf')"
        )


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


def import_llguidance() -> Any:
    """The ``llguidance`` module (with its ``hf`` and ``torch`` parts), or a clear error."""
    try:
        with warnings.catch_warnings():  # its torch helpers use the deprecated torch.jit.script
            warnings.simplefilter("ignore", DeprecationWarning)
            import llguidance
            import llguidance.hf
            import llguidance.torch
    except ImportError as exc:
        raise InvalidRequestError(
            f"structured outputs need the llguidance package, which is not installed ({exc}); "
            f"{INSTALL_HINT}"
        ) from None
    return llguidance


class GrammarState:
    """One sequence's matcher: it follows the accepted tokens and says what may come next."""

    def __init__(self, matcher: Any, key: str, compiler: GrammarCompiler) -> None:
        self.matcher = matcher
        self.key = key
        self.compiler = compiler  # fills the bitmask of a step's constrained rows

    def accept(self, token_id: int) -> None:
        """Advance over an accepted token; raises when the grammar refuses it."""
        if not self.matcher.consume_token(int(token_id)):
            raise InvalidRequestError(
                f"the structured-output grammar refused token {token_id}: "
                f"{self.matcher.get_error() or 'not allowed here'}"
            )

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens > 0:
            self.matcher.rollback(int(num_tokens))

    @property
    def is_finished(self) -> bool:
        """Whether the grammar is complete and allows nothing more (the request stops)."""
        return bool(self.matcher.is_stopped())


class GrammarCompiler:
    """Compiles constraints for one tokenizer (once per distinct constraint) and fills bitmasks.

    ``vocab_size`` is the width of the model's logits (it may exceed the
    tokenizer's vocabulary; the extra ids are never allowed).
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, *, cache_size: int = 256) -> None:
        self.llguidance = import_llguidance()
        self.vocab_size = int(vocab_size)
        self.tokenizer = self.llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size)
        self.cache_size = int(cache_size)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._cache_lock = threading.Lock()  # the server compiles on its threads (check())
        self._executor = self.llguidance.LLExecutor()
        self.compilations = 0  # how many constraints were compiled (cache misses)

    def new_state(self, spec: StructuredOutputs) -> GrammarState:
        """A fresh matcher for ``spec``; a bad schema or regex raises InvalidRequestError."""
        key = spec.cache_key()
        with self._cache_lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
        if template is None:
            template = self._compile(spec)  # outside the lock: it may take a while
            with self._cache_lock:
                self._compiled[key] = template
                self.compilations += 1
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
        return GrammarState(template.deep_copy(), key, self)

    def check(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` (into the cache, so the engine finds it compiled) and refuse one
        that matches no text at all: its matcher fails, or allows no first token and is not
        complete (``root ::= root``, a ``$ref`` cycle). Raises InvalidRequestError naming it.

        A constraint whose every text is infinite (``start: "a" start``) is not detected
        here: its requests end at ``max_tokens`` (``finish_reason: "length"``)."""
        state = self.new_state(spec)
        matcher = state.matcher
        mask = matcher.compute_bitmask()  # the first position's allowed tokens
        error = (matcher.get_error() or "").strip() if matcher.is_error() else ""
        allowed = any(mask) if isinstance(mask, bytes | bytearray) else bool(mask)
        if error or (not allowed and not matcher.is_accepting()):
            reason = error.split("\n", 1)[0][:200]  # llguidance appends its whole state
            raise InvalidRequestError(
                f"structured_outputs.{spec.kind} matches no text at all"
                + (f" (llguidance: {reason})" if reason else "")
                + "; a rule or $ref that only refers to itself, or a cycle of them, can never "
                "end: give it a case that does not recurse"
            )

    def _compile(self, spec: StructuredOutputs) -> Any:
        lg = self.llguidance
        hint = spec.syntax_hint()
        try:
            grammar = spec.to_grammar(lg)
        except InvalidRequestError:
            raise
        except Exception as exc:  # the library's own parse errors
            raise InvalidRequestError(
                f"structured_outputs.{spec.kind} could not be compiled{hint}: {exc}"
            ) from None
        message = lg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if message and not message.startswith("WARNING"):
            raise InvalidRequestError(
                f"structured_outputs.{spec.kind} is not a valid constraint{hint}: {message}"
            )
        matcher = lg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise InvalidRequestError(
                f"structured_outputs.{spec.kind} is not a valid constraint{hint}: "
                f"{matcher.get_error()}"
            )
        return matcher

    def bitmask(self, states: Sequence[GrammarState | None]) -> torch.Tensor:
        """The ``[rows, ceil(V / 32)]`` int32 allowed-token bitmask of one step (on the host).

        Rows without a constraint allow every token (all bits set); the
        constrained rows are filled in parallel by llguidance.
        """
        mask = self.llguidance.torch.allocate_token_bitmask(len(states), self.vocab_size)
        mask.fill_(-1)
        rows = [(s.matcher, i) for i, s in enumerate(states) if s is not None]
        if rows:
            self.llguidance.torch.fill_next_token_bitmask_par(self._executor, rows, mask)
        return mask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[B, V]`` with every token whose bit is 0 in ``bitmask`` set to -inf.

    Runs on the logits' device, for the whole batch at once: the int32 words
    are expanded into bits with one shift-and-mask.
    """
    import torch

    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))
