"""The ``standard`` sampler: greedy, temperature, top-k, top-p, min-p, per-request seed.

Semantics follow vLLM. A greedy row (temperature 0) takes the argmax of its raw
logits. A sampled row divides its logits by its temperature, then keeps its
top-k tokens (ties with the k-th kept), then the smallest set of most likely
tokens whose probability reaches top_p (at least one), then drops tokens whose
probability is below ``min_p`` times the largest, renormalizes and draws.

Drawing uses the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)``
picks token ``i`` with probability ``probs[i]``. A row with its own generator
draws its ``q`` from that generator only, so a seeded request's tokens never
depend on what else is in the batch; the other rows share the sampler's own
generator, seeded from ``config.seed``. The softmax runs in float32 whatever
the logits' dtype; everything stays on the logits' device.
"""

from __future__ import annotations

from typing import Any

import torch

from pitstop.hookspecs import hookimpl
from pitstop.protocols import SamplerOutput, SamplingBatch
from pitstop.sampling import exponential_race, make_generator


class StandardSampler:
    """Greedy / temperature / top-k / top-p / min-p sampling with per-row generators."""

    name = "standard"

    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.seed = int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}

    # ------------------------------------------------------------------ public
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of ``logits`` ``[B, V]``; log-probs of the chosen tokens when asked."""
        raw = logits.float()
        greedy_ids = raw.argmax(dim=-1)
        if batch.all_greedy:
            token_ids = greedy_ids
        else:
            probs = self._probs(raw, batch)
            sampled = self._draw(probs, batch)
            token_ids = torch.where(batch.temperature == 0, greedy_ids, sampled)
        logprobs = None
        if batch.want_logprobs:
            logprobs = torch.log_softmax(raw, dim=-1).gather(1, token_ids.unsqueeze(1)).squeeze(1)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def probabilities(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution ``sample`` draws from, ``[B, V]`` float32; one-hot on the argmax for greedy rows."""
        raw = logits.float()
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
