"""Engine statistics: the allocator's state, one record per step, running totals for the engine."""

from __future__ import annotations

import attrs


@attrs.frozen
class AllocatorStats:
    """A snapshot of an allocator's state."""

    num_pages: int
    pages_free: int
    tokens_held: int  # tokens whose KV slots are in use by live sequences
    # token slots set aside for live sequences (pages x page_size, or max_model_len each)
    tokens_reserved: int
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    # slots counted more than once in tokens_held because several sequences share their page
    tokens_shared: int = 0
    # an allocator's own running totals by name (a host tier's hits, bytes moved), exported as given
    counters: dict[str, float] = attrs.field(factory=dict, hash=False)

    @property
    def utilization(self) -> float:
        """Slots in use over slots reserved, each shared slot counted once (1.0 when nothing is reserved)."""
        if not self.tokens_reserved:
            return 1.0
        return (self.tokens_held - self.tokens_shared) / self.tokens_reserved

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache over prompt tokens looked up."""
        return (
            self.prefix_hit_tokens / self.prefix_queried_tokens
            if self.prefix_queried_tokens
            else 0.0
        )


@attrs.frozen
class StepStats:
    """What one engine step did; handed to the ``on_step_finished`` observers."""

    step: int
    num_seqs: int
    num_prefill_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    num_finished: int
    num_waiting: int
    num_running: int
    duration_s: float
    allocator: AllocatorStats

    @property
    def num_tokens(self) -> int:
        """Tokens computed in the step."""
        return self.num_prefill_tokens + self.num_decode_tokens


@attrs.define
class EngineStats:
    """Running totals since the engine started."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (recomputes after preemption included)
    generation_tokens: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0  # stopped with finish_reason "error" by a step that failed for them
    step_failures: int = 0  # steps whose launch raised (their sequences were then run one by one)
    utilization_sum: float = 0.0  # sum over steps of tokens held / tokens reserved
    # Speculative decoding (zero without it): one verification = one sequence verifying drafts in a step.
    spec_verifications: int = 0
    spec_proposed_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # draft tokens the target kept
    # The adaptation rule (pitstop.speculation.spec_adaptation): steps that speculated, steps the batch rule
    # kept plain, sequence-steps held back by low acceptance, proposals that found no draft.
    spec_steps: int = 0
    spec_skipped_batch_steps: int = 0
    spec_paused_seq_steps: int = 0
    spec_empty_proposals: int = 0

    @property
    def mean_kv_utilization(self) -> float:
        """KV-cache utilization averaged over steps."""
        return self.utilization_sum / self.steps if self.steps else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Draft tokens accepted over draft tokens verified (0.0 without speculation)."""
        proposed = self.spec_proposed_tokens
        return self.spec_accepted_tokens / proposed if proposed else 0.0

    @property
    def spec_mean_accepted(self) -> float:
        """Draft tokens accepted per verification (a sequence-step that verified drafts); each such
        step emits this plus one token."""
        verifications = self.spec_verifications
        return self.spec_accepted_tokens / verifications if verifications else 0.0
