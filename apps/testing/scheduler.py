"""The scheduler contract: a conformance suite any scheduler runs against itself.

It drives a scheduler with a simulated engine loop (no weights: a fake model
whose sampled token is a fixed function of the request and the position) over
a workload of requests that arrive over time, some of them aborted, on a KV
cache small enough that preemption happens, and checks on every step:

- the plan holds at most ``max_batch_size`` sequences, at most
  ``max_prefill_batch`` of them prefilling (more than one uncomputed token),
  and at most the token budget (``max_num_batched_tokens`` by default; a
  step that schedules a single whole prompt longer than the budget is
  allowed unless ``oversize_prompt_alone=False``);
- no sequence is scheduled twice, for zero tokens, or beyond its uncomputed
  tokens; every scheduled sequence is live, RUNNING, and holds at least
  ``num_computed_tokens + n`` slots;
- a sequence's computed count only moves by what the steps computed (or is
  reset by a preemption, or set to the cached prefix on admission);
- a preempted sequence is WAITING, holds nothing, has lost no token and is
  not scheduled in the same step;
- an aborted sequence is FINISHED with reason "abort" and holds nothing;
- ``num_running <= max_batch_size``; ``num_waiting + num_running`` is the
  number of live requests; no two consecutive empty steps while work is left;

- pages are freed only for the sequences the plan preempts, that
  ``on_step_done`` reports finished, or that are aborted: never a step early;
- by default the loop is the overlapped one (``lag=1``): step N+1 is
  planned before step N's tokens arrive, so the scheduler sees them as
  pending tokens (:mod:`pitstop.requests.sequence`) and learns of finishes one step
  late; a sequence at its length limit has no uncomputed token and must not
  be scheduled; ``lag=0`` is the serial loop;

and at the end: every request that was not aborted finished with exactly its
``max_tokens`` outputs, the fake model's tokens in order (a preempted request
resumed where it left off), within a bound of steps (nothing starved), and the
allocator is back to every page free and no token held.

How a third party runs it (from its own test suite)::

    from pitstop import EngineConfig
    from pitstop.testing.scheduler import check_scheduler_contract

    from my_plugin import MyScheduler  # factory(config, allocator) -> Scheduler

    def test_my_scheduler_meets_the_contract():
        check_scheduler_contract(MyScheduler, max_examples=50)

    # With a real allocator (any ``factory(config, num_pages) -> Allocator``),
    # a fixed budget or fixed settings:
    def test_with_paged_pages():
        from pitstop.plugins.allocators.paged import create_paged
        check_scheduler_contract(
            MyScheduler,
            allocator_factory=create_paged,
            config_overrides={"prefill_priority": "low"},
            token_budget=lambda config: config.max_num_batched_tokens,
        )

One run without Hypothesis: :func:`simulate` with a :class:`Workload`.
Violations raise :class:`ContractViolation` (an ``AssertionError``).
Hypothesis is needed for :func:`check_scheduler_contract` and the
strategies (it is a test dependency of pitstop).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
from hypothesis import given
from hypothesis import strategies as st

from pitstop.config import EngineConfig
from pitstop.entrypoints.engine_args import engine_config
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.plugin_system.plugin_manager import get_plugin_manager
from pitstop.plugin_system.protocols import Allocator, AllocatorStats, Scheduler, StepPlan
from pitstop.plugin_system.registration import takes_settings
from pitstop.plugin_system.settings import read_settings
from pitstop.requests.sequence import Sequence, SequenceStatus
from pitstop.testing._hypothesis import suite_settings

SchedulerFactory = Callable[[EngineConfig, Allocator], Scheduler]
AllocatorFactory = Callable[[EngineConfig, int], Allocator]

__all__ = [
    "ContractViolation",
    "SimRequest",
    "SimResult",
    "ToyPagedAllocator",
    "Workload",
    "check_scheduler_contract",
    "fake_token",
    "scheduler_configs",
    "simulate",
    "workloads",
]


class ContractViolation(AssertionError):
    """A scheduler broke the contract; the message says which rule, at which step."""


def fake_token(key: int, position: int) -> int:
    """The fake model: the token sampled at ``position`` of request number ``key``."""
    return (key * 7919 + position * 104729) % 32000


def prompt_tokens(key: int, group: int, shared: int, length: int) -> list[int]:
    """A prompt whose first ``shared`` tokens are common to its group (so prefix caches hit)."""
    return [
        (group * 1000 + i) % 32000 if i < shared else fake_token(key + 1000, i)
        for i in range(length)
    ]


# ---------------------------------------------------------------- a toy allocator


class ToyPagedAllocator:
    """A minimal paged allocator that refuses every out-of-contract call loudly.

    The contract's default allocator, so a scheduler can be checked without
    any allocator plugin: ``allocate``/``append`` without room, admitting a
    sequence twice or growing one that is not admitted raise
    :class:`ContractViolation`.
    """

    def __init__(self, page_size: int, num_pages: int) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        self._held: dict[int, int] = {}

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def can_allocate(self, seq: Sequence) -> bool:
        return seq.seq_id not in self._tables and self._pages(seq.num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence) -> int:
        if seq.seq_id in self._tables:
            raise ContractViolation(f"allocate: {seq.request_id} is already admitted")
        if not self.can_allocate(seq):
            raise ContractViolation(
                f"allocate: no room for {seq.request_id}; ask can_allocate first"
            )
        self._tables[seq.seq_id] = [self._free.pop() for _ in range(self._pages(seq.num_tokens))]
        self._held[seq.seq_id] = seq.num_tokens
        return 0

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        if seq.seq_id not in self._tables:
            return False
        need = self._pages(self._held[seq.seq_id] + num_tokens) - len(self._tables[seq.seq_id])
        return need <= len(self._free)

    def append(self, seq: Sequence, num_tokens: int) -> None:
        if seq.seq_id not in self._tables:
            raise ContractViolation(f"append: {seq.request_id} is not admitted")
        if not self.can_append(seq, num_tokens):
            raise ContractViolation(f"append: no room for {seq.request_id}; ask can_append first")
        self._held[seq.seq_id] += num_tokens
        table = self._tables[seq.seq_id]
        while len(table) < self._pages(self._held[seq.seq_id]):
            table.append(self._free.pop())

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        self._held[seq.seq_id] -= num_tokens
        table = self._tables[seq.seq_id]
        while len(table) > self._pages(self._held[seq.seq_id]):
            self._free.append(table.pop())

    def free(self, seq: Sequence) -> None:
        table = self._tables.pop(seq.seq_id, None)
        if table is not None:
            del self._held[seq.seq_id]
            self._free.extend(reversed(table))

    def block_table(self, seq: Sequence) -> list[int]:
        return self._tables[seq.seq_id]

    def num_held_tokens(self, seq: Sequence) -> int:
        return self._held.get(seq.seq_id, 0)

    def on_tokens_computed(self, seq: Sequence) -> None:
        pass

    def stats(self) -> AllocatorStats:
        free = len(self._free)
        return AllocatorStats(
            num_pages=self.num_pages,
            pages_free=free,
            tokens_held=sum(self._held.values()),
            tokens_reserved=(self.num_pages - free) * self.page_size,
        )


def toy_allocator(config: EngineConfig, num_pages: int) -> ToyPagedAllocator:
    """The allocator factory the contract uses unless told otherwise."""
    return ToyPagedAllocator(config.page_size, num_pages)


# ---------------------------------------------------------------- workloads


@attrs.frozen
class SimRequest:
    """One simulated request: when it arrives, how long, and whether it is aborted (at which step)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    arrival_step: int = 0
    abort_step: int | None = None
    prefix_group: int = 0  # requests of one group share their first ``shared_prefix`` prompt tokens
    shared_prefix: int = 0


