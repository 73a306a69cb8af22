"""The ``standard`` sampler: logits processors, then greedy, temperature, top-k, top-p, min-p.

Semantics follow vLLM. First the logits processors, batched over the rows
that use them (each a few tensor ops on the device, no loop over rows): the
structured-output bitmask (disallowed tokens to -inf), ``logit_bias``
(added), ``min_tokens`` (EOS and stop tokens to -inf), the repetition
penalty (a positive logit of a token seen in the prompt or output is divided
by it, a negative one multiplied), then the frequency and presence penalties
(minus ``frequency * count + presence * [count > 0]`` over output tokens).
A greedy row (temperature 0) takes the argmax of its raw
logits (a batch of greedy rows with no processor and no log-probabilities
takes it on the logits in their own dtype: the same token, no float32 copy). A sampled row divides its logits by its temperature, then keeps its
top-k tokens (ties with the k-th kept), then the smallest set of most likely
tokens whose probability reaches top_p (at least one), then drops tokens whose
probability is below ``min_p`` times the largest, renormalizes and draws.

Drawing uses the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)``
picks token ``i`` with probability ``probs[i]``. A row with its own generator
draws its ``q`` from that generator only, so a seeded request's tokens never
depend on what else is in the batch; the other rows share the sampler's own
generator, seeded from ``config.seed``. The softmax runs in float32 whatever
the logits' dtype; everything stays on the logits' device.

Log-probabilities (``logprobs=k``) are those of the processed logits (after
the processors, before temperature and the top-k/top-p/min-p filters): the
chosen token's, its rank, and the ``k`` most likely tokens'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pitstop.plugin_system.hookspecs import hookimpl
from pitstop.plugin_system.sampler import RowInputs, SamplerOutput, make_generator
from pitstop.plugins.samplers.bad_words import bad_word_token_ids
from pitstop.plugins.samplers.batch import (
    SamplingBatch,
    TokenHistories,
    make_sampling_batch,
    make_step_inputs,
)
from pitstop.plugins.samplers.draws import exponential_race
from pitstop.plugins.samplers.logprobs import prompt_logprobs
from pitstop.plugins.samplers.processors import apply_logits_processors, uses_logits_processors
from pitstop.requests.sampling_params import SamplingParams


class StandardSampler:
    """Greedy / temperature / top-k / top-p / min-p sampling with per-row generators."""

    name = "standard"

    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.seed = int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}
        self.histories = TokenHistories()  # penalized sequences' tokens, grown step by step

    # ------------------------------------------------------------------ public
    def prepare_request(self, params: SamplingParams, tokenizer: Any) -> Any:
        """The request's ``bad_words`` as token sequences (:func:`pitstop.plugins.samplers.bad_words.bad_word_token_ids`), or None."""
        return bad_word_token_ids(tokenizer, params.bad_words) if params.bad_words else None

    def make_batch(
        self, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
    ) -> SamplingBatch:
        """The rows' settings on this sampler's device (:func:`pitstop.plugins.samplers.batch.make_sampling_batch`)."""
        return make_sampling_batch(params, generators, self.device)

    def add_step_inputs(
        self,
        batch: SamplingBatch,
        rows: Sequence[RowInputs | None],
        pending_rows: Sequence[int],
        last_sampled: torch.Tensor,
        vocab_size: int,
        seq_ids: Sequence[int],
    ) -> SamplingBatch:
        """This step's per-row tensors (:func:`pitstop.plugins.samplers.batch.make_step_inputs`),
        each penalized sequence's tokens copied once into :attr:`histories`."""
        return make_step_inputs(
            batch,
            rows,
            pending_rows,
            last_sampled,
            vocab_size,
            seq_ids=seq_ids,
            histories=self.histories,
        )

    def forget(self, seq_ids: Sequence[int]) -> None:
        """Drop the token histories of sequences that are gone."""
        self.histories.forget(seq_ids)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of ``logits`` ``[B, V]``; log-probs of the chosen tokens when asked."""
        if batch.all_greedy and not batch.want_logprobs and not uses_logits_processors(batch):
            # the argmax of the logits as they are: widening to float32 is exact and keeps the
            # order, so it picks the same token, without a float32 copy of [B, V] to write and
            # read (at nano's batch 256 the copy and a float32 argmax took 177 µs a step)
            return SamplerOutput(token_ids=logits.argmax(dim=-1))
        raw = self.process(logits.float(), batch)
        if batch.all_greedy:
            token_ids = raw.argmax(dim=-1)
        else:
            probs = self._probs(raw, batch)
            token_ids = self._draw(probs, batch)
            if batch.any_greedy:  # no argmax over [B, V] where no row needs it
                token_ids = torch.where(batch.temperature == 0, raw.argmax(dim=-1), token_ids)
        if not batch.want_logprobs:
            return SamplerOutput(token_ids=token_ids)
        all_logprobs = torch.log_softmax(raw, dim=-1)
        chosen = all_logprobs.gather(1, token_ids.unsqueeze(1))
        ranks = (all_logprobs > chosen).sum(dim=-1) + 1
        top_ids = top_logprobs = None
        k = all_logprobs.shape[-1] if batch.max_logprobs < 0 else batch.max_logprobs  # -1: all
        if k > 0:
            top_logprobs, top_ids = all_logprobs.topk(k, dim=-1)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=chosen.squeeze(1),
            top_ids=top_ids,
            top_logprobs=top_logprobs,
            ranks=ranks,
        )

    # The engine sends penalties, logit_bias, min_tokens, grammars and logprobs=k only to a
    # sampler that says it applies them (a third-party sampler that does not is refused them).
    supports_logits_processors = True
    # prompt log-probabilities, of the model's logits as they are (vLLM's)
    prompt_logprobs = staticmethod(prompt_logprobs)

    @staticmethod
    def process(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The logits processors over float32 ``[B, V]`` (:func:`pitstop.plugins.samplers.processors.apply_logits_processors`)."""
        return apply_logits_processors(raw, batch)

    def probabilities(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution ``sample`` draws from, ``[B, V]`` float32; one-hot on the argmax for greedy rows."""
        raw = self.process(logits.float(), batch)
        one_hot = torch.zeros_like(raw).scatter_(1, raw.argmax(dim=-1, keepdim=True), 1.0)
        if batch.all_greedy:
            return one_hot
        probs = self._probs(raw, batch)
        return torch.where((batch.temperature == 0).unsqueeze(1), one_hot, probs)

    # ------------------------------------------------------------------ internals
    def _probs(self, raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Temperature, then top-k, top-p, min-p; the renormalized float32 probabilities."""
        temperature = batch.temperature.to(raw.device, torch.float32)
        # Greedy rows are replaced by their argmax later; divide them by 1, not 0.
        temperature = torch.where(temperature == 0, torch.ones_like(temperature), temperature)
        scaled = raw / temperature.unsqueeze(1)
        if batch.needs_top_k or batch.needs_top_p:
            scaled = self._top_k_top_p(scaled, batch)
        if batch.needs_min_p:
            probs = torch.softmax(scaled, dim=-1)
            min_p = batch.min_p.to(raw.device, torch.float32).unsqueeze(1)
            threshold = min_p * probs.max(dim=-1, keepdim=True).values
            scaled = scaled.masked_fill(probs < threshold, float("-inf"))
        return torch.softmax(scaled, dim=-1)

    @staticmethod
    def _top_k_top_p(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Mask (to -inf) what top-k and then top-p exclude, with one descending sort."""
        vocab = scaled.shape[-1]
        k = None
        if batch.needs_top_k:
            k = batch.top_k.to(scaled.device)
            k = torch.where(k < 1, torch.full_like(k, vocab), k.clamp(max=vocab))
            if not batch.needs_top_p:
                # Top-k alone: the k-th value comes from a partial top-k, no full sort.
                # the host knows the largest k: reading it off the device would be a sync
                kmax = min(vocab, batch.max_top_k) if batch.max_top_k >= 1 else vocab
                kth = scaled.topk(kmax, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
                return scaled.masked_fill(scaled < kth, float("-inf"))
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        if k is not None:
            kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if batch.needs_top_p:
            top_p = batch.top_p.to(scaled.device, torch.float32).unsqueeze(1)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
            # Keep a token while the tokens before it have not reached top_p (the first always).
            drop = (before >= top_p) & (top_p < 1.0)
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(scaled).scatter_(1, order, sorted_logits)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator of rows without their own, one per device, seeded from the config."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = make_generator(self.seed, device)
        return generator

    def _draw(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token per row from ``probs`` by the exponential race, each row from its own generator."""
        return exponential_race(probs, batch.generators, self._shared_generator(probs.device))


def create_standard_sampler(config: Any, device: torch.device | str) -> StandardSampler:
    """Greedy / temperature / top-k / top-p / min-p, per-request seed (vLLM semantics)."""
    return StandardSampler(device, seed=getattr(config, "seed", 0))


@hookimpl
def register_samplers(register: Any) -> None:
    """Register the ``standard`` sampler."""
    register("standard", create_standard_sampler)
