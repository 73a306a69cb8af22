"""The schedulers: the contract suite on every built-in x allocator, and targeted behaviour."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import Phase

from pitstop import EngineConfig
from pitstop.entrypoints.engine_args import engine_config
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.plugin_system.plugin_manager import get_plugin_manager
from pitstop.plugin_system.protocols import Scheduler, StepPlan
from pitstop.plugins.allocators.paged import PagedAllocator, create_paged
from pitstop.plugins.allocators.preallocated import create_preallocated
from pitstop.plugins.allocators.prefix import create_prefix
from pitstop.plugins.schedulers.base import SchedulerError
from pitstop.plugins.schedulers.chunked import ChunkedScheduler
from pitstop.plugins.schedulers.continuous import ContinuousScheduler
from pitstop.plugins.schedulers.fcfs import FCFSScheduler
from pitstop.requests.sequence import Sequence, SequenceStatus
from pitstop.testing.scheduler import (
    ContractViolation,
    SimRequest,
    Workload,
    build_with_settings,
    check_scheduler_contract,
    simulate,
    toy_allocator,
)

SCHEDULERS: dict[str, tuple[type, dict[str, Any]]] = {
    "fcfs": (FCFSScheduler, {}),
    "continuous": (ContinuousScheduler, {}),
    "chunked": (
        ChunkedScheduler,
        {
            "token_budget": lambda c: get_plugin_manager().resolve(c).step_token_budget,
            "oversize_prompt_alone": False,
        },
    ),
}
ALLOCATORS: dict[str, Callable[..., Any]] = {
    "toy": toy_allocator,
    "paged": create_paged,
    "preallocated": create_preallocated,
    "prefix": create_prefix,
}


# ---------------------------------------------------------------- the contract


@pytest.mark.parametrize("allocator", ALLOCATORS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_contract(scheduler: str, allocator: str) -> None:
    factory, kwargs = SCHEDULERS[scheduler]
    check_scheduler_contract(
        factory, allocator_factory=ALLOCATORS[allocator], max_examples=60, **kwargs
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {"prefill_priority": "high", "admission": "arrival"},
        {"prefill_priority": "low", "admission": "shortest-first"},
        {"max_batch_size": 1, "max_prefill_batch": 1},
        {"page_size": 1, "max_num_batched_tokens": 4, "chunk_size": 2},
    ],
    ids=["high-arrival", "low-shortest", "batch-1", "tiny-budget"],
)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_contract_fixed_settings(scheduler: str, overrides: dict[str, Any]) -> None:
    factory, kwargs = SCHEDULERS[scheduler]
    check_scheduler_contract(
        factory,
        allocator_factory=create_paged,
        config_overrides=overrides,
        max_examples=25,
        **kwargs,
    )


# ---------------------------------------------------------------- broken schedulers are caught


class OverfullBatch(ContinuousScheduler):
    """Runs one sequence more than max_batch_size."""

    def __init__(self, config: EngineConfig, allocator: Any, *, settings: Any) -> None:
        super().__init__(config, allocator, settings=settings)
        self.max_batch_size += 1
        self.max_running += 1


class LeakyAbort(ContinuousScheduler):
    """Forgets an aborted request without freeing its pages."""

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._by_request.pop(request_id, None)
        if seq is None:
            return None
        (self.running if seq in self.running else self.waiting).remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return seq


class Starver(ContinuousScheduler):
    """Never admits request r0."""

    def admission_order(self):
        return (s for s in super().admission_order() if s.request_id != "r0")

    def _check_progress(self, step) -> None:
        pass


class Overcompute(ChunkedScheduler):
    """Schedules a decode for 2 tokens."""

    def schedule(self) -> StepPlan:
        plan = super().schedule()
        for i, s in enumerate(plan.scheduled):
            if s.num_new_tokens == 1:
                plan.scheduled[i] = type(s)(s.seq, 2)
        return plan


class NoGrowth(ContinuousScheduler):
    """Never asks the allocator for more slots."""

    def _ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return True


class OverBudget(ChunkedScheduler):
    """Ignores chunk_size for prompt chunks."""

    def __init__(self, config: EngineConfig, allocator: Any, *, settings: Any) -> None:
        super().__init__(config, allocator, settings=settings)
        self.token_budget = 10**6


class LosesOutputs(ContinuousScheduler):
    """Drops a preempted sequence's generated tokens."""

    def _preempt(self, seq: Sequence, step) -> None:
        del seq.token_ids[seq.num_prompt_tokens :]
        super()._preempt(seq, step)


