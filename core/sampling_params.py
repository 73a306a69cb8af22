"""Per-request sampling parameters, validated when built.

Every value is checked here, where a request enters, so that nothing a
caller sends can make the shared engine step fail (see
:mod:`pitstop.validation`): integers fit int64, floats are finite, booleans
are not numbers, stop strings are valid UTF-8. Token ids are checked against
the vocabulary when the engine accepts the request, where it is known.
"""

from __future__ import annotations

from typing import Any

import attrs

from pitstop.errors import InvalidRequestError
from pitstop.validation import INT64_MAX, check_int, check_real, check_text, is_int, seed_of

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's convention)."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)


def _strings(value: Any) -> Any:
    """``stop`` as a tuple: one string becomes a 1-tuple; other types are left for the check."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(value)
    return value


def _ids(value: Any) -> Any:
    """``stop_token_ids`` as a tuple; other types are left for the check."""
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(value)
    return value


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to turn a request's logits into tokens, and when to stop.

    ``temperature=0`` is greedy decoding. ``top_k=-1`` (or 0 in vLLM's
    spelling is *not* accepted: use -1) disables top-k; ``top_p=1`` and
    ``min_p=0`` disable their filters. ``seed`` makes one request's sampling
    repeatable whatever else is in the batch; any integer is accepted and
    reduced modulo 2**64 (``seed`` and ``seed + 2**64`` sample alike, as do
    ``-1`` and ``2**64 - 1``, which is how torch reads a negative seed).

    Types are strict: ``True`` is not a number, ``"0.5"`` is not a float, and
    NaN and infinities are refused. Integers are bounded by int64 (``top_k``,
    ``max_tokens``, ``stop_token_ids``).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    ignore_eos: bool = False
    logprobs: bool = False

    def __attrs_post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: store the normalized values once, here
        _check(
            is_int(self.max_tokens) and 1 <= self.max_tokens <= INT64_MAX,
            f"max_tokens must be an integer in [1, 2**63 - 1], got {self.max_tokens!r}; "
            "ask for at least one token",
        )
        set_(self, "max_tokens", int(self.max_tokens))
        temperature = check_real("temperature", self.temperature, "use 0 for greedy decoding")
        _check(
            temperature >= 0,
            f"temperature must be >= 0, got {self.temperature!r}; use 0 for greedy decoding",
        )
        set_(self, "temperature", temperature)
        top_p = check_real("top_p", self.top_p, "use 1 to disable top-p")
        _check(
            0 < top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}; use 1 to disable top-p",
        )
        set_(self, "top_p", top_p)
        _check(
            is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k <= INT64_MAX),
            f"top_k must be -1 (disabled) or an integer in [1, 2**63 - 1], got {self.top_k!r}; "
            "a top_k at or above the vocabulary size keeps every token",
        )
        set_(self, "top_k", int(self.top_k))
        min_p = check_real("min_p", self.min_p, "use 0 to disable min-p")
        _check(
            0 <= min_p <= 1,
            f"min_p must be in [0, 1], got {self.min_p!r}; use 0 to disable min-p",
        )
        set_(self, "min_p", min_p)
        set_(self, "seed", seed_of(self.seed))
        _check(
            isinstance(self.stop, tuple),
            f"stop must be a string or a list of strings, got {type(self.stop).__name__}",
        )
        for s in self.stop:
            check_text("stop", s)
            _check(bool(s), "stop strings must be non-empty strings")
        _check(
            isinstance(self.stop_token_ids, tuple),
            f"stop_token_ids must be a list of token ids (integers), got "
            f"{type(self.stop_token_ids).__name__}",
        )
        set_(
            self,
            "stop_token_ids",
            tuple(check_int("stop_token_ids", t, lo=0) for t in self.stop_token_ids),
        )
        for name in ("ignore_eos", "logprobs"):
            value = getattr(self, name)
            _check(
                isinstance(value, bool),
                f"{name} must be true or false, got {type(value).__name__} {value!r}",
            )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature below :data:`SAMPLING_EPS`
        (0, or near enough that vLLM treats it as 0) or top_k 1. The one definition:
        the sampling batch, the runner and speculative decoding all ask this."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1
