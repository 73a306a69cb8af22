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
from pitstop.structured import StructuredOutputs, structured_outputs_of
from pitstop.validation import (
    INT64_MAX,
    check_int,
    check_real,
    check_text,
    is_int,
    seed_of,
    token_id_key,
)

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's convention)."""

StructuredOutputsParams = StructuredOutputs
"""vLLM's name for :class:`~pitstop.structured.StructuredOutputs` (same fields)."""

MAX_LOGPROBS = 20
"""The most alternatives ``logprobs`` / ``prompt_logprobs`` may ask for (OpenAI's limit)."""


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


def _bias(value: Any) -> Any:
    """``logit_bias`` as a sorted tuple of ``(token_id, bias)``; other types are left for the check."""
    if value is None:
        return ()
    if isinstance(value, dict):
        return tuple(value.items())  # sorted once the keys are token ids
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
    """How to turn a request's logits into tokens, and when to stop (vLLM's fields).

    ``temperature=0`` is greedy decoding. ``top_k`` 0 or -1 disables top-k
    (stored as -1); ``top_p=1`` and ``min_p=0`` disable their filters.
    ``seed`` makes one request's sampling repeatable whatever else is in the
    batch; it is an int64 (outside it: an error, as vLLM answers 400), reduced
    modulo 2**64 for torch.

    ``n`` samples per prompt (``best_of``, if given, must equal ``n``: pitstop
    returns every sample it draws). ``min_tokens`` forbids EOS and
    ``stop_token_ids`` until that many tokens were generated.
    ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]) subtract from
    the logit of every token already generated, once or per occurrence;
    ``repetition_penalty`` (> 0, 1 = off) divides a positive logit (multiplies
    a negative one) of every token in the prompt or output. ``logit_bias``
    maps token ids to a bias in [-100, 100] added to their logits; a key is an
    int or a string of ASCII digits (``"50256"``), and must be in the vocabulary.

    ``logprobs=k`` returns, per generated token, the log-probabilities of the
    ``k`` most likely tokens and of the chosen one (0: the chosen one only;
    None: none); ``prompt_logprobs=k`` the same for each prompt token after
    the first. ``skip_special_tokens`` and ``spaces_between_special_tokens``
    shape the detokenized text; ``include_stop_str_in_output`` keeps a
    matched stop string at the end of the text. ``structured_outputs``
    constrains the text to a JSON schema, any JSON object, a regular
    expression, a choice of strings or a Lark grammar (see
    :class:`~pitstop.structured.StructuredOutputs`; a dict is accepted).

    Types are strict: ``True`` is not a number, ``"0.5"`` is not a float, and
    NaN and infinities are refused. Integers are bounded by int64.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = attrs.field(
        default=None, converter=structured_outputs_of
    )

    def __attrs_post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: store the normalized values once, here
        _check(
            is_int(self.n) and 1 <= self.n <= 128,
            f"n must be an integer in [1, 128], got {self.n!r}; it is how many samples to return",
        )
        set_(self, "n", int(self.n))
        if self.best_of is not None:
            _check(
                is_int(self.best_of) and int(self.best_of) == self.n,
                f"best_of must be null or equal to n ({self.n}), got {self.best_of!r}; pitstop "
                "returns every sample it draws, so ask for n samples and rank them yourself",
            )
            set_(self, "best_of", int(self.best_of))
        _check(
            is_int(self.max_tokens) and 1 <= self.max_tokens <= INT64_MAX,
            f"max_tokens must be an integer in [1, 2**63 - 1], got {self.max_tokens!r}; "
            "ask for at least one token",
        )
        set_(self, "max_tokens", int(self.max_tokens))
        _check(
            is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got "
            f"{self.min_tokens!r}",
        )
        set_(self, "min_tokens", int(self.min_tokens))
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
            is_int(self.top_k) and (self.top_k in (-1, 0) or 1 <= self.top_k <= INT64_MAX),
            f"top_k must be -1 or 0 (disabled) or an integer in [1, 2**63 - 1], got "
            f"{self.top_k!r}; a top_k at or above the vocabulary size keeps every token",
        )
        set_(self, "top_k", -1 if self.top_k == 0 else int(self.top_k))
        min_p = check_real("min_p", self.min_p, "use 0 to disable min-p")
        _check(
            0 <= min_p <= 1,
            f"min_p must be in [0, 1], got {self.min_p!r}; use 0 to disable min-p",
        )
        set_(self, "min_p", min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = check_real(name, getattr(self, name), "use 0 to disable it")
            _check(-2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}; 0 disables it")
            set_(self, name, value)
        repetition = check_real(
            "repetition_penalty", self.repetition_penalty, "use 1 to disable it"
        )
        _check(
            repetition > 0,
            f"repetition_penalty must be > 0, got {repetition!r}; 1 disables it, above 1 "
            "discourages repeats",
        )
        set_(self, "repetition_penalty", repetition)
        _check(
            isinstance(self.logit_bias, tuple),
            f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}",
        )
        bias: list[tuple[int, float]] = []
        for pair in self.logit_bias:
            _check(
                isinstance(pair, tuple) and len(pair) == 2,
                "logit_bias must map token ids to numbers, e.g. {50256: -100}",
            )
            key, value = pair
            token = token_id_key(key)  # JSON object keys are strings: ASCII digits only
            amount = check_real("logit_bias", value, "send a number in [-100, 100]")
            _check(
                -100 <= amount <= 100,
                f"logit_bias for token {token} must be in [-100, 100], got {amount!r}",
            )
            _check(
                all(t != token for t, _ in bias),
                f"logit_bias names token {token} twice; give each token id once",
            )
            bias.append((token, amount))
        set_(self, "logit_bias", tuple(sorted(bias)))
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
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            value = getattr(self, name)
            _check(
                isinstance(value, bool),
                f"{name} must be true or false, got {type(value).__name__} {value!r}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _check(
                is_int(value) and 0 <= value <= MAX_LOGPROBS,
                f"{name} must be null or an integer in [0, {MAX_LOGPROBS}] (how many "
                f"alternatives per token; 0: the chosen token only), got {value!r}",
            )
            set_(self, name, int(value))

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature below :data:`SAMPLING_EPS`
        (0, or near enough that vLLM treats it as 0) or top_k 1. The one definition:
        the sampling batch, the runner and speculative decoding all ask this."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        """Whether a presence, frequency or repetition penalty is set."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )
