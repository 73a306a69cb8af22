"""``chunked``: continuous batching with one token budget per step shared by decodes and prompt chunks.

Every step computes at most a token budget (Sarathi-Serve's idea): ``chunk_size``
when set, else ``max_num_batched_tokens`` (8192 by default). It is the default
scheduler, as in vLLM: no step, however long the prompt, runs longer than the
budget, so aborts, disconnects and shutdown take effect within one bounded step.

1. every running sequence that is decoding gets its 1 token, oldest first
   (growing its pages, preempting the newest sequence when there is no room);
2. running sequences part-way through their prompt get the next chunk,
   ``min(tokens left in the prompt, budget left)``, oldest first;
3. waiting prompts are admitted in admission order and get a first chunk,
   while budget, batch room (``max_batch_size``), prompt slots
   (``max_prefill_batch``) and pages last; none after a preemption.

So a 2000-token prompt under ``chunk_size=512`` is computed over four or more
steps while the running sequences keep decoding in each of them, and several
short prompts can share a step. A sequence holds pages for its whole prompt
from admission, so a chunk never needs new pages. At most
``min(max_batch_size, budget)`` sequences run at once, so every decode
always fits the budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

import pitstop
from pitstop.plugin_system.settings import setting
from pitstop.plugins.schedulers.base import AdmissionSettings, BaseScheduler, StepBuilder

if TYPE_CHECKING:
    from pitstop.config import EngineConfig
    from pitstop.plugin_system.protocols import Allocator


@attrs.frozen
class ChunkedSettings(AdmissionSettings):
    """The settings of the ``chunked`` scheduler."""

    chunk_size: int | None = setting(
        None,
        type=int,
        minimum=1,
        optional=True,
        alias="chunk_size",
        help="token budget per step of the chunked scheduler (unset: max_num_batched_tokens)",
    )

    def step_token_budget(self) -> int:
        """The step's token budget: ``chunk_size`` when set, else ``max_num_batched_tokens``."""
        return self.chunk_size if self.chunk_size is not None else self.max_num_batched_tokens


class ChunkedScheduler(BaseScheduler):
    """Chunked prefill: decodes and prompt chunks share one token budget per step."""

    name = "chunked"
    settings_class = ChunkedSettings

    def __init__(
        self, config: EngineConfig, allocator: Allocator, *, settings: ChunkedSettings
    ) -> None:
        super().__init__(config, allocator, settings=settings)
        self._set_token_budget(self.settings.step_token_budget())

    def _fill(self, step: StepBuilder) -> None:
        """Decodes, then chunks of running prompts, then new prompts."""
        self._schedule_running([s for s in self.running if s.num_uncomputed_tokens == 1], step)
        for seq in list(self.running):
            if step.tokens_left <= 0 or step.prefills_left <= 0:
                break
            if seq.num_uncomputed_tokens > 1 and seq.seq_id not in step.scheduled_ids:
                self._schedule_running([seq], step, max_tokens=step.tokens_left)
        if not step.preempted:
            self._admit_prompts(step)

    def _admit_prompts(self, step: StepBuilder) -> None:
        for seq in self.admission_order():
            if (
                step.tokens_left <= 0
                or not self._room_for_prompt(step)
                or not self.allocator.can_allocate(seq)
            ):
                return
            self._admit(seq)
            step.add(seq, min(seq.num_uncomputed_tokens, step.tokens_left))


def create_chunked(
    config: EngineConfig, allocator: Allocator, *, settings: ChunkedSettings
) -> ChunkedScheduler:
    """Continuous batching with long prompts split into chunks that share a step with decodes."""
    return ChunkedScheduler(config, allocator, settings=settings)


@pitstop.hookimpl
def register_schedulers(register) -> None:
    ChunkedScheduler.register_with(register, create_chunked)
