"""vLLM's ``SamplingParams``: the engine's sampling value with vLLM's surface, validated when built.

:class:`SamplingParams` is :class:`pitstop.entrypoints.sampling_params.SamplingParams` (the
plain value the engine reads) whose every field is converted and checked here, where a
request enters, so that nothing a caller sends can make the shared engine step fail (see
:mod:`pitstop.entrypoints.validation`): integers fit int64, floats are finite, booleans
are not numbers, stop strings are valid UTF-8. The checks are attrs
validators (numbers, flags) and converters (fields that are parsed: token
maps, stop strings, processors), with one message style, ``top_p must be a
finite number in (0, 1], got 1.5; use 1 to disable top-p``. Token ids are
checked against the vocabulary when the engine accepts the request, where
it is known. vLLM's fields that pitstop lacks are refused by name
(:data:`VLLM_ONLY`).
"""

from __future__ import annotations

import difflib
import enum
import inspect
from collections.abc import Callable
from typing import Any

import attrs

from pitstop.entrypoints.structured import StructuredOutputs, structured_outputs_of
from pitstop.entrypoints.validation import (
    as_float,
    as_int,
    boolean,
    check_int,
    check_real,
    int_in,
    must_be,
    real_in,
    seed_of,
    token_id_key,
)
from pitstop.errors import InvalidRequestError
from pitstop.requests import sampling_params as engine
from pitstop.requests.sampling_params import SAMPLING_EPS
from pitstop.requests.validation import INT64_MAX, check_text, is_int

__all__ = ["SAMPLING_EPS", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

StructuredOutputsParams = StructuredOutputs
"""vLLM's name for :class:`~pitstop.entrypoints.structured.StructuredOutputs` (same fields)."""

MAX_LOGPROBS = 20
"""The most alternatives ``logprobs`` / ``prompt_logprobs`` may ask for (OpenAI's limit)."""


class RequestOutputKind(enum.Enum):
    """vLLM's ``SamplingParams.output_kind``: what each output of a request carries.

    ``LLM.generate`` returns each request's final output whichever is asked, so
    ``CUMULATIVE`` (vLLM's default) and ``FINAL_ONLY`` are accepted; ``DELTA`` is
    refused (``LLM.stream`` yields cumulative outputs with ``text_delta`` and
    ``new_token_ids``)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


VLLM_ONLY: dict[str, str] = {
    "output_kind": (
        "LLM.generate returns each request's final output; LLM.stream yields cumulative ones "
        "with text_delta and new_token_ids"
    ),
    "guided_decoding": "pitstop's is structured_outputs=StructuredOutputsParams(...)",
    "extra_args": "pitstop has no per-request extension arguments; use logits_processors",
    "flat_logprobs": "pitstop's logprobs are a list of {token_id: Logprob} per token",
    "skip_clone": "pitstop copies the parameters of each request it accepts; leave it out",
    "skip_reading_prefix_cache": "pitstop's is the engine setting allocator='paged'",
    "bad_words_token_ids": "give bad_words as strings; pitstop tokenizes them",
    "logprob_token_ids": "ask for logprobs=-1 (every token) and read the ids you need",
    "thinking_token_budget": "pitstop has no reasoning budget; bound the output with max_tokens",
    "repetition_detection": "pitstop has no repetition detection; use repetition_penalty",
    "use_beam_search": "use LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens))",
    "length_penalty": "use LLM.beam_search with BeamSearchParams(length_penalty=...)",
    "early_stopping": "use LLM.beam_search (it stops a beam at EOS, as vLLM's does)",
}
"""vLLM's SamplingParams fields pitstop does not have: what to use instead."""

VLLM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "output_kind": (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY),
    "guided_decoding": (None,),
    "extra_args": (None, {}),
    "flat_logprobs": (False,),
    "skip_clone": (False, True),
    "skip_reading_prefix_cache": (None, False),
    "bad_words_token_ids": (None, []),
    "logprob_token_ids": (None,),
    "thinking_token_budget": (None, -1),
    "repetition_detection": (None,),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "early_stopping": (False,),
}
"""Values of :data:`VLLM_ONLY` fields that ask for what pitstop does (vLLM's defaults, and
``skip_clone``, ``output_kind=FINAL_ONLY``): accepted and dropped, so code that spells them
out runs."""


