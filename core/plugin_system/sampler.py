"""What a sampler (the ``sampler`` kind) provides, what it is handed and what it returns.

The sampler builds its own batch of a step's rows (:meth:`Sampler.make_batch`:
the rows' :class:`SamplingParams` and seeded generators, made by the runner with
:func:`make_generator` and kept for a request's whole life, so that its draws
continue where the previous step stopped) and adds to it what changes every step
(:meth:`~pitstop.plugin_system.protocols.SamplerBase.add_step_inputs`: each row's
:class:`RowInputs`, built by the engine); the runner hands the batch back to
:meth:`Sampler.sample` and never reads it (the standard sampler's is
:class:`pitstop.plugins.samplers.batch.SamplingBatch`). :class:`SamplerOutput` is
what the runner reads. :mod:`pitstop.plugin_system.protocols` re-exports these.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import torch

from pitstop.requests.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pitstop.plugin_system.grammar import GrammarMatcher


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``: one per seeded request, kept across steps."""
    device = torch.device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return generator


@attrs.frozen
class RowInputs:
    """What one row's logits processors read this step, besides its fixed :class:`SamplingParams`.

    ``history`` is the sequence's live token list (prompt, then output; a
    last token still on the device is :data:`~pitstop.requests.sequence.PENDING_TOKEN`),
    given only when a penalty is set and read during the launch only.
    ``blocked_token_ids`` are masked this step (EOS and stop tokens before
    ``min_tokens``, ``bad_words``); ``grammar`` is the structured-output
    matcher; ``allowed_token_ids`` the only tokens the row may sample.
    ``logits_processors`` are the request's own callables, given
    ``prompt_ids`` and the known ``output_ids`` (the engine applies the step
    in flight first, so that none is pending). ``prepared`` is what
    :meth:`SamplerBase.prepare_request` made of the request (the standard
    sampler: its ``bad_words`` as token sequences).
    """

    history: list[int] | None = None
    num_prompt_tokens: int = 0
    blocked_token_ids: tuple[int, ...] = ()
    grammar: GrammarMatcher | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    logits_processors: tuple[Any, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    reads_tokens: bool = False  # bad_words or logits_processors read the known output tokens
    # what the sampler prepared for the request when it entered (Sampler.prepare_request)
    prepared: Any = None

    @property
    def needs_host_tokens(self) -> bool:
        """Whether this row's processors read its last token on the host (grammar, bad words,
        logits processors): the step before must be applied before this one is planned."""
        return self.grammar is not None or self.reads_tokens


@attrs.frozen
class SamplerOutput:
    """Sampled tokens (and their log-probabilities when asked)."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, of the chosen tokens
    top_ids: torch.Tensor | None = None  # [B, K] int64: the K most likely tokens (logprobs=K)
    top_logprobs: torch.Tensor | None = None  # [B, K] float32
    ranks: torch.Tensor | None = None  # [B] int64: the chosen token's rank (1 = most likely)


@runtime_checkable
class Sampler(Protocol):
    """Turns a batch of logits into tokens, and builds the batches it reads."""

    def make_batch(
        self, params: Seq[SamplingParams], generators: Seq[torch.Generator | None]
    ) -> Any:
        """One step's per-row settings (tensors on its device), read back by :meth:`sample`: row
        ``i`` samples with ``params[i]`` and ``generators[i]`` (None: its own shared randomness)."""
        ...

    def sample(self, logits: torch.Tensor, batch: Any) -> SamplerOutput:
        """Sample one token per row of ``logits`` ``[B, V]``."""
        ...

    def probabilities(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        """The distribution ``sample`` draws from, after temperature and filters: ``[B, V]``."""
        ...