BUSY = Workload(
    tuple(
        SimRequest(f"r{i}", prompt_len=10 + 3 * i, max_tokens=12, arrival_step=i % 3)
        for i in range(6)
    )
    + (SimRequest("r6", prompt_len=5, max_tokens=20, abort_step=4),),
    num_pages=12,
)


@pytest.mark.parametrize(
    ("broken", "budget", "message"),
    [
        (OverfullBatch, None, "sequences (scheduled|running), max_batch_size"),
        (LeakyAbort, None, "aborted r6 still holds"),
        (Starver, None, "did not finish|no progress"),
        (Overcompute, None, "uncomputed"),
        (NoGrowth, None, "slots"),
        (OverBudget, 8, "token budget"),
        (LosesOutputs, None, "lost tokens"),
    ],
)
def test_contract_catches_broken_schedulers(broken: type, budget: int | None, message: str) -> None:
    config = engine_config(
        max_model_len=64, page_size=4, max_batch_size=3, max_prefill_batch=2, chunk_size=8
    )
    workload = attrs.evolve(BUSY, num_pages=40) if broken is OverfullBatch else BUSY
    with pytest.raises(ContractViolation, match=message):
        simulate(
            broken, config, workload, token_budget=budget, oversize_prompt_alone=budget is None
        )


def test_hypothesis_entry_point_catches_a_broken_scheduler() -> None:
    with pytest.raises(ContractViolation):
        check_scheduler_contract(
            NoGrowth, max_examples=100, hypothesis_settings={"phases": [Phase.generate]}
        )


# ---------------------------------------------------------------- a tiny engine for targeted tests


