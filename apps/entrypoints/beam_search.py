"""Beam search as vLLM's ``LLM.beam_search``, built on the engine's log-probabilities.

vLLM runs beam search outside the engine: each step submits every live beam
as a prompt for one token with ``logprobs=2 * beam_width`` (the
``transformers`` rule: twice the width, so that beams ending in EOS leave
enough to continue), extends each beam by each of those tokens, moves the
candidates ending in EOS to the finished ones (unless ``ignore_eos``) and
keeps the ``beam_width`` best of the rest by
:func:`get_beam_search_score`. After ``max_tokens`` steps the finished and
the live beams are ranked together and the best ``beam_width`` returned.
pitstop does the same with :meth:`pitstop.entrypoints.llm.LLM.generate`, so beam search
runs under any allocator and scheduler (``allocator="prefix"`` reuses each
beam's cached prompt instead of recomputing it every step).

As in vLLM, a sequence's ``tokens`` are the prompt's followed by the
generated ones, its ``text`` their decoded text (special tokens kept), and
``cum_logprob`` the sum of the generated tokens' log-probabilities (of the
raw logits; ``temperature`` only changes which extra sampled token a step
may add). A finished beam's EOS text is left out of ``text`` unless
``include_stop_str_in_output`` (vLLM's server does this; its offline
``LLM.beam_search`` ignores the flag). Every EOS id of the model ends a beam.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from pitstop.entrypoints.inputs import PromptType, parse_prompts
from pitstop.entrypoints.sampling_params import MAX_LOGPROBS, SamplingParams
from pitstop.entrypoints.validation import as_float, as_int, boolean, int_in, real_in
from pitstop.errors import InvalidRequestError
from pitstop.requests.outputs import Logprob


class Generator(Protocol):
    """What beam search needs of an offline engine (:class:`pitstop.entrypoints.llm.LLM` is one): its
    engine (tokenizer), its config (``max_model_len``) and ``generate``."""

    engine: Any
    config: Any

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`pitstop.entrypoints.llm.LLM.generate`."""
        ...


MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
"""The widest beam: each step asks for ``2 * beam_width`` log-probabilities, at most 20
(as vLLM's default ``max_logprobs``)."""


@attrs.frozen(kw_only=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``BeamSearchParams(beam_width=4, max_tokens=32)``.

    ``beam_width`` in [1, 10] beams are kept (and returned); each grows by at
    most ``max_tokens`` tokens; ``ignore_eos`` keeps a beam going past EOS;
    ``temperature`` is that of each step's one sampled token (0: greedy);
    ``length_penalty`` divides a sequence's ``cum_logprob`` by its length
    (prompt included, EOS not) to that power when ranking;
    ``include_stop_str_in_output`` keeps a finished beam's EOS text in
    ``text``. Values are checked as :class:`SamplingParams` checks them.
    """

    beam_width: int = attrs.field(
        converter=as_int,
        validator=int_in(1, MAX_BEAM_WIDTH, hint="each step asks for 2 * beam_width logprobs"),
    )
    max_tokens: int = attrs.field(
        converter=as_int, validator=int_in(1, hint="ask for at least one token")
    )
    ignore_eos: bool = attrs.field(default=False, validator=boolean)
    temperature: float = attrs.field(
        default=0.0, converter=as_float, validator=real_in(0, hint="use 0 for greedy steps")
    )
    length_penalty: float = attrs.field(
        default=1.0,
        converter=as_float,
        validator=real_in(-10, 10, hint="1 divides by the length, 0 not at all"),
    )
    include_stop_str_in_output: bool = attrs.field(default=False, validator=boolean)


@attrs.define
class BeamSearchSequence:
    """One beam, as vLLM's: ``tokens`` (the prompt's, then the generated ones), one
    ``{token_id: Logprob}`` per generated token, their summed log-probability, and, once
    returned, its ``text``, ``finish_reason`` ("stop" at EOS, "length" otherwise) and
    ``stop_reason`` (None: EOS is not a stop string or a stop token id)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = attrs.field(factory=list)
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finish(self, reason: str, text: str) -> None:
        """Mark this beam returned: why it ended ("stop" or "length") and its decoded text."""
        self.finish_reason = reason
        self.text = text


