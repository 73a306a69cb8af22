"""One step's data, as values: what the engine hands the runner and what comes back.

The engine builds a :class:`StepInput` (one :class:`SeqInput` per scheduled
sequence), the runner launches it and hands back a handle
(:class:`pitstop.runner.launched.LaunchedStep`) whose result is a
:class:`StepOutput` (one :class:`SeqResult` per input sequence). Everything
here is plain data, so that under tensor parallelism the same input goes to
one runner per rank (:mod:`pitstop.plugin_system.executor`), and the engine, the runner's
parts, the proposers and the workers all import it from here.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

    from pitstop.plugin_system.sampler import RowInputs
    from pitstop.requests.sampling_params import SamplingParams


@attrs.frozen
class SeqInput:
    """One sequence's part of a step: the tokens to compute and where they go.

    A token of :data:`~pitstop.requests.sequence.PENDING_TOKEN` is one the previous
    launched step sampled and the host does not know yet: the runner reads
    its value from the device (the row of this sequence in that step).
    """

    seq_id: int
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0]
    block_table: list[int]  # the allocator's live list: read during launch only
    sample: bool  # whether the step reaches the sequence's last token
    params: SamplingParams | None = None
    # Speculative decoding: logits rows at the end of token_ids (k + 1 to verify k drafts,
    # which are the last k of token_ids), and the drafts' [k, V] distributions (None: point masses).
    num_logits: int = 1
    draft_probs: torch.Tensor | None = None
    # Drafts still on the device (the draft model's): the last len(draft_ids) of token_ids are
    # placeholders, and the runner writes these in on the device.
    draft_ids: torch.Tensor | None = None
    # Penalty history, min_tokens mask and grammar of a sampling row (None: it uses none).
    row_inputs: RowInputs | None = None
    # prompt_logprobs=k: the prompt tokens that the first len(prompt_targets) tokens of
    # token_ids predict (their logits' log-probabilities come back in SeqResult.prompt_logprobs)
    prompt_targets: list[int] | None = None
    prompt_logprobs: int = 0
    # The sequence's adapter (vLLM's LoRARequest; None: the base model), for the adapter plugin.
    adapter: Any = None


@attrs.frozen
class StepInput:
    """One step: prefill sequences (more than one token) first, then decodes.

    ``finished_seq_ids`` are sequences gone since the last step (their
    generators and block-table rows are dropped); ``reset_seq_ids`` are live
    sequences whose block table was rebuilt or shortened since the last step
    (preempted, or drafts truncated). ``poison_pages``: KV pages handed out
    since the last step, to fill with NaN before this step writes them
    (``poison_memory`` on; :mod:`pitstop.ground.poison`).
    """

    seqs: list[SeqInput]
    finished_seq_ids: list[int] = attrs.Factory(list)
    reset_seq_ids: list[int] = attrs.Factory(list)
    poison_pages: list[int] = attrs.Factory(list)


# per predicted prompt token: (its logprob, its rank, the k most likely (id, logprob))
PromptLogprobs = list[tuple[float, int, list[tuple[int, float]]]]


@attrs.frozen
class SeqResult:
    """What one scheduled sequence got from a step: its emitted tokens (none if it did not sample)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    # logprobs=k: per emitted token, the k most likely (id, logprob) and the chosen token's rank
    top_logprobs: list[list[tuple[int, float]]] | None = None
    ranks: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


NO_TOKENS = SeqResult([])
"""The result of a sequence that did not sample this step."""


@attrs.frozen
class StepOutput:
    """One :class:`SeqResult` per sequence of the step's input, in input order.

    A sampling sequence emits one token, or, when it verified k drafts, its
    accepted drafts and one more token.
    """

    results: list[SeqResult]
    # poison_memory: the sequences whose logits this step held NaN (they read memory
    # nothing wrote); the engine fails their requests instead of taking their tokens
    poisoned_seq_ids: frozenset[int] = frozenset()

    @property
    def token_ids(self) -> list[int]:
        """Every emitted token, flat, in input order."""
        return [t for r in self.results for t in r.token_ids]


# Called with (the step's inputs, the logits rows it computed) after every step's logits,
# before sampling; rows are the sampling inputs' num_logits rows, in order.
LogitsObserver = Callable[[Seq[SeqInput], "torch.Tensor"], None]
