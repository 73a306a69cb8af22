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
  strings) or ``grammar`` (Lark syntax, llguidance's dialect).
- :class:`GrammarCompiler`, one per engine: turns a spec into a compiled
  matcher once per distinct spec (an LRU cache; a request gets a deep copy),
  and fills one step's token bitmask for every constrained row.
- :class:`GrammarState`, one per constrained sequence: the matcher that
  follows the sequence's accepted tokens.
"""

from __future__ import annotations

import json
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from pitstop.errors import InvalidRequestError

if TYPE_CHECKING:  # torch is imported where a mask is built: SamplingParams must not need it
    import torch

INSTALL_HINT = "pip install 'pitstop[structured]' (it installs llguidance)"

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _fail(message: str) -> None:
    raise InvalidRequestError(message)


@attrs.frozen(kw_only=True)
class StructuredOutputs:
    """A constraint on the generated text; set exactly one field.

    ``json``: a JSON schema (dict, or its JSON text); ``json_object``: True
    for any JSON object; ``regex``: a regular expression the whole output
    matches; ``choice``: the output is exactly one of these strings;
    ``grammar``: a Lark grammar (llguidance's dialect, ``start`` rule first).
    ``whitespace_flexible`` lets JSON output put whitespace anywhere JSON
    allows (default: compact separators, as ``json.dumps`` writes).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = attrs.field(
        default=None, converter=lambda v: tuple(v) if isinstance(v, list) else v
    )
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __attrs_post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            _fail(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}"
            )
        if not isinstance(self.json_object, bool) or not isinstance(self.whitespace_flexible, bool):
            _fail("structured_outputs.json_object and whitespace_flexible must be true or false")
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

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        """A string that is equal for equal constraints (the compile cache's key)."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        return json.dumps(
            [self.kind, value, self.whitespace_flexible], sort_keys=True, ensure_ascii=False
        )

    def to_grammar(self, llguidance: Any) -> str:
        """The llguidance grammar text of this constraint."""
        matcher = llguidance.LLMatcher
        separators: dict[str, Any] = {"whitespace_flexible": self.whitespace_flexible}
        if not self.whitespace_flexible:  # as json.dumps writes it: no run of blanks to loop in
            separators.update(item_separator=", ", key_separator=": ")
        if self.kind in ("json", "json_object"):
            schema = {"type": "object"} if self.json_object else self.json
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return matcher.grammar_from_json_schema(text, defaults=separators)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.regex)
        if self.kind == "choice":
            assert self.choice is not None
            return matcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
            )
        assert self.grammar is not None
        return matcher.grammar_from_lark(self.grammar)


def structured_outputs_of(value: Any) -> StructuredOutputs | None:
    """``SamplingParams.structured_outputs`` from a :class:`StructuredOutputs`, a dict or None."""
    if value is None or isinstance(value, StructuredOutputs):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in attrs.fields(StructuredOutputs)})
        if unknown:
            _fail(
                f"structured_outputs has no field {unknown[0]!r}; use one of "
                "json, json_object, regex, choice, grammar (and whitespace_flexible)"
            )
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
        self._executor = self.llguidance.LLExecutor()
        self.compilations = 0  # how many constraints were compiled (cache misses)

    def new_state(self, spec: StructuredOutputs) -> GrammarState:
        """A fresh matcher for ``spec``; a bad schema or regex raises InvalidRequestError."""
        key = spec.cache_key()
        template = self._compiled.get(key)
        if template is None:
            template = self._compile(spec)
            self._compiled[key] = template
            self.compilations += 1
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return GrammarState(template.deep_copy(), key, self)

    def _compile(self, spec: StructuredOutputs) -> Any:
        lg = self.llguidance
        try:
            grammar = spec.to_grammar(lg)
        except Exception as exc:  # the library's own parse errors
            raise InvalidRequestError(
                f"structured_outputs.{spec.kind} could not be compiled: {exc}"
            ) from None
        message = lg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if message and not message.startswith("WARNING"):
            raise InvalidRequestError(
                f"structured_outputs.{spec.kind} is not a valid constraint: {message}"
            )
        matcher = lg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise InvalidRequestError(
                f"structured_outputs.{spec.kind} is not a valid constraint: {matcher.get_error()}"
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