@attrs.frozen
class Workload:
    """Requests, and the KV cache size (in pages) they run on."""

    requests: tuple[SimRequest, ...]
    num_pages: int


@attrs.frozen
class SimResult:
    """What a simulation saw."""

    steps: int
    sequences: dict[str, Sequence]
    plans: list[StepPlan]
    preemptions: int
    max_wait_steps: dict[str, int]  # request -> steps from arrival to first being scheduled


def build_with_settings(factory: Callable[..., Any], config: EngineConfig, *args: Any) -> Any:
    """``factory(config, *args)``, handed its typed settings when it takes ``settings=``, read
    from ``config`` as the plugin manager reads a registered strategy's (a registered factory,
    or a strategy class with ``name`` and ``settings_class``, such as a subclass under test)."""
    if not takes_settings(factory):
        return factory(config, *args)
    for strategy in get_plugin_manager().strategies():
        if strategy.factory is factory:
            return factory(config, *args, settings=strategy.read_settings(config))
    declared = getattr(factory, "settings_class", None)  # a strategy class (or a subclass of one)
    if declared is not None and isinstance(getattr(factory, "name", None), str):
        return factory(config, *args, settings=read_settings(config, factory.name, declared))
    raise TypeError(
        f"{factory!r} takes settings= but is no registered strategy's factory; register it "
        "(its settings class is how its settings are read), or pass a factory without settings="
    )


