"""The checks of a request that need the model (its vocabulary), run where it enters the
engine (never inside a step): :func:`validate_request`, one call in ``add_request``.

A request that passes them cannot make the shared engine step fail on its prompt or token
ids: text encodes as UTF-8, token ids are integers (``True`` is not the number 1) that index
the vocabulary. Each check raises :class:`~pitstop.errors.InvalidRequestError` with a message
that starts with the name of the field (the HTTP layer reads it as the ``param``) and says
what to send instead. The checks of each sampling field, which need no model, are
:class:`pitstop.SamplingParams`'s own (:mod:`pitstop.entrypoints.validation`); a chat's
messages are checked by the entry points too
(:func:`pitstop.entrypoints.chat_template.validate_messages`).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

from pitstop.errors import fail_request as _fail
from pitstop.requests.sampling_params import SamplingParams

INT64_MAX = 2**63 - 1
# torch seeds a generator with 64 bits; a seed (an int64, as vLLM takes it) is
# reduced modulo this (torch itself treats a negative seed that way).
SEED_MODULUS = 2**64


def validate_request(
    prompt: Any,
    params: SamplingParams,
    prompt_token_ids: Sequence[int] | None,
    *,
    vocab_size: int,
) -> list[int] | None:
    """Every check of a request that needs the model: call it first in ``add_request``;
    the prompt's token ids as a list of ints (None for a text prompt).

    Raises :class:`InvalidRequestError` when ``params`` is not a
    :class:`SamplingParams`, the prompt is neither a non-empty UTF-8 string
    nor a non-empty list of token ids inside the vocabulary, or a
    ``stop_token_ids`` entry is outside the vocabulary. Length checks against
    ``max_model_len`` stay with the engine, which knows the tokenized length.
    """
    if not isinstance(params, SamplingParams):
        _fail(
            f"sampling params must be a SamplingParams, got {type(params).__name__}; "
            "build one with SamplingParams(max_tokens=..., ...)"
        )
    if prompt_token_ids is None:
        if prompt is None:
            _fail("prompt: give a prompt (text) or prompt_token_ids")
        check_text("prompt", prompt)
        if not prompt:
            _fail("prompt is empty; give at least one token of text")
        ids = None
    else:
        ids = check_token_ids("prompt_token_ids", prompt_token_ids, vocab_size)
        if not ids:
            _fail("prompt_token_ids is empty; give at least one token")
    if params.stop_token_ids:
        check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    if params.logit_bias:
        check_token_ids("logit_bias", [t for t, _ in params.logit_bias], vocab_size)
    if params.allowed_token_ids is not None:
        check_token_ids("allowed_token_ids", params.allowed_token_ids, vocab_size)
    return ids


def is_int(value: Any) -> bool:
    """An integer (Python or numpy), but not a bool."""
    kind = type(value)
    if kind is int:  # the common case first: a request's fields are checked one by one
        return True
    if kind in (bool, float, str):
        return False
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | numpy_bool())


def numpy_bool() -> type:
    """numpy's bool type (``bool`` itself without numpy), which is no number either."""
    try:
        import numpy as np
    except ModuleNotFoundError:  # pragma: no cover - numpy is a dependency
        return bool
    return np.bool_


def type_name(value: Any) -> str:
    """The type of ``value`` as an error message names it (``a bool``, ``float``)."""
    return "a bool" if isinstance(value, bool) else type(value).__name__


def check_text(name: str, value: Any) -> str:
    """``value`` as a string that encodes as UTF-8 (no lone surrogate halves)."""
    if not isinstance(value, str):
        _fail(f"{name} must be a string, got {type_name(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start : exc.end]
        _fail(
            f"{name} contains {bad!r} at position {exc.start}, half of a UTF-16 surrogate "
            "pair, which is not text; send valid Unicode (pair the surrogates or remove it)"
        )
    return value


def check_token_ids(name: str, ids: Any, vocab_size: int | None = None) -> list[int]:
    """A list of token ids, each an integer in ``[0, vocab_size)`` (``[0, 2**63)`` if unknown)."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        _fail(f"{name} must be a list of token ids (integers), got {type_name(ids)}")
    out = list(ids)
    hi = INT64_MAX + 1 if vocab_size is None else vocab_size
    # the common case, a list of Python ints in range, checked by C loops (a prompt of a
    # thousand ids costs a few microseconds, not a Python call per id)
    if not out or (set(map(type, out)) == {int} and min(out) >= 0 and max(out) < hi):
        return out
    not_ints = [t for t in out if not is_int(t)]
    if not_ints:
        _fail(
            f"{name} must hold integers, got {not_ints[0]!r} ({type_name(not_ints[0])}); "
            "send token ids as JSON integers"
        )
    bad = [int(t) for t in out if not 0 <= t < hi]
    if bad:
        where = "the vocabulary" if vocab_size is not None else "int64"
        _fail(f"{name}: token id(s) {bad[:5]} outside {where} [0, {hi})")
    return [int(t) for t in out]


def check_encoded_prompt(prompt: str, ids: Sequence[int], vocab_size: int | None = None) -> None:
    """Refuse a text prompt that the tokenizer turns into no tokens, or into ids outside
    ``[0, vocab_size)`` (call it after encoding).

    Some control characters (``"\\x04"`` with SmolLM2's tokenizer) encode to
    nothing; a request with no tokens must not reach the scheduler. A tokenizer
    larger than the model is refused at load, so an id outside the vocabulary
    here means a tokenizer that adds ids at run time: refused, not indexed.
    """
    if not ids:
        _fail(
            f"prompt {prompt[:40]!r} encodes to no tokens (the tokenizer drops every character "
            "of it); send text with at least one printable character, or prompt_token_ids"
        )
    if vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            _fail(
                f"prompt encodes to token id(s) {bad[:5]} outside the model's vocabulary "
                f"[0, {vocab_size}); the tokenizer does not match the model: load the model's "
                "own tokenizer"
            )
