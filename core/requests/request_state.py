"""What the engine tracks per request and per sample, and how a sample's tokens become text.

A request with ``n`` samples has one :class:`RequestState` and ``n``
:class:`SampleState` (one :class:`~pitstop.requests.sequence.Sequence` each, all
with the same prompt). :func:`accept_token` applies one sampled token to a
sample: the grammar, the stop conditions (EOS, ``stop_token_ids``, stop
strings, ``min_tokens``, length), the text and the log-probabilities.
:meth:`RequestState.output` builds the :class:`~pitstop.requests.outputs.RequestOutput`
with each sample's delta since the last output.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import attrs

from pitstop.requests.detokenizer import IncrementalDetokenizer
from pitstop.requests.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from pitstop.requests.sampling_params import SamplingParams
from pitstop.requests.sequence import Sequence

if TYPE_CHECKING:
    from pitstop.plugin_system.grammar import GrammarMatcher


@attrs.define(eq=False)
class SampleState:
    """One sample: its sequence, text, log-probabilities, grammar and what is not yet emitted."""

    index: int
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    request_id: str = ""
    grammar: GrammarMatcher | None = None
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None
    prepared: Any = None  # what the sampler prepared for the request (Sampler.prepare_request)
    delta: str = ""  # text since the last output
    new_ids: list[int] = attrs.Factory(list)  # tokens since the last output
    # penalties, min_tokens, a grammar, allowed_token_ids or host tokens: the sampler's row inputs
    uses_processors: bool = False
    # tokens whose text is not decoded yet: without stop strings nothing reads the text
    # between outputs, so it is decoded when an output is taken (or the sample ends), not
    # twice a token a step (the incremental detokenizer's two windows)
    undecoded: list[int] = attrs.Factory(list)

    def decode_pending(self) -> None:
        """Turn the tokens not decoded yet into text (appended to ``text`` and ``delta``)."""
        if self.undecoded and self.detokenizer is not None:
            self.add_text(self.detokenizer.step(self.undecoded))
        self.undecoded = []

    def end_text(self) -> None:
        """The sample ends: decode what is pending, then release what the detokenizer held
        back (an incomplete character)."""
        assert self.detokenizer is not None
        self.decode_pending()
        self.add_text(self.detokenizer.flush())

    def add_text(self, delta: str) -> None:
        """Append ``delta`` to the sample's text and to its text since the last output."""
        self.text += delta
        self.delta += delta

    def take_output(self) -> CompletionOutput:
        """This sample's output, with the delta since the last one (which is then cleared)."""
        self.decode_pending()
        seq = self.seq
        out = CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=seq.output_token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=seq.finish_reason if seq.is_finished else None,
            stop_reason=self.stop_reason,
            text_delta=self.delta,
            new_token_ids=self.new_ids,
        )
        self.delta, self.new_ids = "", []
        return out


@attrs.define(eq=False)
class RequestState:
    """A request: its prompt, its samples, and the samples held back until the prompt is cached."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    held_back: list[Sequence] = attrs.Factory(list)
    # prompt_logprobs: entry j for prompt token j (None for the first), filled as chunks compute
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add_prompt_logprobs(
        self,
        start_pos: int,
        entries: list[tuple[float, int, list[tuple[int, float]]]],
        decode: Callable[[int], str | None],
    ) -> None:
        """Record the prompt log-probabilities a chunk starting at ``start_pos`` computed.

        Entry ``i`` is for prompt token ``start_pos + 1 + i``; a chunk computed
        again after a preemption adds nothing new.
        """
        assert self.prompt_logprobs is not None
        for i, (logprob, rank, top) in enumerate(entries):
            position = start_pos + 1 + i
            if position == len(self.prompt_logprobs):
                token = self.prompt_token_ids[position]
                self.prompt_logprobs.append(token_logprobs(token, logprob, rank, top, decode))

    @property
    def finished(self) -> bool:
        """Whether every sample has stopped."""
        return all(s.seq.is_finished for s in self.samples)

    def output(self, error: str | None = None) -> RequestOutput:
        """The request's output now; per-request timings only once finished (they cost O(tokens))."""
        finished = self.finished
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.take_output() for s in self.samples],
            finished=finished,
            prompt_logprobs=list(self.prompt_logprobs)
            if self.prompt_logprobs is not None
            else None,
            metrics=self._metrics() if finished else None,
            error=error,
            num_cached_tokens=self.samples[0].seq.num_cached_prompt_tokens,
        )

    def _metrics(self) -> RequestMetrics:
        first = self.samples[0].seq
        ts = first.timestamps
        finishes = [s.seq.timestamps.finish for s in self.samples if s.seq.timestamps.finish]
        return RequestMetrics(
            arrival=ts.arrival,
            first_scheduled=ts.first_scheduled,
            first_token=ts.first_token,
            finish=max(finishes) if finishes else ts.finish,
            token_times=tuple(ts.tokens),
            num_prompt_tokens=first.num_prompt_tokens,
            num_cached_prompt_tokens=first.num_cached_prompt_tokens,
            num_preemptions=sum(s.seq.num_preemptions for s in self.samples),
        )


