"""The example plugin's own tests: what a third party writes against pitstop.testing."""

from __future__ import annotations

import hypothesis
from pitstop_example import LifoAllocator, make_lifo

from pitstop import EngineConfig
from pitstop.testing.allocator import allocator_state_machine, check_allocator
from pitstop.testing.scheduler import check_scheduler_contract

# 1. the allocator contract as a TestCase that pytest collects
TestLifoAllocatorContract = allocator_state_machine(
    lambda: LifoAllocator(num_pages=12, page_size=4)
).TestCase
TestLifoAllocatorContract.settings = hypothesis.settings(
    max_examples=30, stateful_step_count=30, deadline=None
)


# 2. or one call inside a test, with its own settings
def test_lifo_meets_the_allocator_contract() -> None:
    check_allocator(
        lambda: make_lifo(EngineConfig(page_size=2), 20),
        settings=hypothesis.settings(max_examples=20, deadline=None),
    )


def test_the_built_in_schedulers_run_on_lifo_pages() -> None:
    from pitstop.plugin_system.plugin_manager import get_plugin_manager

    continuous = get_plugin_manager().get("scheduler", "continuous").factory
    check_scheduler_contract(continuous, allocator_factory=make_lifo, max_examples=10)


def test_most_recently_freed_page_is_reused_first() -> None:
    from pitstop.entrypoints.sampling_params import SamplingParams
    from pitstop.requests.sequence import Sequence

    alloc = LifoAllocator(num_pages=8, page_size=4)
    a = Sequence("a", [1] * 8, SamplingParams())
    b = Sequence("b", [1] * 4, SamplingParams())
    alloc.allocate(a)
    alloc.allocate(b)
    freed = alloc.block_table(b)
    alloc.free(b)
    c = Sequence("c", [1] * 4, SamplingParams())
    alloc.allocate(c)
    assert alloc.block_table(c) == freed