@attrs.define
class BeamSearchOutput:
    """The best sequences of one prompt (at most ``beam_width``), best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: Sequence[int], cumulative_logprob: float, eos_token_id: int, length_penalty: float = 1.0
) -> float:
    """vLLM's (and ``transformers``') score: ``cum_logprob / length ** length_penalty``, the
    length counting the prompt and not a final EOS."""
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cumulative_logprob / (length**length_penalty)


def beam_search(llm: Generator, prompts: Any, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run :class:`BeamSearchParams` over ``prompts`` (one prompt or a list, in any form
    ``generate`` takes) on ``llm``; one :class:`BeamSearchOutput` per prompt, in order."""
    if not isinstance(params, BeamSearchParams):
        raise InvalidRequestError(
            f"beam_search takes BeamSearchParams(beam_width=..., max_tokens=...), got "
            f"{type(params).__name__}"
        )
    tokenizer = llm.engine.tokenizer
    if tokenizer is None:
        raise InvalidRequestError("beam_search decodes its beams: the model needs a tokenizer")
    eos = set(tokenizer.eos_token_ids)
    score = _scorer(eos, params.length_penalty)
    step = SamplingParams(
        logprobs=2 * params.beam_width,
        max_tokens=1,
        temperature=params.temperature,
        detokenize=False,
    )
    limit = llm.config.max_model_len
    assert limit is not None
    searches = [_Search(ids) for ids in _prompt_ids(llm, prompts, limit)]
    for _ in range(params.max_tokens):
        for s in searches:
            s.retire_full(limit)
        live = [(s, beam) for s in searches for beam in s.beams]
        if not live:
            break
        outs = llm.generate(
            [{"prompt_token_ids": beam.tokens} for _, beam in live], step, use_tqdm=False
        )
        grown: dict[int, list[BeamSearchSequence]] = {id(s): [] for s in searches}
        for (s, beam), out in zip(live, outs, strict=True):
            grown[id(s)] += s.extend(beam, out.outputs[0].logprobs[0], eos, params.ignore_eos)
        for s in searches:
            s.beams = sorted(grown[id(s)], key=score, reverse=True)[: params.beam_width]
    return [s.result(params, score, tokenizer, eos) for s in searches]


class _Search:
    """The live and finished beams of one prompt."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.beams = [BeamSearchSequence(tokens=list(prompt_ids))]
        self.completed: list[BeamSearchSequence] = []

    def retire_full(self, max_model_len: int) -> None:
        """Finish the beams that fill ``max_model_len``: no token fits after them."""
        full = [b for b in self.beams if len(b.tokens) >= max_model_len]
        self.completed += full
        self.beams = [b for b in self.beams if len(b.tokens) < max_model_len]

    def extend(
        self,
        beam: BeamSearchSequence,
        candidates: dict[int, Logprob],
        eos: set[int],
        ignore_eos: bool,
    ) -> list[BeamSearchSequence]:
        """``beam`` grown by each candidate token; those ending in EOS go to ``completed``."""
        grown = []
        for token_id, logprob in candidates.items():
            new = BeamSearchSequence(
                tokens=[*beam.tokens, token_id],
                logprobs=[*beam.logprobs, candidates],
                cum_logprob=beam.cum_logprob + logprob.logprob,
            )
            if token_id in eos and not ignore_eos:
                self.completed.append(new)
            else:
                grown.append(new)
        return grown

    def result(
        self,
        params: BeamSearchParams,
        score: Callable[[BeamSearchSequence], float],
        tokenizer: Any,
        eos: set[int],
    ) -> BeamSearchOutput:
        """The best ``beam_width`` of the finished and live beams, their text decoded."""
        ranked = sorted(self.completed + self.beams, key=score, reverse=True)
        best = ranked[: params.beam_width]
        for beam in best:
            stopped = not params.ignore_eos and beam.tokens[-1] in eos and bool(beam.logprobs)
            shown = (
                beam.tokens[:-1]
                if stopped and not params.include_stop_str_in_output
                else beam.tokens
            )
            text = tokenizer.hf.decode(shown, skip_special_tokens=False)
            beam.finish("stop" if stopped else "length", text)
        return BeamSearchOutput(sequences=best)


def _scorer(eos: set[int], length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    def key(beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (1 if beam.logprobs and beam.tokens[-1] in eos else 0)
        return beam.cum_logprob / (length**length_penalty)

    return key


def _prompt_ids(
    llm: Generator, prompts: PromptType | Sequence[PromptType], max_model_len: int
) -> list[list[int]]:
    """Each prompt's token ids (text is encoded as ``generate`` encodes it); a prompt that
    leaves no room for a token raises before any step runs."""
    ids = []
    for i, (text, tokens) in enumerate(parse_prompts(prompts)):
        if tokens is None:
            assert text is not None and llm.engine.tokenizer is not None
            tokens = llm.engine.tokenizer.encode(text)
        if not 0 < len(tokens) < max_model_len:
            raise InvalidRequestError(
                f"beam_search prompt {i} has {len(tokens)} tokens; give at least one and fewer "
                f"than max_model_len={max_model_len}"
            )
        ids.append([int(t) for t in tokens])
    return ids