def token_logprobs(
    token: int,
    logprob: float,
    rank: int | None,
    top: list[tuple[int, float]],
    decode: Callable[[int], str | None],
) -> TokenLogprobs:
    """One position's :data:`TokenLogprobs`: the chosen token (with its rank) and the top ones."""
    out = {tid: Logprob(lp, i + 1, decode(tid)) for i, (tid, lp) in enumerate(top)}
    if token not in out:
        out[token] = Logprob(logprob, rank, decode(token))
    return out


def accept_token(
    sample: SampleState,
    token: int,
    *,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> None:
    """Apply one sampled token: grammar, stop conditions and text; the sequence may finish.

    EOS (unless ``ignore_eos``) and ``stop_token_ids`` stop with reason
    ``"stop"`` (the EOS or stop token's text is left out of the text unless
    ``include_stop_str_in_output``, as vLLM's detokenizer does, whatever
    ``skip_special_tokens`` says); so does a stop string (cut from the text unless
    ``include_stop_str_in_output``) and a grammar that is complete. None of
    these stops a sample before ``min_tokens`` tokens (the sampler also masks
    EOS and the stop tokens until then). Reaching ``max_tokens`` or
    ``max_model_len`` stops with ``"length"``.
    """
    seq, params = sample.seq, sample.seq.sampling_params
    sample.new_ids.append(token)
    if sample.grammar is not None:
        sample.grammar.accept(token)
    num_known = seq.num_output_tokens - seq.num_pending_tokens
    may_stop = num_known >= params.min_tokens
    reason = None
    stop_token = False  # stopped by EOS or one of stop_token_ids: its text stays out unless asked
    if may_stop and token in params.stop_token_ids:
        reason, sample.stop_reason, stop_token = "stop", token, True
    elif may_stop and not params.ignore_eos and token in eos_token_ids:
        reason, stop_token = "stop", True
    elif sample.grammar is not None and sample.grammar.is_finished:
        reason = "stop"
    elif (
        params.max_tokens is not None and num_known >= params.max_tokens
    ) or seq.num_tokens - seq.num_pending_tokens >= max_model_len:
        reason = "length"
    if sample.detokenizer is not None:
        if stop_token and not params.include_stop_str_in_output:
            sample.end_text()  # the text before the stop token, not its own
        elif not params.stop:  # no stop string reads the text: decode it when it is taken
            sample.undecoded.append(token)
            if reason is not None:
                sample.end_text()
        else:
            delta = sample.detokenizer.step([token])
            if delta and may_stop:
                text = sample.text + delta
                # a stop string may straddle the previous delta: search its tail too
                begin = max(0, len(sample.text) - max(len(s) for s in params.stop) + 1)
                hits = [(i, s) for s in params.stop if (i := text.find(s, begin)) != -1]
                if hits:
                    cut, stop = min(hits)
                    end = cut + len(stop) if params.include_stop_str_in_output else cut
                    sample.delta += text[len(sample.text) : end] if end > len(sample.text) else ""
                    sample.text = text[:end]
                    sample.stop_reason = stop
                    seq.finish("stop")
                    return
            sample.add_text(delta)
            if reason is not None:
                sample.end_text()
    if reason is not None:
        seq.finish(reason)
