"""The checks of each sampling field, which need no model: converters and attrs validators
with one message style, run when a :class:`~pitstop.entrypoints.sampling_params.SamplingParams`
is built or assigned (never inside a step).

A value that passes them cannot make the shared engine step fail: integers fit an int64
tensor, floats are finite, and ``True`` is not the number 1. Each check raises
:class:`~pitstop.errors.InvalidRequestError` with a message that starts with the name of the
field (the HTTP layer reads it as the ``param``) and says what to send instead. The checks
that need the vocabulary are the engine's (:mod:`pitstop.requests.validation`);
:func:`refuse_unknown_keys` is the one the chat messages and tools share.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

from pitstop.errors import InvalidRequestError
from pitstop.errors import fail_request as _fail
from pitstop.requests.validation import (
    INT64_MAX,
    SEED_MODULUS,
    is_int,
    numpy_bool,
    type_name,
)

INT64_MIN = -(2**63)

# A token id key of logit_bias: ASCII decimal digits only (str.isdigit() alone also takes
# "²", "①", "٣" and "𝟓", and int() strips spaces), at most 19 of them (int64).
_TOKEN_ID_KEY_DIGITS = 19


def shown(value: Any, limit: int = 24) -> str:
    """``repr(value)`` cut to ``limit`` characters, with its full length (a 5,000-digit key)."""
    if is_int(value) and int(value).bit_length() > 4 * limit:  # str() of it may even raise
        return f"an integer of about {int(int(value).bit_length() * math.log10(2)) + 1:,} digits"
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value):,} characters)"
    text = str(value) if is_int(value) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def refuse_unknown_keys(obj: Mapping[str, Any], known: Set[str], where: str, hint: str) -> None:
    """Refuse ``obj`` when it has a key outside ``known``, naming the first (sorted) one.

    The message reads ``{where} has the unknown key 'k'; {hint}``.
    """
    unknown = sorted(set(obj) - known)
    if unknown:
        _fail(f"{where} has the unknown key {unknown[0]!r}; {hint}")


def is_real(value: Any) -> bool:
    """A finite int or float (Python or numpy), but not a bool."""
    kind = type(value)
    if kind is float:  # the common case first (12,000 logit_bias values check in ms)
        return math.isfinite(value)
    if kind in (bool, str):
        return False
    if isinstance(value, bool | numpy_bool()) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float is finite but absurd here
        return False


def check_int(name: str, value: Any, *, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    """``value`` as an int in ``[lo, hi]``; anything else raises naming ``name``."""
    if not is_int(value):
        _fail(f"{name} must be an integer, got {type_name(value)} {shown(value)}")
    value = int(value)
    if not lo <= value <= hi:
        _fail(f"{name} must be in [{lo}, {hi}], got {shown(value)}")
    return value


def check_real(name: str, value: Any, hint: str) -> float:
    """``value`` as a finite float; ``hint`` says what to send instead."""
    if not is_real(value):
        kind = "a finite number" if isinstance(value, numbers.Real) else "a number"
        _fail(f"{name} must be {kind}, got {type_name(value)} {value!r}; {hint}")
    return float(value)


def seed_of(value: Any) -> int | None:
    """A request seed, an int64 (as vLLM takes it), reduced into ``[0, 2**64)`` for torch;
    None stays None (the engine's own seed). Outside int64 it raises naming ``seed``."""
    if value is None:
        return None
    if not is_int(value):
        _fail(f"seed must be an integer or null, got {type_name(value)} {value!r}")
    if not INT64_MIN <= int(value) <= INT64_MAX:
        _fail(
            f"seed must be in [{INT64_MIN}, {INT64_MAX}] (int64), got {shown(int(value))}; "
            "send a smaller seed"
        )
    return int(value) % SEED_MODULUS


def token_id_key(key: Any) -> int:
    """A ``logit_bias`` key as a token id: an int, or a string of ASCII decimal digits
    (JSON object keys are strings). Anything else raises naming the key: ``"²"``,
    ``"①"``, ``"٣"``, ``"𝟓"``, ``" 5"``, ``"+5"``, ``"-1"`` and keys past int64."""
    if is_int(key):
        return check_int("logit_bias", key, lo=0)
    if (
        isinstance(key, str)
        and len(key) <= _TOKEN_ID_KEY_DIGITS
        and key.isascii()
        and key.isdigit()
    ):
        value = int(key)  # on ASCII, isdigit() is exactly 0-9
        if value <= INT64_MAX:
            return value
    if isinstance(key, str):
        _fail(
            f"logit_bias key {shown(key)} is not a token id; keys must be token ids written "
            'in ASCII digits 0-9 (no spaces, signs or other numerals), e.g. {"50256": -100}'
        )
    _fail(f"logit_bias keys must be token ids, got {type_name(key)} {shown(key)}")
    raise AssertionError  # unreachable: _fail raises


# ---------------------------------------------------------------- attrs validators and converters
# One message style for every field: "<field> must be <what it accepts>, got <value>[; <hint>]",
# the field's name first (the HTTP layer reads it as the OpenAI error's ``param``).


def _got(value: Any) -> str:
    return f"{shown(value)} (a bool)" if isinstance(value, bool | numpy_bool()) else shown(value)


def _bounds(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_num(lo)}"
    return f"<= {_num(hi)}"


def _num(x: float) -> str:
    if x == INT64_MAX:
        return "2**63 - 1"
    return f"{x:g}" if isinstance(x, float) else str(x)


def must_be(name: str, what: str, value: Any, hint: str = "") -> InvalidRequestError:
    """The one error message of a field's value: ``<name> must be <what>, got <value>; <hint>``."""
    return InvalidRequestError(
        f"{name} must be {what}, got {_got(value)}" + (f"; {hint}" if hint else "")
    )


def int_in(
    lo: int | None = None,
    hi: int | None | Callable[[Any], int | None] = INT64_MAX,
    *,
    hint: str = "",
    off: Sequence[int] = (),
    optional: bool = False,
) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: an integer in ``[lo, hi]`` (``hi`` may read the instance), or one
    of ``off`` (values that switch the field off), or None when ``optional``."""

    def check(inst: Any, att: Any, value: Any) -> None:
        if value is None and optional:
            return
        top = hi(inst) if callable(hi) else hi
        if is_int(value) and (
            value in off or ((lo is None or value >= lo) and (top is None or value <= top))
        ):
            return
        what = f"an integer {_bounds(lo, top)}"
        if off:
            what = f"{' or '.join(map(str, off))} (off) or {what}"
        if optional:
            what = f"null or {what}"
        raise must_be(att.name, what, value, hint)

    return check


def real_in(
    lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hint: str = ""
) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: a finite number in the range (``lo_open``: ``lo`` excluded)."""

    def check(_inst: Any, att: Any, value: Any) -> None:
        ok = is_real(value)
        if ok and lo is not None:
            ok = value > lo if lo_open else value >= lo
        if ok and hi is not None:
            ok = value <= hi
        if not ok:
            raise must_be(att.name, f"a finite number {_bounds(lo, hi, lo_open)}", value, hint)

    return check


def boolean(_inst: Any, att: Any, value: Any) -> None:
    """An attrs validator: True or False (not 1, not "true")."""
    if not isinstance(value, bool):
        raise must_be(att.name, "true or false", value)


def as_int(value: Any) -> Any:
    """A converter: an integer (numpy's too) as a Python int; anything else unchanged."""
    return int(value) if is_int(value) else value


def as_float(value: Any) -> Any:
    """A converter: a finite real number (numpy's too) as a float; anything else unchanged."""
    return float(value) if is_real(value) else value