def make_seq(rid: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(
        rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


def run_step(scheduler: Scheduler, allocator: Any) -> StepPlan:
    """One engine step with a fake model (token 7); sequences stop at max_tokens."""
    plan = scheduler.schedule()
    finished = []
    for s in plan.scheduled:
        seq = s.seq
        assert allocator.num_held_tokens(seq) >= seq.num_computed_tokens + s.num_new_tokens
        seq.num_computed_tokens += s.num_new_tokens
        allocator.on_tokens_computed(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(7)
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "length"
                finished.append(seq)
    scheduler.on_step_done(plan, finished)
    return plan


def build(
    cls: type, num_pages: int = 64, page_size: int = 4, **settings: Any
) -> tuple[Any, PagedAllocator]:
    config = engine_config(page_size=page_size, max_model_len=4096, **settings)
    allocator = PagedAllocator(page_size, num_pages)
    return build_with_settings(cls, config, allocator), allocator


def ids(plan: StepPlan) -> list[str]:
    return [s.seq.request_id for s in plan.scheduled]


def counts(plan: StepPlan) -> dict[str, int]:
    return {s.seq.request_id: s.num_new_tokens for s in plan.scheduled}


# ---------------------------------------------------------------- fcfs


def test_fcfs_nothing_joins_a_running_batch() -> None:
    sched, alloc = build(FCFSScheduler, max_batch_size=4, max_prefill_batch=4)
    sched.add(make_seq("a", 8, max_tokens=2))
    sched.add(make_seq("b", 8, max_tokens=6))
    assert sorted(ids(run_step(sched, alloc))) == ["a", "b"]
    sched.add(make_seq("c", 4, max_tokens=2))
    seen = []
    while sched.has_work():
        plan = run_step(sched, alloc)
        seen.append(ids(plan))
    first_c = next(i for i, step in enumerate(seen) if "c" in step)
    assert all("b" not in step for step in seen[first_c:])  # c ran only once b had finished
    assert all("c" not in step for step in seen[:first_c])
    assert seen[first_c - 1] == ["b"]  # b decoded alone after a left: nobody joined
    assert alloc.stats().pages_free == alloc.num_pages


def test_fcfs_batch_is_arrival_order_and_limited_by_pages() -> None:
    sched, alloc = build(FCFSScheduler, num_pages=5, max_batch_size=8, max_prefill_batch=8)
    for rid in "abc":
        sched.add(make_seq(rid, 8, max_tokens=1))  # 2 pages each: only a and b fit
    assert ids(run_step(sched, alloc)) == ["a", "b"]
    assert ids(run_step(sched, alloc)) == ["c"]


def test_fcfs_preempted_member_rejoins_its_batch() -> None:
    # 3 pages of 4: a and b admitted with 4 tokens each (1 page); growth forces a preemption.
    sched, alloc = build(FCFSScheduler, num_pages=3, max_batch_size=4, max_prefill_batch=4)
    a, b, c = (
        make_seq("a", 4, max_tokens=6),
        make_seq("b", 4, max_tokens=6),
        make_seq("c", 2, max_tokens=1),
    )
    for seq in (a, b):
        sched.add(seq)
    run_step(sched, alloc)
    sched.add(c)
    preempted: list[str] = []
    while sched.has_work():
        plan = run_step(sched, alloc)
        preempted += [s.request_id for s in plan.preempted]
        if "c" in ids(plan):
            assert a.is_finished and b.is_finished
    assert preempted and preempted[0] == "b"
    assert b.num_preemptions >= 1 and b.num_output_tokens == 6


# ---------------------------------------------------------------- continuous


def test_continuous_joins_after_a_step() -> None:
    sched, alloc = build(ContinuousScheduler, max_batch_size=4, max_prefill_batch=4)
    sched.add(make_seq("a", 8, max_tokens=10))
    assert ids(run_step(sched, alloc)) == ["a"]
    assert ids(run_step(sched, alloc)) == ["a"]
    sched.add(make_seq("b", 8))
    assert ids(run_step(sched, alloc)) == ["b"]  # high priority: the prompt runs first
    assert sorted(ids(run_step(sched, alloc))) == ["a", "b"]


def test_prefill_priority_high_separates_prefill_and_decode_steps() -> None:
    sched, alloc = build(
        ContinuousScheduler, max_batch_size=8, max_prefill_batch=2, prefill_priority="high"
    )
    for rid in "abc":
        sched.add(make_seq(rid, 6, max_tokens=5))
    assert counts(run_step(sched, alloc)) == {"a": 6, "b": 6}  # max_prefill_batch
    assert counts(run_step(sched, alloc)) == {"c": 6}  # waiting prompts before decodes
    assert counts(run_step(sched, alloc)) == {"a": 1, "b": 1, "c": 1}


def test_prefill_priority_low_mixes_decodes_first() -> None:
    sched, alloc = build(
        ContinuousScheduler,
        max_batch_size=8,
        max_prefill_batch=2,
        prefill_priority="low",
        max_num_batched_tokens=10,
    )
    sched.add(make_seq("a", 6, max_tokens=5))
    assert counts(run_step(sched, alloc)) == {"a": 6}
    sched.add(make_seq("b", 6))
    sched.add(make_seq("c", 6))
    assert counts(run_step(sched, alloc)) == {"a": 1, "b": 6}  # c does not fit the 3 tokens left
    assert counts(run_step(sched, alloc)) == {"a": 1, "b": 1, "c": 6}


def test_continuous_runs_a_prompt_longer_than_the_budget_alone() -> None:
    for priority in ("high", "low"):
        sched, alloc = build(
            ContinuousScheduler,
            max_num_batched_tokens=16,
            max_batch_size=4,
            max_prefill_batch=4,
            prefill_priority=priority,
        )
        sched.add(make_seq("a", 4, max_tokens=8))
        run_step(sched, alloc)
        sched.add(make_seq("long", 40))
        assert counts(run_step(sched, alloc)) == {"long": 40}


# ---------------------------------------------------------------- chunked


def test_chunked_splits_a_long_prompt_while_decodes_keep_running() -> None:
    sched, alloc = build(
        ChunkedScheduler,
        num_pages=1024,
        page_size=16,
        chunk_size=512,
        max_batch_size=8,
        max_prefill_batch=8,
    )
    decoders = [make_seq(f"d{i}", 10, max_tokens=50) for i in range(3)]
    for seq in decoders:
        sched.add(seq)
    assert counts(run_step(sched, alloc)) == {"d0": 10, "d1": 10, "d2": 10}
    long = make_seq("long", 2000, max_tokens=2)
    sched.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        plan = run_step(sched, alloc)
        c = counts(plan)
        assert plan.num_tokens <= 512
        assert all(c[d.request_id] == 1 for d in decoders)  # every decode runs every step
        chunks.append(c["long"])
        assert alloc.num_held_tokens(long) >= 2000  # pages for the whole prompt from admission
    assert chunks == [509, 509, 509, 473]
    assert sum(chunks) == 2000


def test_chunked_packs_several_short_prompts_in_one_step() -> None:
    sched, alloc = build(ChunkedScheduler, chunk_size=32, max_batch_size=8, max_prefill_batch=8)
    for rid in "abcd":
        sched.add(make_seq(rid, 10))
    assert counts(run_step(sched, alloc)) == {"a": 10, "b": 10, "c": 10, "d": 2}
    assert counts(run_step(sched, alloc)) == {"a": 1, "b": 1, "c": 1, "d": 8}


# ---------------------------------------------------------------- admission order and aging


@pytest.mark.parametrize("cls", [ContinuousScheduler, ChunkedScheduler])
def test_shortest_first_admits_short_prompts_first(cls: type) -> None:
    sched, alloc = build(cls, max_batch_size=1, max_prefill_batch=1, admission="shortest-first")
    sched.add(make_seq("long", 30, max_tokens=1))
    sched.add(make_seq("short", 3, max_tokens=1))
    sched.add(make_seq("mid", 10, max_tokens=1))
    order = []
    while sched.has_work():
        order += [rid for rid in ids(run_step(sched, alloc)) if rid not in order]
    assert order == ["short", "mid", "long"]


@pytest.mark.parametrize("cls", [ContinuousScheduler, ChunkedScheduler])
def test_aging_bounds_the_wait_of_a_long_prompt(cls: type) -> None:
    max_wait = 5
    sched, alloc = build(
        cls,
        max_batch_size=1,
        max_prefill_batch=1,
        admission="shortest-first",
        options={"scheduler.max_wait_steps": max_wait},
    )
    long = make_seq("long", 30, max_tokens=1)
    sched.add(long)
    sched.add(make_seq("s0", 3, max_tokens=1))
    step = 0
    while long.timestamps.first_scheduled is None:
        sched.add(make_seq(f"s{step + 1}", 3, max_tokens=1))  # a stream of short prompts
        run_step(sched, alloc)
        step += 1
        assert step <= max_wait + 2, "the long prompt starved"
    assert step >= max_wait  # it was overtaken until it aged


def test_arrival_order_never_overtakes() -> None:
    sched, alloc = build(ContinuousScheduler, max_batch_size=1, max_prefill_batch=1)
    sched.add(make_seq("long", 30, max_tokens=1))
    sched.add(make_seq("short", 3, max_tokens=1))
    assert ids(run_step(sched, alloc)) == ["long"]


# ---------------------------------------------------------------- preemption and abort


@pytest.mark.parametrize("cls", [FCFSScheduler, ContinuousScheduler, ChunkedScheduler])
def test_preemption_takes_the_newest_and_puts_it_at_the_front(cls: type) -> None:
    # 2 pages of 4 tokens: a and b fill one each; a's growth needs b's page.
    sched, alloc = build(cls, num_pages=2, max_batch_size=4, max_prefill_batch=4)
    a, b, c = (
        make_seq("a", 4, max_tokens=3),
        make_seq("b", 4, max_tokens=3),
        make_seq("c", 2, max_tokens=1),
    )
    sched.add(a)
    sched.add(b)
    run_step(sched, alloc)
    sched.add(c)
    b_tokens = list(b.token_ids)
    plan = run_step(sched, alloc)
    assert [s.request_id for s in plan.preempted] == ["b"]
    assert ids(plan) == ["a"]
    assert (
        b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    )
    assert b.token_ids == b_tokens  # its generated token is kept
    assert sched.waiting[0] is b and alloc.num_held_tokens(b) == 0
    while sched.has_work():
        run_step(sched, alloc)
    assert b.output_token_ids == [7, 7, 7] and a.output_token_ids == [7, 7, 7]
    assert alloc.stats().pages_free == 2


@pytest.mark.parametrize("cls", [FCFSScheduler, ContinuousScheduler, ChunkedScheduler])
def test_abort_from_waiting_and_running_frees_pages(cls: type) -> None:
    sched, alloc = build(cls, num_pages=4, max_batch_size=1, max_prefill_batch=1)
    running, waiting = make_seq("run", 8, max_tokens=10), make_seq("wait", 4)
    sched.add(running)
    sched.add(waiting)
    run_step(sched, alloc)
    assert alloc.num_held_tokens(running) > 0 and sched.num_running == 1 and sched.num_waiting == 1
    assert sched.abort("wait") is waiting
    assert waiting.status is SequenceStatus.FINISHED and waiting.finish_reason == "abort"
    assert sched.num_waiting == 0
    assert sched.abort("run") is running
    assert running.finish_reason == "abort" and alloc.num_held_tokens(running) == 0
    assert alloc.stats().pages_free == 4 and not sched.has_work()
    assert sched.abort("run") is None and sched.abort("nobody") is None


@pytest.mark.parametrize("cls", [FCFSScheduler, ContinuousScheduler, ChunkedScheduler])
def test_a_request_larger_than_the_cache_is_a_clear_error(cls: type) -> None:
    sched, alloc = build(cls, num_pages=2, max_batch_size=4, max_prefill_batch=4)
    sched.add(make_seq("huge", 20))
    with pytest.raises(SchedulerError, match="too small"):
        sched.schedule()


def test_first_scheduled_is_stamped_once() -> None:
    sched, alloc = build(ContinuousScheduler, num_pages=2, max_batch_size=4, max_prefill_batch=4)
    seq = make_seq("a", 4, max_tokens=2)
    sched.add(seq)
    run_step(sched, alloc)
    stamp = seq.timestamps.first_scheduled
    assert stamp is not None
    run_step(sched, alloc)
    assert seq.timestamps.first_scheduled == stamp


# ---------------------------------------------------------------- loading by name


@pytest.mark.parametrize("name", ["fcfs", "continuous", "chunked"])
def test_loaded_through_the_plugin_manager(name: str) -> None:
    from pitstop.plugins import PluginManager

    pm = PluginManager()
    strategy = pm.get("scheduler", name)
    assert strategy.distribution == "pitstop"
    assert strategy.description
    config = EngineConfig(scheduler=name, max_model_len=64, page_size=4)
    scheduler = pm.create("scheduler", name, config, PagedAllocator(4, 32))
    assert isinstance(scheduler, Scheduler)
    sched_factory = strategy.factory
    kwargs = SCHEDULERS[name][1]
    simulate(sched_factory, config, BUSY, **kwargs)


# ---------------------------------------------------------------- the overlapped loop's lag


class _FreesFinishedEarly(ContinuousScheduler):
    """Broken on purpose: ignores the lag and drops a sequence as soon as its tokens reach
    ``max_tokens``, counting the one still pending on the device, so its pages are freed a
    step before the engine reports it finished."""

    def schedule(self) -> StepPlan:
        for seq in list(self.running):
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                self._forget(seq)
        return super().schedule()


class _SchedulesPastTheEnd(ContinuousScheduler):
    """Broken on purpose: schedules one more decode for a sequence at its length limit."""

    def schedule(self) -> StepPlan:
        plan = super().schedule()
        from pitstop.plugin_system.protocols import ScheduledSequence

        ids = {s.seq.seq_id for s in plan.scheduled}
        extra = [
            ScheduledSequence(seq, 1)
            for seq in self.running
            if seq.seq_id not in ids and seq.num_uncomputed_tokens == 0
        ]
        return StepPlan(scheduled=[*plan.scheduled, *extra], preempted=plan.preempted)


def _lag_workload() -> Workload:
    return Workload(
        tuple(SimRequest(f"r{i}", prompt_len=5 + i, max_tokens=1 + i % 3) for i in range(4)),
        num_pages=32,
    )


def test_contract_catches_a_scheduler_that_frees_a_step_early() -> None:
    """Fine under the serial loop, caught under the overlapped loop's lag."""
    config = engine_config(max_model_len=64, page_size=4, max_batch_size=4, max_prefill_batch=4)
    simulate(_FreesFinishedEarly, config, _lag_workload(), lag=0)
    with pytest.raises(ContractViolation, match="freed the pages of r"):
        simulate(_FreesFinishedEarly, config, _lag_workload(), lag=1)


def test_contract_catches_a_scheduler_that_ignores_the_length_limit() -> None:
    """A sequence whose last (pending) token reaches max_tokens must not be scheduled again."""
    config = engine_config(max_model_len=64, page_size=4, max_batch_size=4, max_prefill_batch=4)
    with pytest.raises(ContractViolation, match="with 0 uncomputed"):
        simulate(_SchedulesPastTheEnd, config, _lag_workload(), lag=1)


@pytest.mark.parametrize("factory", [ContinuousScheduler, ChunkedScheduler, FCFSScheduler])
def test_builtin_schedulers_hold_under_both_loops(factory: Callable[..., Scheduler]) -> None:
    """The built-ins meet the contract with and without the lag, on a cache that preempts."""
    config = engine_config(
        max_model_len=64, page_size=4, max_batch_size=3, max_prefill_batch=3, chunk_size=8
    )
    requests = tuple(
        SimRequest(f"r{i}", prompt_len=3 + 7 * i, max_tokens=2 + 5 * (i % 3), arrival_step=i)
        for i in range(6)
    )
    for lag in (0, 1):
        result = simulate(
            factory,
            config,
            Workload(requests, num_pages=20),
            token_budget=lambda c: max(
                get_plugin_manager().resolve(c).step_token_budget, c.max_num_batched_tokens
            ),
            lag=lag,
        )
        assert all(seq.finish_reason == "length" for seq in result.sequences.values())