def vllm_only_is_neutral(name: str, value: Any) -> bool:
    """Whether ``value`` of the vLLM-only field ``name`` asks for what pitstop does."""
    return any(
        value is v or (type(value) is type(v) and value == v) for v in VLLM_NEUTRAL.get(name, ())
    )


def vllm_only_error(name: str, value: Any) -> InvalidRequestError:
    """The error of a vLLM-only field given a value pitstop does not do."""
    accepted = ", ".join(_shown(v) for v in VLLM_NEUTRAL.get(name, ()))
    also = f" ({accepted} accepted: what pitstop does)" if accepted else ""
    return InvalidRequestError(
        f"{name} is vLLM's SamplingParams field; pitstop does not do {name}={_shown(value)}: "
        f"{VLLM_ONLY[name]}{also}"
    )


def _shown(value: Any) -> str:
    return f"RequestOutputKind.{value.name}" if isinstance(value, enum.Enum) else repr(value)


def _strings(name: str, *, single: bool) -> Callable[[Any], tuple[str, ...]]:
    """A converter: a list of non-empty UTF-8 strings as a tuple (``single``: one string is a
    list of one)."""

    def convert(value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if single and isinstance(value, str):
            value = (value,)
        if not isinstance(value, list | tuple):
            raise must_be(name, "a list of strings", value)
        for s in value:
            check_text(name, s)
            if not s:
                raise must_be(name, "a list of non-empty strings", s)
        return tuple(value)

    return convert


def _bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A converter: ``logit_bias`` as a sorted tuple of ``(token_id, bias)``."""
    if value is None:
        return ()
    if isinstance(value, dict):
        value = tuple(value.items())
    if not isinstance(value, tuple):
        raise must_be("logit_bias", "a map of token ids to numbers, e.g. {50256: -100}", value)
    bias: dict[int, float] = {}  # a dict: the duplicate check stays linear (12,000 keys: ms)
    for pair in value:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise must_be("logit_bias", "a map of token ids to numbers, e.g. {50256: -100}", pair)
        key, amount = pair
        token = token_id_key(key)  # JSON object keys are strings: ASCII digits only
        amount = check_real("logit_bias", amount, "send a number in [-100, 100]")
        if not -100 <= amount <= 100:
            raise must_be(f"logit_bias for token {token}", "in [-100, 100]", amount)
        if token in bias:
            raise InvalidRequestError(
                f"logit_bias names token {token} twice; give each token id once"
            )
        bias[token] = amount
    return tuple(sorted(bias.items()))


def _ids(name: str, *, optional: bool = False) -> Callable[[Any], tuple[int, ...] | None]:
    """A converter: a list of token ids (integers >= 0) as a tuple (``optional``: None stays)."""

    def convert(value: Any) -> tuple[int, ...] | None:
        if value is None:
            return None if optional else ()
        if not isinstance(value, list | tuple):
            raise must_be(name, "a list of token ids (integers)", value)
        ids = tuple(check_int(name, t, lo=0) for t in value)
        if optional and not ids:
            raise must_be(name, "null or a non-empty list of token ids", [])
        return ids

    return convert


def processor_arity(fn: Any) -> int:
    """How many arguments a logits processor takes: 2, ``fn(output_ids, logits)``, or 3,
    ``fn(prompt_ids, output_ids, logits)``; anything else raises naming ``logits_processors``."""
    if not callable(fn):
        raise must_be("logits_processors", "a list of callables", fn)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: take it as the 2-form
        return 2
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(positional) not in (2, 3):
        raise InvalidRequestError(
            f"logits_processors must be callables of 2 or 3 arguments, fn(output_token_ids, "
            f"logits) or fn(prompt_token_ids, output_token_ids, logits), got "
            f"{getattr(fn, '__qualname__', type(fn).__name__)} of {len(positional)}"
        )
    return len(positional)


def _processors(value: Any) -> tuple[Callable[..., Any], ...]:
    """A converter: ``logits_processors`` as a tuple of callables of 2 or 3 arguments."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise must_be("logits_processors", "a list of callables", value)
    for fn in value:
        processor_arity(fn)
    return tuple(value)


def _top_k(value: Any) -> Any:
    """A converter: ``top_k`` 0 (off) is stored as -1."""
    value = as_int(value)
    return -1 if is_int(value) and value == 0 else value


def _best_of(inst: Any, att: Any, value: Any) -> None:
    if value is not None and not (is_int(value) and value == inst.n):
        raise must_be(
            "best_of",
            f"null or equal to n ({inst.n})",
            value,
            "pitstop returns every sample it draws, so ask for n samples and rank them yourself",
        )


def _null_minus_one_or_in(low: int, high: int, what: str, hint: str) -> Callable[..., None]:
    """An attrs validator: None, -1 or an integer in ``[low, high]``; else ``<field> must be <what>``."""

    def check(_inst: Any, att: Any, value: Any) -> None:
        if value is None or (is_int(value) and (value == -1 or low <= value <= high)):
            return
        raise must_be(att.name, what, value, hint)

    return check


_logprobs = _null_minus_one_or_in(
    0,
    MAX_LOGPROBS,
    f"null, -1 (the whole vocabulary) or an integer in [0, {MAX_LOGPROBS}]",
    "how many alternatives per token; 0: the chosen token only",
)
_truncate = _null_minus_one_or_in(
    1,
    INT64_MAX,
    "null, -1 (max_model_len) or an integer >= 1",
    "how many of the prompt's last tokens to keep",
)


def _stop_needs_text(inst: Any, _att: Any, value: Any) -> None:
    boolean(inst, _att, value)
    if not value and inst.stop:
        raise InvalidRequestError(
            "detokenize=False leaves no text for stop strings to match; use stop_token_ids, "
            "or detokenize=True"
        )


def _check_name(name: str, value: Any) -> bool:
    """Whether ``name`` is a vLLM-only field given a value pitstop does anyway (to drop);
    False for a field of :class:`SamplingParams`; any other name raises naming it."""
    if name in VLLM_ONLY:
        if vllm_only_is_neutral(name, value):
            return True
        raise vllm_only_error(name, value)
    known = [a.name for a in attrs.fields(SamplingParams)]
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidRequestError(
            f"{name} is not a SamplingParams field{hint}; the fields: {', '.join(known)}"
        )
    return False


@attrs.frozen(kw_only=True, init=False)
class SamplingParams(engine.SamplingParams):
    """vLLM's ``SamplingParams``: the engine's value (the fields' meaning is documented on
    :class:`pitstop.entrypoints.sampling_params.SamplingParams`), each field checked and
    converted here.

    ``top_k`` 0 or -1 disables top-k (stored as -1). ``seed`` is an int64 (outside it: an
    error, as vLLM answers 400), reduced modulo 2**64 for torch. ``n`` is in [1, 128];
    ``best_of``, if given, must equal ``n`` (pitstop returns every sample it draws).
    ``presence_penalty`` and ``frequency_penalty`` are in [-2, 2], ``repetition_penalty``
    > 0. ``logit_bias`` maps token ids to a bias in [-100, 100]; a key is an int or a string
    of ASCII digits (``"50256"``), and must be in the vocabulary. ``bad_words``: a word of
    one token is blocked always, a longer one blocks its last token after the rest of it.
    ``logprobs`` is null, -1 or at most 20. ``structured_outputs`` is a
    :class:`~pitstop.entrypoints.structured.StructuredOutputs` or a dict of its fields.

    Types are strict: ``True`` is not a number, ``"0.5"`` is not a float, and
    NaN and infinities are refused. Integers are bounded by int64. A vLLM
    field pitstop lacks (:data:`VLLM_ONLY`) or a misspelt one is an
    :class:`InvalidRequestError` naming it, unless its value asks for what
    pitstop does (:data:`VLLM_NEUTRAL`: vLLM's defaults).

    A field may be assigned, as vLLM's examples do (``params.max_tokens = 64``):
    the assignment runs every check construction runs, so an invalid one raises
    the same error and leaves the object as it was. The engine copies the
    parameters of each request it accepts, so a later assignment does not
    change a request already queued.
    """

    n: int = attrs.field(
        default=1, converter=as_int, validator=int_in(1, 128, hint="how many samples to return")
    )
    best_of: int | None = attrs.field(default=None, converter=as_int, validator=_best_of)
    temperature: float = attrs.field(
        default=1.0, converter=as_float, validator=real_in(0, hint="use 0 for greedy decoding")
    )
    top_k: int = attrs.field(
        default=-1,
        converter=_top_k,
        validator=int_in(
            1,
            off=(-1, 0),
            hint="a top_k at or above the vocabulary size keeps every token",
        ),
    )
    top_p: float = attrs.field(
        default=1.0,
        converter=as_float,
        validator=real_in(0, 1, lo_open=True, hint="use 1 to disable top-p"),
    )
    min_p: float = attrs.field(
        default=0.0, converter=as_float, validator=real_in(0, 1, hint="use 0 to disable min-p")
    )
    seed: int | None = attrs.field(default=None, converter=seed_of)
    max_tokens: int | None = attrs.field(
        default=16,
        converter=as_int,
        validator=int_in(
            1, optional=True, hint="ask for at least one token, or null: up to max_model_len"
        ),
    )
    min_tokens: int = attrs.field(
        default=0,
        converter=as_int,
        validator=int_in(0, lambda inst: inst.max_tokens, hint="at most max_tokens"),
    )
    presence_penalty: float = attrs.field(
        default=0.0, converter=as_float, validator=real_in(-2, 2, hint="0 disables it")
    )
    frequency_penalty: float = attrs.field(
        default=0.0, converter=as_float, validator=real_in(-2, 2, hint="0 disables it")
    )
    repetition_penalty: float = attrs.field(
        default=1.0,
        converter=as_float,
        validator=real_in(0, lo_open=True, hint="1 disables it, above 1 discourages repeats"),
    )
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_strings("stop", single=True))
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ids("stop_token_ids"))
    bad_words: tuple[str, ...] = attrs.field(
        default=(), converter=_strings("bad_words", single=False)
    )
    allowed_token_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=_ids("allowed_token_ids", optional=True)
    )
    logits_processors: tuple[Callable[..., Any], ...] = attrs.field(
        default=(), converter=_processors
    )
    include_stop_str_in_output: bool = attrs.field(default=False, validator=boolean)
    ignore_eos: bool = attrs.field(default=False, validator=boolean)
    logprobs: int | None = attrs.field(default=None, converter=as_int, validator=_logprobs)
    prompt_logprobs: int | None = attrs.field(
        default=None,
        converter=as_int,
        validator=int_in(
            0, MAX_LOGPROBS, optional=True, hint="how many alternatives per prompt token"
        ),
    )
    truncate_prompt_tokens: int | None = attrs.field(
        default=None, converter=as_int, validator=_truncate
    )
    detokenize: bool = attrs.field(default=True, validator=_stop_needs_text)
    skip_special_tokens: bool = attrs.field(default=True, validator=boolean)
    spaces_between_special_tokens: bool = attrs.field(default=True, validator=boolean)
    structured_outputs: StructuredOutputs | None = attrs.field(
        default=None, converter=structured_outputs_of
    )

    def __init__(self, **fields: Any) -> None:
        """Every keyword is a field below; a vLLM field pitstop lacks, or a misspelt one, is an
        :class:`InvalidRequestError` naming it (not a bare ``TypeError``)."""
        for name, value in list(fields.items()):
            if _check_name(name, value):
                del fields[name]
        self.__attrs_init__(**fields)


def _assign(self: SamplingParams, name: str, value: Any) -> None:
    """``params.max_tokens = 64``: checked as construction checks it (every field's validator
    and the checks between fields), then stored converted; an invalid value raises and leaves
    the object as it was."""
    if _check_name(name, value):
        return
    checked = attrs.evolve(self, **{name: value})
    object.__setattr__(self, name, getattr(checked, name))


# attrs builds the class frozen (its __init__ stores fields without __setattr__); assignment
# is then opened through the checks above. The values can change, so they are not hashable.
SamplingParams.__setattr__ = _assign  # type: ignore[method-assign,assignment]
SamplingParams.__hash__ = None  # type: ignore[assignment]
