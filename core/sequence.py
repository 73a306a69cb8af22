"""A request's sequence: its tokens, how many have KV in the cache, its timestamps."""

from __future__ import annotations

import enum
import itertools
import time

import attrs

from pitstop.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"  # queued, holds no KV pages
    RUNNING = "running"  # admitted: holds pages, is prefilled or decoding
    FINISHED = "finished"


@attrs.define(eq=False)
class Timestamps:
    """Wall-clock times (``time.perf_counter``) the engine records per request."""

    arrival: float = attrs.field(factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    tokens: list[float] = attrs.Factory(list)
    finish: float | None = None


@attrs.define(eq=False)
class Sequence:
    """One request's tokens (prompt then output) and its progress.

    ``num_computed_tokens`` counts the leading tokens whose K and V are in the
    cache. A step computes ``token_ids[num_computed_tokens : num_computed_tokens
    + n]``; when that reaches the last token the step samples the next one.
    Preemption by recompute sets ``num_computed_tokens`` back to 0 and keeps
    every token generated so far.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seq_id: int = attrs.field(factory=lambda: next(_seq_ids))
    token_ids: list[int] = attrs.field(init=False)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # served from the prefix cache at the last admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    timestamps: Timestamps = attrs.Factory(Timestamps)
    num_preemptions: int = 0
    # Draft tokens under verification this step (speculative decoding).
    draft_token_ids: list[int] = attrs.Factory(list)

    def __attrs_post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens have been generated."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet (the whole prompt before prefill, 1 when decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the last token still needs computing."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        """True once the sequence stopped, ran out of tokens, or was aborted."""
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Append one sampled token and stamp its time."""
        self.token_ids.append(token_id)
        now = time.perf_counter()
        if self.timestamps.first_token is None:
            self.timestamps.first_token = now
        self.timestamps.tokens.append(now)
