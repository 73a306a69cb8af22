"""When to speculate: the adaptation rule that keeps speculation from ever being a large loss.

A verification step costs more than a plain decode step (k + 1 query tokens
per sequence, and it runs serially: the host proposes from tokens it has
read back), so the engine speculates only where that pays:

- **by batch size**: a step speculates only while at most
  ``speculative_max_batch`` sequences run (larger batches are compute-bound,
  where extra query tokens cost their full price; vLLM calls this
  disable-by-batch-size). Above it every sequence decodes plainly, in the
  overlapped loop.
- **by acceptance, per sequence**: each sequence keeps an exponential
  moving average (weight :data:`EMA_WEIGHT`) of the drafts kept per
  speculative step, a step without drafts counting as 0. When it falls below
  ``speculative_min_accepted`` (after five empty steps from the start, or
  about seven after a run of well-kept drafts) the sequence pauses
  speculation for :data:`FIRST_PAUSE` steps, then probes once more, starting
  from the threshold: one good step keeps it on, one more miss pauses it
  twice as long (up to :data:`MAX_PAUSE` steps). A step in which no running sequence
  wants to speculate is a plain step (overlapped where ``overlap`` is on).

Counters (in :class:`~pitstop.ground.metrics.EngineStats`, on ``/metrics``):
``spec_steps`` (steps that ran speculatively), ``spec_skipped_batch_steps``,
``spec_paused_seq_steps`` (a sequence held back by its acceptance for a step)
and ``spec_empty_proposals`` (the proposer found nothing).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from pitstop.config import EngineConfig
from pitstop.ground.metrics import EngineStats
from pitstop.requests.sequence import Sequence

EMA_WEIGHT = 0.25  # of the latest step in the moving average of drafts kept per step
# A new sequence starts as if each step had kept two drafts: its first five steps may find
# nothing (an edit's output often opens with a few new tokens before it copies its input).
START_SCORE = 2.0
FIRST_PAUSE = 4  # steps a sequence sits out after its score drops below the threshold
MAX_PAUSE = 64


@attrs.define
class _SeqScore:
    score: float = START_SCORE
    resume_at: int = 0  # the step from which the sequence may speculate again
    pause: int = FIRST_PAUSE  # the next pause's length


class SpeculationPolicy:
    """Decides per step whether to speculate, and per sequence whether to ask for drafts."""

    def __init__(self, config: EngineConfig, stats: EngineStats) -> None:
        self.max_batch = config.speculative_max_batch
        self.min_accepted = config.speculative_min_accepted
        self.stats = stats
        self.step = 0
        self._scores: dict[int, _SeqScore] = {}

    def plan_step(self, num_running: int, decoding: Iterable[Sequence]) -> set[int]:
        """Start a step: the ids of the sequences that ask for drafts in it (empty: a plain step).

        The batch rule first (``num_running`` over ``speculative_max_batch``:
        nobody), then each sequence's own acceptance (a paused one is counted).
        """
        self.step += 1
        if num_running > self.max_batch:
            self.stats.spec_skipped_batch_steps += 1
            return set()
        willing = set()
        for seq in decoding:
            s = self._scores.get(seq.seq_id)
            if s is None or self.step >= s.resume_at:
                willing.add(seq.seq_id)
            else:
                self.stats.spec_paused_seq_steps += 1
        return willing

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A speculative step's outcome for ``seq``: drafts proposed (0: none found) and kept."""
        if num_drafts == 0:
            self.stats.spec_empty_proposals += 1
        if self.min_accepted <= 0:
            return
        s = self._scores.setdefault(seq.seq_id, _SeqScore())
        s.score += EMA_WEIGHT * (num_accepted - s.score)
        if s.score >= self.min_accepted:
            s.pause = FIRST_PAUSE
            return
        s.resume_at = self.step + 1 + s.pause
        s.pause = min(2 * s.pause, MAX_PAUSE)
        s.score = self.min_accepted  # the probe after the pause decides alone

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence."""
        self._scores.pop(seq.seq_id, None)


def speculation_max_batch(config: EngineConfig) -> int:
    """The largest batch that speculates: the batch rule's bound, within ``max_batch_size``."""
    return max(1, min(config.speculative_max_batch, config.max_batch_size))
