"""A request's sequence: its tokens, how many have KV in the cache, its state and timestamps.

Every change of a sequence's state is a method of :class:`Sequence`; no
other module assigns its fields (``tests/core/requests/test_sequence_ownership.py`` checks
it). The scheduler calls :meth:`~Sequence.queue`, :meth:`~Sequence.admit`
and :meth:`~Sequence.preempt`; the engine calls the rest:
:meth:`~Sequence.mark_scheduled`, :meth:`~Sequence.set_drafts` and
:meth:`~Sequence.clear_drafts` (the one place drafts are set and the one
place they are dropped), :meth:`~Sequence.launch` (a step with this sequence
was launched: its chunk counts as computed and, when the step samples, a
*pending* token is appended), :meth:`~Sequence.resolve_token` (the sampled
value of the oldest pending token arrived), :meth:`~Sequence.append_token`,
:meth:`~Sequence.verified`, :meth:`~Sequence.finish`,
:meth:`~Sequence.abort` and :meth:`~Sequence.fail`. :meth:`~Sequence.truncate`
drops a tail of tokens (the engine drops pending ones through
:meth:`~Sequence.drop_pending`; the allocator suite rolls sequences back).

State that lives as long as the sequence lives on it (the scheduler's
admission round and requeue mark, this step's drafts); what a strategy keeps
of its own (an allocator's block tables, a proposer's draft KV) stays in that
strategy, because two strategies may hold the same sequence (the ``draft``
proposer's allocator holds the target's sequences too).

Pending tokens are what lets the engine plan step N+1 while step N runs on
the device: step N's sampled token is appended at once as a placeholder
(:data:`PENDING_TOKEN`), so the scheduler sees the sequence decoding its next
token; the runner gathers that token's value on the device, and the engine
resolves it on the host one step later. Pending tokens are always the last
tokens of a sequence, and at most one step's worth is ever pending.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence as Seq
from typing import Any

import attrs

from pitstop.requests.sampling_params import SamplingParams

_seq_ids = itertools.count()

PENDING_TOKEN = -1
"""The value of a sampled token whose id is still on the device (never a real token id)."""


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
    cache, or are being written by a launched step. A step computes
    ``token_ids[num_computed_tokens : num_computed_tokens + n]``; when that
    reaches the last token the step samples the next one. Preemption by
    recompute sets ``num_computed_tokens`` back to 0 and keeps every token
    generated so far.

    ``max_num_tokens`` is where the sequence stops for length (prompt plus
    ``max_tokens``, capped by the engine at ``max_model_len``): a sequence
    whose tokens reach it, pending ones included, needs no further step, so
    its last token counts as computed (:attr:`num_uncomputed_tokens`).
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
    # Draft tokens under verification this step (speculative decoding), with their draft
    # distributions [k, V] and their ids on the device when the proposer gave them (set_drafts).
    draft_token_ids: list[int] = attrs.Factory(list)
    draft_probs: Any = None
    draft_device_ids: Any = None
    max_num_tokens: int = attrs.field(default=0)
    num_pending_tokens: int = 0  # trailing tokens sampled on the device, not yet known here
    # The scheduler's: the round (schedule() call) it was queued in, for aging, and whether it
    # waits at the front of the queue after a preemption (queue, preempt, admit).
    queued_round: int = 0
    requeued: bool = False
    # The adapter the request runs with (vLLM's LoRARequest; None: the base model).
    lora_request: Any = None

    @property
    def adapter_id(self) -> int:
        """Its adapter's ``lora_int_id`` (0: none): the prefix cache keys pages by it."""
        return 0 if self.lora_request is None else int(self.lora_request.lora_int_id)

    def __attrs_post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.max_num_tokens <= 0:
            limit = self.sampling_params.max_tokens
            if limit is None:
                raise ValueError(
                    f"{self.request_id}: max_tokens=None (up to the context) needs "
                    "max_num_tokens, the engine's max_model_len"
                )
            self.max_num_tokens = len(self.prompt_token_ids) + limit

    # ------------------------------------------------------------------ reading
    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far, pending ones included."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far whose values are known (pending ones excluded)."""
        return self.token_ids[
            len(self.prompt_token_ids) : len(self.token_ids) - self.num_pending_tokens
        ]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens have been generated, pending ones included."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens that still need a step: the prompt before prefill, 1 when decoding.

        A sequence at its length limit needs no step for its last token (no
        token follows it), so that token does not count.
        """
        n = len(self.token_ids) - self.num_computed_tokens
        return n - 1 if n > 0 and self.at_length_limit else n

    @property
    def is_prefill(self) -> bool:
        """True while more than the last token still needs computing."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        """True once the sequence stopped, ran out of tokens, or was aborted."""
        return self.status is SequenceStatus.FINISHED

    @property
    def at_length_limit(self) -> bool:
        """Whether the tokens (pending ones included) reached ``max_num_tokens``."""
        return len(self.token_ids) >= self.max_num_tokens

    # ------------------------------------------------------------------ state changes
    def queue(self, round_: int) -> None:
        """Queued (new, at the back of a scheduler's queue) in the scheduler's round ``round_``."""
        self.status = SequenceStatus.WAITING
        self.queued_round = round_
        self.requeued = False

    def admit(self, num_cached_tokens: int) -> None:
        """Admitted with pages: the first ``num_cached_tokens`` come from the prefix cache."""
        self.num_computed_tokens = num_cached_tokens
        self.num_cached_prompt_tokens = num_cached_tokens
        self.status = SequenceStatus.RUNNING
        self.requeued = False
        self.mark_scheduled()

    def mark_scheduled(self, now: float | None = None) -> None:
        """Stamp the first time the sequence is scheduled (``now``, or the current time)."""
        if self.timestamps.first_scheduled is None:
            self.timestamps.first_scheduled = time.perf_counter() if now is None else now

    def set_drafts(self, token_ids: Seq[int], probs: Any = None, device_ids: Any = None) -> None:
        """This step's drafts (the first ``len(token_ids)`` rows of ``probs``/``device_ids`` kept)."""
        self.draft_token_ids = list(token_ids)
        n = len(self.draft_token_ids)
        self.draft_probs = probs[:n] if probs is not None and n else None
        self.draft_device_ids = device_ids[:n] if device_ids is not None and n else None

    def clear_drafts(self) -> None:
        """Drop the drafts (the step that verifies them is built, or none will)."""
        self.draft_token_ids.clear()
        self.draft_probs = self.draft_device_ids = None

    def launch(self, num_new_tokens: int, *, samples: bool) -> None:
        """A step that computes ``num_new_tokens`` of this sequence was launched.

        The chunk counts as computed from now on; when the step samples, a
        pending token joins the end of the sequence (see the module docstring).
        """
        self.num_computed_tokens += num_new_tokens
        if samples:
            self.token_ids.append(PENDING_TOKEN)
            self.num_pending_tokens += 1

    def resolve_token(self, token_id: int) -> None:
        """The oldest pending token's value arrived: put it in place and stamp its time."""
        if self.num_pending_tokens <= 0:
            raise RuntimeError(f"{self.request_id}: a sampled token arrived but none is pending")
        self.token_ids[len(self.token_ids) - self.num_pending_tokens] = token_id
        self.num_pending_tokens -= 1
        self._stamp()

    def append_token(self, token_id: int) -> None:
        """Append one known token (a verified draft, a simulated model's token) and stamp its time."""
        self.token_ids.append(token_id)
        self._stamp()

    def drop_pending(self) -> None:
        """Forget the pending tokens (the sequence stopped before them)."""
        self.truncate(self.num_pending_tokens)

    def truncate(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens, pending ones among them; their KV is gone too.

        ``num_computed_tokens`` is capped at the tokens left. Any tail may go,
        prompt tokens included (the allocator suite rewrites a sequence from any
        point); ``prompt_token_ids`` keeps the prompt as it came.
        """
        if not 0 <= num_tokens <= len(self.token_ids):
            raise ValueError(
                f"{self.request_id}: cannot drop {num_tokens} of {len(self.token_ids)} tokens"
            )
        if num_tokens:
            del self.token_ids[-num_tokens:]
            self.num_pending_tokens = max(self.num_pending_tokens - num_tokens, 0)
            self.num_computed_tokens = min(self.num_computed_tokens, len(self.token_ids))

    def verified(self, num_valid: int) -> None:
        """A verification was applied: the first ``num_valid`` tokens (at most all) have valid KV."""
        self.num_computed_tokens = min(num_valid, self.num_tokens)

    def preempt(self) -> None:
        """Preempted by recompute: back to waiting (at the front), no KV, every token kept."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.requeued = True

    def finish(self, reason: str) -> None:
        """Stopped (``"stop"`` or ``"length"``): tokens still pending after this one are dropped."""
        self.drop_pending()
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.timestamps.finish = time.perf_counter()

    def abort(self) -> None:
        """Aborted by the user or the engine: finished with reason ``"abort"``."""
        self.finish("abort")

    def fail(self) -> None:
        """Stopped by an error of its own request: finished (if not yet) with reason ``"error"``."""
        if not self.is_finished:
            self.finish("error")
        self.finish_reason = "error"

    def _stamp(self) -> None:
        now = time.perf_counter()
        if self.timestamps.first_token is None:
            self.timestamps.first_token = now
        self.timestamps.tokens.append(now)
