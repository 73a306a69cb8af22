"""The engine's sampling parameters of one request: a plain value, checked before it gets here.

:class:`SamplingParams` holds what the engine reads when it samples and stops a request,
each field already in its resolved form (``top_k`` off is -1, ``logit_bias`` a sorted tuple
of ``(token_id, bias)``, a seed in ``[0, 2**64)``). The public class users build,
:class:`pitstop.SamplingParams` (:mod:`pitstop.entrypoints.sampling_params`), is this value
with vLLM's surface: every field converted and checked when it is built or assigned, vLLM's
fields that pitstop lacks refused by name. The engine takes either; what it checks itself
needs the model (:func:`pitstop.requests.validation.validate_request`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import attrs

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's convention)."""


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to turn a request's logits into tokens, and when to stop (vLLM's fields).

    ``temperature=0`` is greedy decoding; ``top_k=-1``, ``top_p=1`` and ``min_p=0`` disable
    their filters. ``seed`` makes one request's sampling repeatable whatever else is in the
    batch. ``n`` samples per prompt; ``max_tokens=None`` generates up to ``max_model_len``
    (prompt included); ``min_tokens`` forbids EOS and ``stop_token_ids`` until that many
    tokens were generated. ``presence_penalty`` and ``frequency_penalty`` subtract from the
    logit of every token already generated, once or per occurrence; ``repetition_penalty``
    (1 = off) divides a positive logit (multiplies a negative one) of every token in the
    prompt or output. ``logit_bias`` adds a bias to the logits of its token ids;
    ``allowed_token_ids`` restricts every generated token to those ids; ``bad_words`` are
    never generated; ``logits_processors`` are callables ``fn(output_token_ids, logits)`` or
    ``fn(prompt_token_ids, output_token_ids, logits)`` run after pitstop's own processors.

    ``logprobs=k`` returns, per generated token, the log-probabilities of the ``k`` most
    likely tokens and of the chosen one (-1: the whole vocabulary); ``prompt_logprobs=k``
    the same for each prompt token after the first. ``truncate_prompt_tokens=k`` keeps the
    prompt's last ``k`` tokens (-1: the last ``max_model_len``). ``detokenize=False`` leaves
    ``text`` empty; ``skip_special_tokens`` and ``spaces_between_special_tokens`` shape the
    text; ``include_stop_str_in_output`` keeps a matched stop string, or a stop token's text.
    ``structured_outputs`` (a :class:`pitstop.StructuredOutputs`) constrains the text; the
    engine's grammar backend compiles it.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    logits_processors: tuple[Callable[..., Any], ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: Any = None

    def clone(self) -> SamplingParams:
        """A copy (vLLM's ``clone()``): the same values; logits processors and the structured
        output (both immutable here or the caller's) shared, not copied."""
        return copy.copy(self)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature below :data:`SAMPLING_EPS`
        (0, or near enough that vLLM treats it as 0) or top_k 1. The one definition:
        the sampling batch, the runner and speculative decoding all ask this."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def needs_host_tokens(self) -> bool:
        """Whether a processor of this request reads its tokens on the host each step
        (``bad_words``, ``logits_processors``): the overlapped loop then applies the step
        in flight before it plans the next."""
        return bool(self.bad_words or self.logits_processors)

    @property
    def needs_penalties(self) -> bool:
        """Whether a presence, frequency or repetition penalty is set."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )
