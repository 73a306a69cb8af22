"""The ``llguidance`` grammar backend: structured outputs through llguidance.

pitstop ships `llguidance <https://github.com/guidance-ai/llguidance>`_ (a
maintained Rust library with CPU wheels on PyPI and no Python dependencies
beyond numpy/torch, which pitstop has anyway): it computes the mask of
allowed next tokens from a grammar over the model's tokenizer in tens of
microseconds, fills it for a whole batch at once on its own threads
(:func:`llguidance.torch.fill_next_token_bitmask_par`), and can roll its
state back. It is imported lazily, when the engine builds the backend at the
first structured request: without it installed, that request gets an
:class:`InvalidRequestError` that says ``pip install 'pitstop[structured]'``.

- :class:`LLGuidanceBackend`, one per engine: turns a
  :class:`~pitstop.entrypoints.structured.StructuredOutputs` into a compiled
  matcher once per distinct constraint (an LRU cache; a request gets a deep
  copy), and fills one step's token bitmask for every constrained row.
- :class:`LLGuidanceMatcher`, one per constrained sample: the matcher that
  follows the sample's accepted tokens.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pitstop.entrypoints.structured import StructuredOutputs, structural_tag_of
from pitstop.errors import InvalidRequestError
from pitstop.plugin_system.hookspecs import hookimpl

if TYPE_CHECKING:
    import torch

    from pitstop.config import EngineConfig
    from pitstop.loading.tokenizer import Tokenizer

INSTALL_HINT = "pip install 'pitstop[structured]' (it installs llguidance)"


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


def json_options(spec: StructuredOutputs) -> dict[str, Any]:
    """llguidance's JSON compile options for ``spec``'s whitespace settings."""
    if spec.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    if spec.whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
    if spec.whitespace_flexible:
        return {"whitespace_flexible": True}
    # as json.dumps writes it: no run of blanks for a small model to loop in
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_as_lark(spec: StructuredOutputs) -> str:
    """``spec.grammar`` in Lark syntax (a GBNF grammar converted); a parse error names the syntax."""
    assert spec.grammar is not None
    if spec.syntax() == "lark":
        return spec.grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(spec.grammar)
    except Exception as exc:  # GbnfToLarkError, or a converter bug on odd input
        raise InvalidRequestError(
            "structured_outputs.grammar is not valid GBNF (read as GBNF because "
            + (
                "grammar_syntax is 'gbnf'"
                if spec.grammar_syntax == "gbnf"
                else "its rules are written 'name ::= ...'"
            )
            + f"): {exc}; fix the grammar, or send Lark ('start: ...') with "
            "grammar_syntax 'lark'"
        ) from None


def to_grammar(spec: StructuredOutputs, llguidance: Any) -> str:
    """The llguidance grammar text of ``spec``."""
    matcher = llguidance.LLMatcher
    if spec.kind in ("json", "json_object"):
        schema = json.dumps(spec.json_schema())
        return matcher.grammar_from_json_schema(schema, defaults=json_options(spec))
    if spec.kind == "regex":
        return matcher.grammar_from_regex(spec.regex)
    if spec.kind == "choice":
        assert spec.choice is not None
        return matcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        )
    if spec.kind == "structural_tag":
        tags = [
            llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end)
            for trigger, begin, schema, end in structural_tag_of(spec.structural_tag)
        ]
        # Triggers are matched as text: "<tool_call>" is not assumed to be a special token.
        return matcher.grammar_from_lark(
            llguidance.StructTag.to_grammar(tags, assume_special=False)
        )
    return matcher.grammar_from_lark(grammar_as_lark(spec))


def syntax_hint(spec: StructuredOutputs) -> str:
    """How a compile error names what was expected (``Lark`` or ``GBNF`` for a grammar)."""
    if spec.kind != "grammar":
        return ""
    if spec.syntax() == "gbnf":
        return " (GBNF, converted to Lark by llguidance)"
    return (
        " (read as Lark, llguidance's dialect: rules 'name: ...' starting at 'start'; a GBNF "
        "grammar writes 'root ::= ...', or say grammar_syntax 'gbnf')"
    )


class LLGuidanceMatcher:
    """One sample's matcher: it follows the accepted tokens and says what may come next."""

    def __init__(self, matcher: Any, key: str, backend: LLGuidanceBackend) -> None:
        self.matcher = matcher
        self.key = key
        self.backend = backend  # fills the bitmask of a step's constrained rows

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


class LLGuidanceBackend:
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

    def new_state(self, spec: StructuredOutputs) -> LLGuidanceMatcher:
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
        return LLGuidanceMatcher(template.deep_copy(), key, self)

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
        hint = syntax_hint(spec)
        try:
            grammar = to_grammar(spec, lg)
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

    def bitmask(self, states: Sequence[LLGuidanceMatcher | None]) -> torch.Tensor:
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


def create_llguidance(
    config: EngineConfig, tokenizer: Tokenizer, vocab_size: int
) -> LLGuidanceBackend:
    """llguidance: JSON schema, regex, choice, Lark / GBNF grammars, structural tags."""
    return LLGuidanceBackend(tokenizer.hf, vocab_size)


@hookimpl
def register_grammars(register: Any) -> None:
    """Register the ``llguidance`` grammar backend."""
    register("llguidance", create_llguidance)
