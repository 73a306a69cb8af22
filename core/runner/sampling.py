"""A runner's sampling end: the step's tokens drawn (or its drafts verified) on the device.

:class:`StepSampling` holds what sampling keeps from step to step: the last
launched step's sampled ids in a device buffer (the next step gathers its
pending input tokens from it, by the rows in :attr:`StepSampling.last_rows`),
the seeded sequences' generators (the sampler keeps what its batches need
besides, such as the penalized sequences' token histories), the last step's
sampling batch (a sequence's parameters never change, so
the same rows need no new host-to-device copies) and the pinned host
buffers the tokens come back through.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pitstop.ground.poison import nan_rows_of, poison_
from pitstop.ground.step import SeqInput
from pitstop.plugin_system.protocols import Sampler, SamplerBase
from pitstop.plugin_system.sampler import make_generator
from pitstop.requests.sampling_params import SamplingParams
from pitstop.runner.launched import LaunchedStep, LaunchedVerification, to_host

if TYPE_CHECKING:
    from pitstop.ground.step import PromptLogprobs
    from pitstop.plugin_system.protocols import SamplerOutput
    from pitstop.plugin_system.verifier import Verifier

GeneratorOf = Callable[[int, SamplingParams], "torch.Generator | None"]


class SampleSharing(Protocol):
    """Where a step's sampled ids go besides this rank: nowhere, or every tensor-parallel rank."""

    def share_samples(self, tokens: torch.Tensor) -> None:
        """Make ``tokens`` (rank 0's sampled ids) every rank's (in place)."""


