"""The scheduler ``sjf``: shortest job first, with an aging bound so that nothing starves.

Written against :class:`pitstop.plugin_system.protocols.Scheduler` alone (no built-in
scheduler class): the queues, admission, growth and preemption are all here.

- **Admission.** Waiting sequences are admitted in this order: sequences it
  preempted (they have the most work behind them), then every sequence that
  has waited ``sjf.max_wait_steps`` steps or more (arrival order), then the
  rest by *job size*, shortest first (ties by arrival). The size is what the
  request can still cost: ``sjf.job_size = "total"`` counts its prompt plus
  ``max_tokens`` (known when the request arrives), ``"prompt"`` the prompt
  only, ``"output"`` ``max_tokens`` only. Admission stops at the first
  sequence that does not fit, so a sequence at the head of the order is
  never overtaken: an aged one waits only for room.
- **Each step** decodes every running sequence first (a sequence with drafts
  verifies them when the budget and free pages allow, otherwise it decodes
  one token), then gives what is left of ``max_num_batched_tokens`` to
  prompts in chunks (oldest admission first, at most ``max_prefill_batch``
  of them), then admits new prompts into the room left. A prompt longer than
  the budget is prefilled over several steps.
- **Preemption** is by recompute: when a running sequence cannot grow, the
  newest running sequence not scheduled in this step gives back its pages
  and waits; nothing it generated is lost. No prompt is admitted in a step
  that preempted.

Against ``continuous --admission shortest-first`` (the prompt length only),
``job_size = "total"`` also puts a request that asks for a few tokens
before one that asks for many, which is what lowers the mean latency of a
mix of short and long generations.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq

import attrs

import pitstop
from pitstop.plugin_system.protocols import Allocator, ScheduledSequence, StepPlan
from pitstop.plugin_system.settings import engine_setting, read_settings, setting
from pitstop.requests.sequence import Sequence, SequenceStatus

JOB_SIZES = ("total", "prompt", "output")


@attrs.frozen
class SjfSettings:
    """The settings of the ``sjf`` scheduler: ``--sjf.max-wait-steps``, ``[plugins.sjf]``."""

    max_wait_steps: int = setting(
        32,
        type=int,
        minimum=0,
        help="steps after which a waiting request goes before every shorter one (0: arrival order)",
    )
    job_size: str = setting(
        "total",
        type=str,
        choices=JOB_SIZES,
        help="what makes a job short: prompt + max_tokens, the prompt, or max_tokens",
    )
    # The engine's own settings (the runner sizes its buffers by them): read, not declared.
    max_batch_size: int = engine_setting("max_batch_size", help="most sequences in one step")
    # The same short name (alias) and declaration as the built-in schedulers' own setting, so
    # that --max-prefill-batch sets it for whichever scheduler is selected; unset, it follows
    # a max_batch_size below 64 (at_most names the field declared above).
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


class _Step:
    """The plan of one step while it is built, with what is left of its budgets."""

    def __init__(self, tokens: int, seqs: int, prefills: int) -> None:
        self.tokens_left = tokens
        self.seqs_left = seqs
        self.prefills_left = prefills
        self.scheduled: list[ScheduledSequence] = []
        self.ids: set[int] = set()
        self.preempted: list[Sequence] = []

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        if seq.num_uncomputed_tokens > 1:
            self.prefills_left -= 1
        self.tokens_left -= num_new_tokens
        self.seqs_left -= 1
        self.scheduled.append(ScheduledSequence(seq, num_new_tokens))
        self.ids.add(seq.seq_id)


class SjfScheduler:
    """Shortest job first with an aging bound, chunked prompts and decode-first steps."""

    def __init__(self, settings: SjfSettings, allocator: Allocator) -> None:
        self.settings = settings
        self.allocator = allocator
        self.waiting: list[Sequence] = []  # arrival order (preempted ones keep their place)
        self.running: list[Sequence] = []  # admission order: the newest is last
        self._by_request: dict[str, Sequence] = {}
        self._arrived: dict[int, int] = {}  # seq_id -> the step it arrived in
        self._preempted: set[int] = set()  # waiting sequences it preempted
        self._step = 0
        # Decodes of every running sequence always fit one step's token budget.
        self._max_running = min(settings.max_batch_size, settings.max_num_batched_tokens)

    # ------------------------------------------------------------------ the protocol
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        if seq.request_id in self._by_request:
            raise ValueError(f"request {seq.request_id!r} is already queued or running")
        self.waiting.append(seq)
        self._by_request[seq.request_id] = seq
        self._arrived[seq.seq_id] = self._step

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is and free its pages; return it (None if unknown)."""
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
        """Drop the sequences that finished and free their pages (one step late when overlapped)."""
        for seq in finished:
            if self._by_request.get(seq.request_id) is seq:
                self._forget(seq)

    @property
    def num_waiting(self) -> int:
        """Sequences queued, preempted ones included."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Sequences admitted (holding pages)."""
        return len(self.running)

    def schedule(self) -> StepPlan:
        """Decodes first, then prompt chunks, then new prompts in shortest-job order."""
        self._step += 1
        s = self.settings
        step = _Step(s.max_num_batched_tokens, s.max_batch_size, s.max_prefill_batch)
        decoding = [q for q in self.running if q.num_uncomputed_tokens == 1]
        prefilling = [q for q in self.running if q.num_uncomputed_tokens > 1]
        for seq in decoding:
            self._schedule_decode(seq, step)
        for seq in prefilling:
            if seq.status is SequenceStatus.RUNNING and step.prefills_left > 0:
                self._schedule_chunk(seq, step)
        if not step.preempted:
            self._admit(step)
        if not step.scheduled and not step.preempted:
            self._check_progress()
        return StepPlan(scheduled=step.scheduled, preempted=step.preempted)

    # ------------------------------------------------------------------ one step
    def _schedule_decode(self, seq: Sequence, step: _Step) -> None:
        if seq.status is not SequenceStatus.RUNNING or step.seqs_left <= 0:
            return  # preempted earlier in this step, or the batch is full
        if step.tokens_left <= 0:
            return
        drafts = len(seq.draft_token_ids)
        if drafts:
            # Verify the drafts too, if budget and pages allow without preempting anyone.
            if 1 + drafts <= step.tokens_left and self._grow(seq, 1 + drafts):
                step.add(seq, 1 + drafts)
                return
            seq.draft_token_ids.clear()
        if self._grow_or_preempt(seq, 1, step):
            step.add(seq, 1)

    def _schedule_chunk(self, seq: Sequence, step: _Step) -> None:
        n = min(seq.num_uncomputed_tokens, step.tokens_left)
        if n <= 0 or step.seqs_left <= 0:
            return
        if self._grow_or_preempt(seq, n, step):
            step.add(seq, n)

    def _admit(self, step: _Step) -> None:
        for seq in list(self.admission_order()):
            if (
                len(self.running) >= self._max_running
                or step.seqs_left <= 0
                or step.prefills_left <= 0
                or step.tokens_left <= 0
                or not self.allocator.can_allocate(seq)
            ):
                return  # never overtake the head of the order
            seq.admit(self.allocator.allocate(seq))
            self.waiting.remove(seq)
            self._preempted.discard(seq.seq_id)
            self.running.append(seq)
            step.add(seq, min(seq.num_uncomputed_tokens, step.tokens_left))

    def admission_order(self) -> Iterator[Sequence]:
        """Waiting sequences in the order they may be admitted (see the module docstring)."""
        preempted, aged, rest = [], [], []
        for i, seq in enumerate(self.waiting):
            if seq.seq_id in self._preempted:
                preempted.append(seq)
            elif self._step - self._arrived[seq.seq_id] >= self.settings.max_wait_steps:
                aged.append(seq)
            else:
                rest.append((self.job_size(seq), i, seq))
        rest.sort(key=lambda t: (t[0], t[1]))
        yield from preempted
        yield from aged
        yield from (seq for _, _, seq in rest)

    def job_size(self, seq: Sequence) -> int:
        """What ``seq`` can still cost, in tokens, by ``sjf.job_size``."""
        size = self.settings.job_size
        if size == "prompt":
            return seq.num_prompt_tokens
        if size == "output":
            return seq.sampling_params.max_tokens
        return seq.num_prompt_tokens + seq.sampling_params.max_tokens

    # ------------------------------------------------------------------ pages
    def _grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make ``seq`` hold ``num_computed_tokens + num_new_tokens`` slots, if the allocator can."""
        need = seq.num_computed_tokens + num_new_tokens - self.allocator.num_held_tokens(seq)
        if need <= 0:
            return True
        if not self.allocator.can_append(seq, need):
            return False
        self.allocator.append(seq, need)
        return True

    def _grow_or_preempt(self, seq: Sequence, num_new_tokens: int, step: _Step) -> bool:
        """Grow ``seq``, preempting the newest unscheduled running sequences for room.

        False when ``seq`` itself was the newest and was preempted.
        """
        while not self._grow(seq, num_new_tokens):
            victim = next(q for q in reversed(self.running) if q.seq_id not in step.ids)
            self.allocator.free(victim)
            victim.preempt()
            self.running.remove(victim)
            self.waiting.append(victim)
            self._preempted.add(victim.seq_id)
            step.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _forget(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.allocator.free(seq)
        del self._by_request[seq.request_id]
        self._arrived.pop(seq.seq_id, None)
        self._preempted.discard(seq.seq_id)

    def _check_progress(self) -> None:
        """An empty step with nothing running means the head of the order can never fit."""
        if self.running or not self.waiting:
            return  # running sequences at their length limit wait for their lagged finish
        head = next(self.admission_order())
        raise RuntimeError(
            f"sjf: request {head.request_id!r} needs {head.num_tokens} token slots and cannot be "
            f"admitted with nothing else running: the KV cache ({self.allocator.num_pages} pages "
            f"of {self.allocator.page_size} tokens) is too small for it; raise max_num_pages or "
            "kv_cache_gib, or lower max_model_len"
        )


def make_sjf(config: pitstop.EngineConfig, allocator: Allocator) -> SjfScheduler:
    """Shortest job first (prompt + max_tokens), with an aging bound in steps."""
    return SjfScheduler(read_settings(config, "sjf", SjfSettings), allocator)
