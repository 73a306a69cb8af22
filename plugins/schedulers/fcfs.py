"""``fcfs``: static batches in arrival order (the article's baseline).

When no batch is in flight, the scheduler forms one: waiting sequences in
arrival order, up to ``max_batch_size`` (and ``max_num_batched_tokens``, so
every decode step fits), as many as the allocator can take, stopping at the
first that does not fit. Then it prefills the batch (up to
``max_prefill_batch`` prompts and ``max_num_batched_tokens`` tokens per step;
a prompt longer than that runs alone) and decodes every member each step
until *all* have finished. Nothing joins a batch in flight, so one long
request holds up everything behind it: that is the point of the baseline.

When the batch runs out of pages, the newest member is preempted by
recompute; it stays a member, waits at the front of the queue and rejoins
the same batch as soon as its pages fit again. ``admission`` and
``prefill_priority`` are ignored: ``fcfs`` is arrival order by definition,
and a batch is prefilled before it decodes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import pitstop
from pitstop.plugins.schedulers.base import BaseScheduler, BatchSettings, StepBuilder

if TYPE_CHECKING:
    from pitstop.config import EngineConfig
    from pitstop.plugin_system.protocols import Allocator
    from pitstop.requests.sequence import Sequence

log = logging.getLogger(__name__)


class FCFSScheduler(BaseScheduler):
    """Static batching in arrival order: nothing joins until the whole batch has finished."""

    name = "fcfs"
    settings_class = BatchSettings

    def __init__(
        self, config: EngineConfig, allocator: Allocator, *, settings: BatchSettings
    ) -> None:
        super().__init__(config, allocator, settings=settings)
        if self.settings.admission != "arrival":
            log.warning(
                "the fcfs scheduler admits in arrival order; admission=%r has no effect",
                self.settings.admission,
            )
        self._set_token_budget(self.settings.max_num_batched_tokens)
        self.batch: set[int] = set()  # seq_ids of the batch in flight (running or preempted)

    def _fill(self, step: StepBuilder) -> None:
        """Admit (a new batch, or preempted members back), then prefill pending members or decode all."""
        forming = not self.batch
        for seq in list(self.waiting):
            if forming and len(self.batch) >= self.max_running:
                break
            if not forming and seq.seq_id not in self.batch:
                break  # only members rejoin a batch in flight; preempted, they wait at the front
            if not self.allocator.can_allocate(seq):
                break
            self._admit(seq)
            self.batch.add(seq.seq_id)
        pending = [s for s in self.running if s.num_uncomputed_tokens > 1]
        if pending:
            self._prefill(pending, step)
        else:
            self._schedule_running(self.running, step)

    def _prefill(self, pending: list[Sequence], step: StepBuilder) -> None:
        for seq in pending:
            n = seq.num_uncomputed_tokens
            oversized = n > step.token_budget
            if step.prefills_left <= 0 or (
                n > step.tokens_left and (step.scheduled or not oversized)
            ):
                return
            step.add(seq, n)  # admitted with pages for all its tokens: no growth needed
            if oversized:
                return

    def _forget(self, seq: Sequence) -> None:
        super()._forget(seq)
        self.batch.discard(seq.seq_id)


def create_fcfs(
    config: EngineConfig, allocator: Allocator, *, settings: BatchSettings
) -> FCFSScheduler:
    """Requests in arrival order, in static batches: nothing joins until the batch has finished."""
    return FCFSScheduler(config, allocator, settings=settings)


@pitstop.hookimpl
def register_schedulers(register) -> None:
    FCFSScheduler.register_with(register, create_fcfs)
