"""What the built-in schedulers share: the queues, admission order, growth and preemption.

A scheduler keeps two collections:

- ``waiting``: a deque of sequences that hold no KV pages. New sequences join
  at the back; a preempted sequence goes back to the *front*.
- ``running``: admitted sequences, oldest admission first. "Newest" always
  means the end of this list.

Admission order (the setting ``admission``, an alias every built-in
scheduler declares):

- ``"arrival"``: the waiting deque's order.
- ``"shortest-first"``: preempted sequences first (queue order), then every
  sequence that has waited ``max_wait_steps`` scheduling rounds or more
  (arrival order: the aging bound), then the rest by prompt length, shortest
  first (ties by arrival). The bound is the setting ``max_wait_steps`` of
  ``continuous`` and ``chunked`` (``--continuous.max-wait-steps 64``; the
  older key ``scheduler.max_wait_steps`` sets both; default 64; 0 makes
  ``shortest-first`` behave as ``arrival``).

Admission stops at the first sequence that does not fit (batch room, token
budget or pages): a sequence is never overtaken by one behind it in the
admission order, which is what bounds every wait.

Preemption is by recompute: when a running sequence cannot grow, the newest
running sequence not yet scheduled in this step (possibly the one that needs
room) gives back every page, forgets its computed tokens and goes to the
front of the queue; on readmission it recomputes its prompt and the tokens it
generated, and nothing it generated is lost. No sequence is admitted in a step
that preempted (the room it would take is the room just freed for growth).

Speculative decoding: a decoding sequence whose ``draft_token_ids`` the
engine filled is scheduled for ``1 + len(draft_token_ids)`` tokens (all of
them count against the token budget) and grows by that many slots. Drafts
never cause a preemption: when the budget or the free pages cannot take
them, the sequence decodes one token and its drafts go unverified (the engine
drops every draft once the step's inputs are built).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import attrs

from pitstop.errors import ConfigError, PitstopError
from pitstop.plugin_system.protocols import ScheduledSequence, StepPlan
from pitstop.plugin_system.settings import engine_setting, setting
from pitstop.requests.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pitstop.config import EngineConfig
    from pitstop.plugin_system.protocols import Allocator

MAX_WAIT_STEPS_OPTION = "scheduler.max_wait_steps"  # the older key, shared by both schedulers
DEFAULT_MAX_WAIT_STEPS = 64


class SchedulerError(PitstopError, RuntimeError):
    """The scheduler cannot make progress (for example a request larger than the whole KV cache)."""


ADMISSION_ORDERS = ("arrival", "shortest-first")


@attrs.frozen
class BatchSettings:
    """The batch limits every built-in scheduler keeps.

    ``max_batch_size`` and ``max_num_batched_tokens`` are the engine's own
    settings (the runner sizes its buffers by them); ``max_prefill_batch`` and
    ``admission`` are the schedulers' (the aliases ``--max-prefill-batch``,
    ``--admission`` set them for whichever built-in scheduler is selected).
    """

    max_batch_size: int = engine_setting("max_batch_size", help="most sequences in one step")
    max_prefill_batch: int = setting(
        64,
        type=int,
        minimum=1,
        alias="max_prefill_batch",
        at_most="max_batch_size",
        help="most prompts prefilled in one step",
    )
    max_num_batched_tokens: int = engine_setting(
        "max_num_batched_tokens", help="most tokens computed in one step"
    )
    admission: str = setting(
        "arrival",
        type=str,
        choices=ADMISSION_ORDERS,
        alias="admission",
        help="order in which waiting prompts are admitted (fcfs: arrival only)",
    )

    def __attrs_post_init__(self) -> None:
        if self.max_prefill_batch > self.max_batch_size:
            raise ConfigError(
                f"max_prefill_batch ({self.max_prefill_batch}) must not exceed "
                f"max_batch_size ({self.max_batch_size}); lower max_prefill_batch, or leave it "
                "out: unset, it follows a max_batch_size below 64"
            )


@attrs.frozen
class AdmissionSettings(BatchSettings):
    """The settings of a scheduler with an admission order (``continuous``, ``chunked``)."""

    max_wait_steps: int = setting(
        DEFAULT_MAX_WAIT_STEPS,
        type=int,
        minimum=0,
        legacy=(MAX_WAIT_STEPS_OPTION,),
        help="aging bound (scheduling rounds) of shortest-first admission; 0: arrival order",
    )


class StepBuilder:
    """The plan of one step while it is being built, with its budgets."""

    def __init__(self, token_budget: int, max_seqs: int, max_prefills: int) -> None:
        self.token_budget = token_budget
        self.tokens_left = token_budget
        self.max_seqs = max_seqs
        self.max_prefills = max_prefills
        self.num_prefills = 0
        self.scheduled: list[ScheduledSequence] = []
        self.scheduled_ids: set[int] = set()
        self.preempted: list[Sequence] = []

    @property
    def seqs_left(self) -> int:
        return self.max_seqs - len(self.scheduled)

    @property
    def prefills_left(self) -> int:
        return self.max_prefills - self.num_prefills

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        # A sequence is "prefilling" when more than its last token is uncomputed.
        if seq.num_uncomputed_tokens > 1:
            self.num_prefills += 1
        self.tokens_left -= num_new_tokens
        self.scheduled.append(ScheduledSequence(seq, num_new_tokens))
        self.scheduled_ids.add(seq.seq_id)

    def plan(self) -> StepPlan:
        return StepPlan(scheduled=self.scheduled, preempted=self.preempted)


class BaseScheduler:
    """Queues, admission order, slot growth, preemption by recompute, abort and release.

    Subclasses implement :meth:`schedule` and declare, once, their plugin ``name``
    and ``settings_class``: :meth:`register_with` registers them from there, and
    the plugin manager hands the validated settings to :meth:`__init__`.
    """

    name = "base"
    settings_class: type = AdmissionSettings
    # set by a subclass's __init__ (:meth:`_set_token_budget`): tokens per step, and the most
    # sequences running at once
    token_budget: int
    max_running: int

    def __init__(self, config: EngineConfig, allocator: Allocator, *, settings: Any) -> None:
        """``settings``: this scheduler's typed settings, as the plugin manager resolved them."""
        self.config = config
        self.allocator = allocator
        self.settings = settings
        self.max_batch_size = self.settings.max_batch_size
        self.max_prefill_batch = self.settings.max_prefill_batch
        ordered = isinstance(self.settings, AdmissionSettings)
        self.admission = self.settings.admission if ordered else "arrival"
        self.max_wait_steps = self.settings.max_wait_steps if ordered else 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_request: dict[str, Sequence] = {}
        self._round = 0  # schedule() calls so far (a sequence keeps the round it was queued in)

    def _set_token_budget(self, token_budget: int) -> None:
        """Set the tokens one step may compute, and so ``max_running``: at most
        ``max_batch_size`` sequences, and no more than one per token of the budget."""
        self.token_budget = token_budget
        self.max_running = min(self.max_batch_size, token_budget)

    @classmethod
    def register_with(cls, register: Callable[..., None], factory: Callable[..., Any]) -> None:
        """Register ``factory`` as the scheduler ``name`` with its ``settings_class`` (the
        ``register`` a ``register_schedulers`` hook receives)."""
        register(cls.name, factory, settings=cls.settings_class)

    # ------------------------------------------------------------------ protocol
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        if seq.request_id in self._by_request:
            raise ValueError(f"request {seq.request_id!r} is already queued or running")
        seq.queue(self._round)
        self.waiting.append(seq)
        self._by_request[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request from the queue or the running set, free its pages; return it."""
        seq = self._by_request.get(request_id)
        if seq is None:
            return None
        self._forget(seq)
        seq.abort()
        return seq

    def has_work(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def on_step_done(self, plan: StepPlan, finished: Seq[Sequence]) -> None:
        """Drop the sequences that finished and free their pages.

        Under the overlapped loop this is called one step late: ``plan`` is
        the step whose results were just applied, and the step planned after
        it (already launched) may still contain the finished sequences; their
        extra token is discarded by the engine. ``finished`` may also hold
        sequences aborted or finished since.
        """
        for seq in finished:
            if self._by_request.get(seq.request_id) is seq:
                self._forget(seq)

    @property
    def num_waiting(self) -> int:
        """Sequences queued (including preempted ones)."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Sequences admitted (holding pages)."""
        return len(self.running)

    def schedule(self) -> StepPlan:
        """Plan one step: a fresh step filled by the subclass's :meth:`_fill`, checked for progress."""
        self._next_round()
        step = StepBuilder(self.token_budget, self.max_batch_size, self.max_prefill_batch)
        self._fill(step)
        self._check_progress(step)
        return step.plan()

    def _fill(self, step: StepBuilder) -> None:  # pragma: no cover - abstract
        """Schedule this step's sequences into ``step`` (the subclass's policy)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers
    def _forget(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq)
        del self._by_request[seq.request_id]

    def _next_round(self) -> None:
        self._round += 1

    def admission_order(self) -> Iterator[Sequence]:
        """Waiting sequences in the order they may be admitted (see the module docstring)."""
        if self.admission != "shortest-first":
            yield from list(self.waiting)
            return
        front: list[Sequence] = []
        aged: list[Sequence] = []
        rest: list[tuple[int, int, Sequence]] = []
        for i, seq in enumerate(self.waiting):
            if seq.requeued:
                front.append(seq)
            elif self._round - seq.queued_round >= self.max_wait_steps:
                aged.append(seq)
            else:
                rest.append((seq.num_tokens, i, seq))
        rest.sort(key=lambda t: (t[0], t[1]))
        yield from front
        yield from aged
        yield from (seq for _, _, seq in rest)

    def _admit(self, seq: Sequence) -> None:
        """Give ``seq`` its pages (the caller checked ``can_allocate``) and make it the newest running."""
        seq.admit(self.allocator.allocate(seq))
        self.waiting.remove(seq)
        self.running.append(seq)

    def _room_for_prompt(self, step: StepBuilder) -> bool:
        """Whether one more prompt may be admitted into ``step``: fewer than ``max_running``
        sequences run (set by the subclass) and the step takes another sequence and prefill."""
        return (
            len(self.running) < self.max_running and step.seqs_left > 0 and step.prefills_left > 0
        )

    def _preempt(self, seq: Sequence, step: StepBuilder) -> None:
        """Recompute preemption: free everything, forget the KV, go to the front of the queue."""
        self.allocator.free(seq)
        seq.preempt()
        self.running.remove(seq)
        self.waiting.appendleft(seq)  # seq.requeued: it waits at the front
        step.preempted.append(seq)

    def _ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make ``seq`` hold ``num_computed_tokens + num_new_tokens`` slots, if the allocator can."""
        need = seq.num_computed_tokens + num_new_tokens - self.allocator.num_held_tokens(seq)
        if need <= 0:
            return True
        if not self.allocator.can_append(seq, need):
            return False
        self.allocator.append(seq, need)
        return True

    def _reserve(self, seq: Sequence, num_new_tokens: int, step: StepBuilder) -> bool:
        """Grow ``seq`` for this step, preempting the newest unscheduled running sequences for room.

        Returns False when ``seq`` itself was the newest and got preempted.
        """
        while not self._ensure_slots(seq, num_new_tokens):
            victim = next(s for s in reversed(self.running) if s.seq_id not in step.scheduled_ids)
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _schedule_running(
        self, seqs: Iterable[Sequence], step: StepBuilder, *, max_tokens: int | None = None
    ) -> None:
        """Schedule running sequences (oldest first) for their uncomputed tokens, growing and preempting."""
        for seq in list(seqs):
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in step.scheduled_ids:
                continue  # preempted earlier in this loop
            uncomputed = seq.num_uncomputed_tokens  # read once: a property over the token list
            want = uncomputed if max_tokens is None else min(uncomputed, max_tokens)
            if want <= 0 or want > step.tokens_left or step.seqs_left <= 0:
                continue
            if uncomputed > 1 and step.prefills_left <= 0:
                continue
            if uncomputed == 1 and seq.draft_token_ids:
                # Verify the drafts too (1 + k tokens), if budget and pages allow without
                # preempting anyone; otherwise drop them and decode one token as usual.
                drafts = len(seq.draft_token_ids)
                if want + drafts <= step.tokens_left and self._ensure_slots(seq, want + drafts):
                    step.add(seq, want + drafts)
                    continue
                # the engine drops the drafts once the step is built
            if self._reserve(seq, want, step):
                step.add(seq, want)

    def _check_progress(self, step: StepBuilder) -> None:
        """An empty plan with work left and nothing preempted would stall the engine forever."""
        if step.scheduled or step.preempted or not self.has_work():
            return
        if any(s.num_uncomputed_tokens == 0 for s in self.running):
            return  # at their length limit, awaiting the lagged result that finishes them
        head = next(self.admission_order(), None)
        if head is not None and not self.running:
            raise SchedulerError(
                f"request {head.request_id!r} needs {head.num_tokens} token slots and cannot be admitted "
                f"even with nothing else running: the KV cache ({self.allocator.num_pages} pages of "
                f"{self.allocator.page_size} tokens) is too small for it; raise max_num_pages or "
                f"kv_cache_gib, or lower max_model_len"
            )
        raise SchedulerError(
            f"{type(self).__name__} planned an empty step with {self.num_running} running and "
            f"{self.num_waiting} waiting sequences"
        )