def _fail(step: int, message: str) -> ContractViolation:
    return ContractViolation(f"step {step}: {message}")


def default_max_steps(workload: Workload) -> int:
    """A generous bound on the steps a workload may take before it counts as starved."""
    work = sum(r.prompt_len + r.max_tokens for r in workload.requests)
    last = max((r.arrival_step for r in workload.requests), default=0)
    return last + 5 * work + 100


class _WatchedAllocator:
    """The allocator the scheduler is given in a simulation: records every ``free``."""

    def __init__(self, inner: Allocator) -> None:
        self._inner = inner
        self.freed: list[Sequence] = []

    def free(self, seq: Sequence) -> None:
        self.freed.append(seq)
        self._inner.free(seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _check_frees(step: int, watch: _WatchedAllocator, allowed: list[Sequence], when: str) -> None:
    """Pages may be freed only for the sequences the engine or the plan says (none a step early)."""
    ids = {seq.seq_id for seq in allowed}
    for seq in watch.freed:
        if seq.seq_id not in ids:
            raise _fail(
                step,
                f"{when} freed the pages of {seq.request_id}, which is neither preempted nor "
                "reported finished or aborted (under the overlapped loop a finish is known one "
                "step late: free a sequence only when on_step_done or abort says so)",
            )
    watch.freed.clear()


def simulate(
    scheduler_factory: SchedulerFactory,
    config: EngineConfig,
    workload: Workload,
    *,
    allocator_factory: AllocatorFactory = toy_allocator,
    token_budget: Callable[[EngineConfig], int] | int | None = None,
    oversize_prompt_alone: bool = True,
    max_steps: int | None = None,
    on_step: Callable[[int, StepPlan, Scheduler], None] | None = None,
    lag: int = 1,
) -> SimResult:
    """Run ``workload`` through a scheduler with a fake model, checking the contract at every step.

    ``lag=1`` (the default) drives the scheduler as the overlapped engine
    loop does: step N+1 is planned and launched before step N's tokens are
    applied, so the scheduler sees them as pending tokens and learns of
    finishes one step late; ``lag=0`` is the serial loop. Either way the
    scheduler must never schedule a sequence after it was reported finished,
    never schedule a sequence at its length limit, free pages only of the
    sequences it preempts or is told are finished or aborted, and every
    request must end with exactly its ``max_tokens`` tokens.

    ``token_budget`` is the most tokens one step may compute (an int, or a
    function of the config; default ``max_num_batched_tokens``).
    ``on_step(step, plan, scheduler)`` is called after each plan is checked,
    before the fake model runs it (for extra, scheduler-specific checks).
    """
    if lag not in (0, 1):
        raise ValueError(f"lag must be 0 (serial loop) or 1 (overlapped loop), got {lag!r}")
    if token_budget is None:
        budget = config.max_num_batched_tokens
    elif callable(token_budget):
        budget = token_budget(config)
    else:
        budget = token_budget
    inner = build_with_settings(allocator_factory, config, workload.num_pages)
    start_stats = inner.stats()
    watch = _WatchedAllocator(inner)
    allocator: Allocator = watch  # type: ignore[assignment]
    scheduler = build_with_settings(scheduler_factory, config, allocator)
    max_steps = default_max_steps(workload) if max_steps is None else max_steps

    keys = {r.request_id: i for i, r in enumerate(workload.requests)}
    pending = sorted(workload.requests, key=lambda r: r.arrival_step)
    aborts: dict[int, list[str]] = {}
    for r in workload.requests:
        if r.abort_step is not None:
            aborts.setdefault(r.abort_step, []).append(r.request_id)
    reqs = {r.request_id: r for r in workload.requests}
    seqs: dict[str, Sequence] = {}
    live: dict[int, Sequence] = {}  # seq_id -> sequence not finished
    computed: dict[
        int, int | None
    ] = {}  # seq_id -> computed tokens as the simulated runner knows them
    seen_tokens: dict[int, int] = {}  # seq_id -> tokens known so far (outputs are never lost)
    arrival: dict[str, int] = {}
    first_step: dict[str, int] = {}
    plans: list[StepPlan] = []
    preemptions = 0
    empty_in_a_row = 0
    step = 0
    in_flight: tuple[StepPlan, list[tuple[Sequence, bool]]] | None = None

    def apply(launched: tuple[StepPlan, list[tuple[Sequence, bool]]] | None) -> None:
        """The fake model's tokens of a launched step arrive, as the engine applies them."""
        if launched is None:
            return
        plan, items = launched
        finished: list[Sequence] = []
        for seq, samples in items:
            if seq.is_finished:
                continue  # finished or aborted since launch: its token is discarded
            if seq.status is SequenceStatus.RUNNING:
                allocator.on_tokens_computed(seq)
            if not samples:
                continue
            position = seq.num_tokens - seq.num_pending_tokens
            seq.resolve_token(fake_token(keys[seq.request_id], position))
            if seq.num_output_tokens - seq.num_pending_tokens >= seq.sampling_params.max_tokens:
                seq.finish("length")
                finished.append(seq)
            seen_tokens[seq.seq_id] = seq.num_tokens
            if computed[seq.seq_id] is not None:
                computed[seq.seq_id] = seq.num_computed_tokens
        scheduler.on_step_done(plan, finished)
        _check_frees(step, watch, finished, "on_step_done()")
        for seq in finished:
            del live[seq.seq_id]
            if allocator.num_held_tokens(seq):
                raise _fail(
                    step,
                    f"finished {seq.request_id} still holds {allocator.num_held_tokens(seq)} slots",
                )

    while pending or live or in_flight is not None:
        if step > max_steps:
            stuck = sorted(s.request_id for s in live.values())
            raise _fail(
                step,
                f"requests {stuck} did not finish within {max_steps} steps (starved or livelocked)",
            )
        while pending and pending[0].arrival_step <= step:
            r = pending.pop(0)
            key = keys[r.request_id]
            params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
            seq = Sequence(
                r.request_id,
                prompt_tokens(key, r.prefix_group, r.shared_prefix, r.prompt_len),
                params,
            )
            scheduler.add(seq)
            seqs[r.request_id] = seq
            live[seq.seq_id] = seq
            computed[seq.seq_id] = None
            seen_tokens[seq.seq_id] = seq.num_tokens
            arrival[r.request_id] = step
        for rid in aborts.get(step, ()):
            seq = seqs.get(rid)
            if seq is None or seq.seq_id not in live:
                continue
            got = scheduler.abort(rid)
            if got is not seq:
                raise _fail(step, f"abort({rid!r}) returned {got!r}, not its sequence")
            if seq.status is not SequenceStatus.FINISHED or seq.finish_reason != "abort":
                raise _fail(
                    step, f"aborted {rid} is {seq.status}/{seq.finish_reason}, not FINISHED/abort"
                )
            if allocator.num_held_tokens(seq):
                raise _fail(
                    step, f"aborted {rid} still holds {allocator.num_held_tokens(seq)} slots"
                )
            _check_frees(step, watch, [seq], f"abort({rid!r})")
            del live[seq.seq_id]
        if scheduler.num_waiting + scheduler.num_running != len(live):
            raise _fail(
                step,
                f"num_waiting ({scheduler.num_waiting}) + num_running ({scheduler.num_running}) "
                f"!= {len(live)} live requests",
            )
        if bool(live) != scheduler.has_work():
            raise _fail(
                step, f"has_work() is {scheduler.has_work()} with {len(live)} live requests"
            )
        launched = None
        if live:
            plan = scheduler.schedule()
            _check_frees(step, watch, list(plan.preempted), "schedule()")
            plans.append(plan)
            _check_plan(
                step,
                plan,
                config,
                budget,
                oversize_prompt_alone,
                allocator,
                scheduler,
                live,
                computed,
                seen_tokens,
            )
            preemptions += len(plan.preempted)
            for seq in plan.preempted:
                computed[seq.seq_id] = None
            if plan.scheduled:
                empty_in_a_row = 0
            else:
                empty_in_a_row += 1
                if empty_in_a_row > 1:
                    raise _fail(
                        step, "two empty steps in a row while requests are live (no progress)"
                    )
            if on_step is not None:
                on_step(step, plan, scheduler)
            # Launch: each chunk counts as computed; a step reaching the end samples a pending token.
            items: list[tuple[Sequence, bool]] = []
            for item in plan.scheduled:
                seq = item.seq
                first_step.setdefault(seq.request_id, step)
                samples = seq.num_computed_tokens + item.num_new_tokens >= seq.num_tokens
                seq.launch(item.num_new_tokens, samples=samples)
                computed[seq.seq_id] = seq.num_computed_tokens
                seen_tokens[seq.seq_id] = seq.num_tokens
                items.append((seq, samples))
            launched = (plan, items)
        if lag:
            apply(in_flight)
            in_flight = launched
        else:
            apply(launched)
        step += 1

    # Every request that was not aborted has exactly its outputs, in order.
    for rid, seq in seqs.items():
        r = reqs[rid]
        if seq.finish_reason == "abort":
            continue
        key = keys[rid]
        want = [fake_token(key, r.prompt_len + i) for i in range(r.max_tokens)]
        if seq.output_token_ids != want:
            raise _fail(step, f"{rid} produced {seq.output_token_ids}, expected {want}")
    if scheduler.has_work() or scheduler.num_waiting or scheduler.num_running:
        raise _fail(step, "the scheduler still holds work after every request finished")
    end = inner.stats()
    if end.tokens_held != 0 or end.pages_free != start_stats.pages_free:
        raise _fail(
            step,
            f"the allocator did not get everything back: {end.tokens_held} tokens held, "
            f"{end.pages_free} of {start_stats.pages_free} pages free",
        )
    waits = {rid: first_step[rid] - arrival[rid] for rid in first_step}
    return SimResult(
        steps=step, sequences=seqs, plans=plans, preemptions=preemptions, max_wait_steps=waits
    )


def _check_plan(
    step: int,
    plan: StepPlan,
    config: EngineConfig,
    budget: int,
    oversize_prompt_alone: bool,
    allocator: Allocator,
    scheduler: Scheduler,
    live: Mapping[int, Sequence],
    computed: dict[int, int | None],
    seen_tokens: Mapping[int, int],
) -> None:
    n_seqs = len(plan.scheduled)
    if n_seqs > config.max_batch_size:
        raise _fail(
            step, f"{n_seqs} sequences scheduled, max_batch_size is {config.max_batch_size}"
        )
    if scheduler.num_running > config.max_batch_size:
        raise _fail(
            step,
            f"{scheduler.num_running} sequences running, max_batch_size is {config.max_batch_size}",
        )
    total = plan.num_tokens
    if total > budget:
        only = plan.scheduled[0] if n_seqs == 1 else None
        whole_prompt = only is not None and only.num_new_tokens == only.seq.num_uncomputed_tokens
        if not (oversize_prompt_alone and whole_prompt):
            raise _fail(step, f"{total} tokens scheduled, the token budget is {budget}")
    prefills = sum(1 for s in plan.scheduled if s.seq.num_uncomputed_tokens > 1)
    bound = config.options.get("max_prefill_batch", config.max_batch_size)
    if prefills > bound:
        raise _fail(step, f"{prefills} prompts prefilling, max_prefill_batch is {bound}")
    ids: set[int] = set()
    for item in plan.scheduled:
        seq, n = item.seq, item.num_new_tokens
        rid = seq.request_id
        if seq.seq_id in ids:
            raise _fail(step, f"{rid} scheduled twice")
        ids.add(seq.seq_id)
        if seq.seq_id not in live:
            raise _fail(step, f"{rid} is scheduled but finished or aborted")
        if seq.status is not SequenceStatus.RUNNING:
            raise _fail(step, f"{rid} is scheduled with status {seq.status}")
        if n < 1 or n > seq.num_uncomputed_tokens:
            raise _fail(
                step, f"{rid} scheduled for {n} tokens with {seq.num_uncomputed_tokens} uncomputed"
            )
        held = allocator.num_held_tokens(seq)
        if held < seq.num_computed_tokens + n:
            raise _fail(step, f"{rid} holds {held} slots, needs {seq.num_computed_tokens + n}")
        known = computed[seq.seq_id]
        if (
            known is None
        ):  # admitted in this step: only the allocator's cached prefix counts as computed
            if seq.num_computed_tokens != seq.num_cached_prompt_tokens:
                raise _fail(
                    step,
                    f"{rid} admitted with {seq.num_computed_tokens} computed tokens but "
                    f"{seq.num_cached_prompt_tokens} cached",
                )
        elif seq.num_computed_tokens != known:
            raise _fail(
                step,
                f"{rid} claims {seq.num_computed_tokens} computed tokens; the runner computed {known}",
            )
        if seq.num_tokens != seen_tokens[seq.seq_id]:
            raise _fail(
                step, f"{rid} has {seq.num_tokens} tokens, {seen_tokens[seq.seq_id]} were generated"
            )
    for seq in plan.preempted:
        rid = seq.request_id
        if seq.seq_id in ids:
            raise _fail(step, f"{rid} is both preempted and scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens != 0:
            raise _fail(
                step,
                f"preempted {rid} is {seq.status} with {seq.num_computed_tokens} computed tokens",
            )
        if allocator.num_held_tokens(seq):
            raise _fail(step, f"preempted {rid} still holds {allocator.num_held_tokens(seq)} slots")
        if seq.num_tokens != seen_tokens[seq.seq_id]:
            raise _fail(
                step, f"preempted {rid} lost tokens: {seq.num_tokens} of {seen_tokens[seq.seq_id]}"
            )


# ---------------------------------------------------------------- Hypothesis


@st.composite
def scheduler_configs(draw: Any, **overrides: Any) -> EngineConfig:
    """Small engine configs that stress a scheduler; ``overrides`` fix settings."""
    max_batch_size = draw(st.integers(1, 8))
    values: dict[str, Any] = {
        "max_model_len": 64,
        "page_size": draw(st.sampled_from([1, 4, 8, 16])),
        "max_batch_size": max_batch_size,
        "max_prefill_batch": draw(st.integers(1, max_batch_size)),
        "max_num_batched_tokens": draw(st.sampled_from([4, 16, 32, 64, 256])),
        "chunk_size": draw(st.sampled_from([2, 8, 16, 33, 512])),
        "prefill_priority": draw(st.sampled_from(["high", "low"])),
        "admission": draw(st.sampled_from(["arrival", "shortest-first"])),
        "options": {"scheduler.max_wait_steps": draw(st.sampled_from([0, 3, 64]))},
    }
    values.update(overrides)
    if values["max_prefill_batch"] > values["max_batch_size"]:
        values["max_prefill_batch"] = values["max_batch_size"]
    return engine_config(**values)


@st.composite
def workloads(draw: Any, config: EngineConfig, max_requests: int = 10) -> Workload:
    """Requests that fit ``config.max_model_len``, arriving over time, some aborted, on a small cache."""
    max_len = config.max_model_len or 64
    n = draw(st.integers(1, max_requests))
    requests = []
    for i in range(n):
        prompt_len = draw(st.integers(1, max_len - 1))
        max_tokens = draw(st.integers(1, min(24, max_len - prompt_len)))
        arrival = draw(st.integers(0, 8))
        abort = (
            draw(st.none() | st.integers(arrival, arrival + 30))
            if draw(st.integers(0, 4)) == 0
            else None
        )
        requests.append(
            SimRequest(
                request_id=f"r{i}",
                prompt_len=prompt_len,
                max_tokens=max_tokens,
                arrival_step=arrival,
                abort_step=abort,
                prefix_group=draw(st.integers(0, 2)),
                shared_prefix=draw(st.integers(0, prompt_len)),
            )
        )
    # The cache holds at least one longest request (else nothing could finish), and often little more.
    min_pages = -(-max_len // config.page_size)
    num_pages = draw(st.integers(min_pages, 2 * min_pages))
    return Workload(tuple(requests), num_pages)


def check_scheduler_contract(
    scheduler_factory: SchedulerFactory,
    *,
    allocator_factory: AllocatorFactory = toy_allocator,
    config_overrides: Mapping[str, Any] | None = None,
    token_budget: Callable[[EngineConfig], int] | int | None = None,
    oversize_prompt_alone: bool = True,
    max_examples: int = 50,
    max_requests: int = 10,
    hypothesis_settings: Mapping[str, Any] | None = None,
    lags: tuple[int, ...] = (1, 0),
) -> None:
    """Run the contract on ``max_examples`` Hypothesis-drawn configs and workloads; raise on a violation.

    Each example runs under the overlapped loop's lag or the serial loop
    (``lags``, drawn per example). ``config_overrides`` fix settings of the
    drawn configs (for example
    ``{"admission": "arrival"}``); ``hypothesis_settings`` are extra
    ``hypothesis.settings`` keywords (for example ``{"phases": [Phase.generate]}``
    to skip shrinking); see :func:`simulate` for the rest.
    """
    overrides = dict(config_overrides or {})

    @suite_settings(max_examples, **dict(hypothesis_settings or {}))
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        config = data.draw(scheduler_configs(**overrides), label="config")
        workload = data.draw(workloads(config, max_requests=max_requests), label="workload")
        lag = data.draw(st.sampled_from(lags), label="lag")
        simulate(
            scheduler_factory,
            config,
            workload,
            lag=lag,
            allocator_factory=allocator_factory,
            token_budget=token_budget,
            oversize_prompt_alone=oversize_prompt_alone,
        )

    run()