class StepSampling:
    """Samples a runner's steps and keeps the state that lives from one step to the next."""

    def __init__(self, sampler: Sampler, device: torch.device, rows: int, *, poison: bool) -> None:
        self.sampler, self.device = sampler, device
        self.generators: dict[int, torch.Generator] = {}
        # the verifier plugin (speculative_verifier=NAME), set by the engine when it speculates
        self.verifier: Verifier | None = None
        # The last step's sampling rows (seq ids) and their batch.
        self.batch_cache: tuple[tuple[int, ...], Any] | None = None
        # The last launched step's sampled ids stay here on the device; the next step gathers
        # its pending input tokens from it (``last_rows``: seq id -> row).
        self.last_sampled = torch.zeros(rows, dtype=torch.int64, device=device)
        self.last_rows: dict[int, int] = {}
        # Pinned host buffers for the sampled ids (and log-probs), two so that the copy of
        # step N+1 never overwrites step N's before the host has read it.
        pin = device.type == "cuda"
        self._host_tokens = [torch.zeros(rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._host_logprobs = [
            torch.zeros(rows, dtype=torch.float32, pin_memory=pin) for _ in range(2)
        ]
        self._flip = 0
        self.poison = poison
        if poison:
            for buffer in (self.last_sampled, *self._host_tokens, *self._host_logprobs):
                poison_(buffer)

    def generator(self, seq_id: int, params: SamplingParams) -> torch.Generator | None:
        """The generator of a seeded, non-greedy sequence (made at its first step); else None."""
        if params.seed is None or params.greedy:
            return None
        gen = self.generators.get(seq_id)
        if gen is None:
            gen = self.generators[seq_id] = make_generator(params.seed, self.device)
        return gen

    def forget(self, gone: set[int]) -> None:
        """Drop the generators, cached batch and rows of sequences that are gone (and tell the
        sampler, which drops what it keeps of them)."""
        for seq_id in gone:
            self.generators.pop(seq_id, None)
        SamplerBase.of(self.sampler, "forget")(list(gone))
        if self.batch_cache is not None and gone.intersection(self.batch_cache[0]):
            self.batch_cache = None
        if gone.intersection(self.last_rows):
            self.last_rows = {k: v for k, v in self.last_rows.items() if k not in gone}

    def pending_row(self, seq_id: int) -> int:
        """The row of ``seq_id`` in the last launched step's samples (its pending token's value)."""
        row = self.last_rows.get(seq_id)
        if row is None:
            raise RuntimeError(
                f"sequence {seq_id} has a pending token but did not sample in the last launched step"
            )
        return row

    def save(self) -> tuple[torch.Tensor, dict[int, int]]:
        """A copy of the last launched step's samples (to rerun parts of a failed step)."""
        return self.last_sampled.clone(), dict(self.last_rows)

    def restore(self, saved: tuple[torch.Tensor, dict[int, int]]) -> None:
        """Put back what :meth:`save` copied."""
        self.last_sampled.copy_(saved[0])
        self.last_rows = dict(saved[1])

    def adopt(self, sampled: Seq[tuple[int, int]]) -> None:
        """Make ``(seq_id, token)`` pairs the last step's samples (after a step was rerun in parts)."""
        self.last_rows = {seq_id: i for i, (seq_id, _) in enumerate(sampled)}
        if sampled:
            values = torch.tensor([t for _, t in sampled], dtype=torch.int64)
            self.last_sampled[: len(sampled)].copy_(values.to(self.device))

    def sample(
        self,
        seqs: list[SeqInput],
        logits: torch.Tensor,
        generator_of: GeneratorOf,
        sharing: SampleSharing,
        *,
        prompt: dict[int, PromptLogprobs] | None = None,
        nan_rows: torch.Tensor | None = None,
    ) -> LaunchedStep:
        """Sample one token per sampling sequence; the tokens start home without a wait.

        ``logits`` has one row per sampling sequence of ``seqs``, in order;
        ``prompt`` (prompt log-probabilities) and ``nan_rows`` (poisoned rows)
        go to the handle. The ids are shared (tensor parallelism) even if sampling failed:
        the other ranks wait for them.
        """
        sampling = [s for s in seqs if s.sample]
        n = len(sampling)
        try:
            out = self._draw(sampling, logits, generator_of)
            self.last_sampled[:n].copy_(out.token_ids)
        finally:
            sharing.share_samples(self.last_sampled[:n])
        self.last_rows = {s.seq_id: i for i, s in enumerate(sampling)}
        return self._send_home(seqs, n, out, prompt, nan_rows)

    def _draw(
        self, sampling: list[SeqInput], logits: torch.Tensor, generator_of: GeneratorOf
    ) -> SamplerOutput:
        """The sampler over the step's batch (cached while the rows stay the same)."""
        params = [s.params or SamplingParams() for s in sampling]
        generators = [generator_of(s.seq_id, p) for s, p in zip(sampling, params, strict=True)]
        key = tuple(s.seq_id for s in sampling)
        if self.batch_cache is not None and self.batch_cache[0] == key:
            batch = self.batch_cache[1]  # same rows as last step: no host-to-device copies
        else:
            batch = self.sampler.make_batch(params, generators)
            self.batch_cache = (key, batch)
        row_inputs = [s.row_inputs for s in sampling]
        if any(r is not None for r in row_inputs):
            pending = [self.last_rows.get(s.seq_id, 0) for s in sampling]
            batch = SamplerBase.of(self.sampler, "add_step_inputs")(
                batch,
                row_inputs,
                pending,
                self.last_sampled,
                logits.shape[-1],
                [s.seq_id for s in sampling],
            )
        return self.sampler.sample(logits, batch)

    def _send_home(
        self,
        seqs: list[SeqInput],
        n: int,
        out: SamplerOutput,
        prompt: dict[int, PromptLogprobs] | None,
        nan_rows: torch.Tensor | None,
    ) -> LaunchedStep:
        """Start the copies of the ``n`` sampled ids (and log-probabilities) to pinned host memory."""
        self._flip ^= 1
        host_tokens = self._host_tokens[self._flip][:n]
        host_tokens.copy_(out.token_ids, non_blocking=True)
        host_logprobs = None
        if out.logprobs is not None:
            host_logprobs = self._host_logprobs[self._flip][:n]
            host_logprobs.copy_(out.logprobs, non_blocking=True)
        top = None
        if out.ranks is not None:
            top = (to_host(out.top_ids), to_host(out.top_logprobs), to_host(out.ranks))
        nonfinite = to_host(nan_rows)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return LaunchedStep(
            seqs, host_tokens, host_logprobs, event, top=top, prompt=prompt, nonfinite=nonfinite
        )

    def verify(
        self, seqs: list[SeqInput], logits: torch.Tensor, generator_of: GeneratorOf
    ) -> LaunchedStep:
        """Verify the drafts of a step on the device; its results come back in one copy.

        ``logits`` holds ``num_logits`` rows per sampling sequence, in order.
        Nothing of this step is pending afterwards: the engine applies a
        verification before it launches the next step.
        """
        sampling = [s for s in seqs if s.sample]
        params = [s.params or SamplingParams() for s in sampling]
        generators = [generator_of(s.seq_id, p) for s, p in zip(sampling, params, strict=True)]
        if self.verifier is None:
            raise RuntimeError(
                "a step verifies drafts, but no verifier was built (speculative=None)"
            )
        self.last_rows = {}
        nonfinite = to_host(nan_rows_of(logits)) if self.poison else None
        return LaunchedVerification(seqs, self.verifier(logits, sampling, generators), nonfinite)
