"""The three built-in allocators: the contract suite, and the behaviour each name promises."""

from __future__ import annotations

import hypothesis
import pytest
from helpers.sequences import compute_all, seq
from hypothesis import Phase

from pitstop import EngineConfig
from pitstop.errors import ConfigError
from pitstop.plugin_system.protocols import Allocator
from pitstop.plugins import PluginManager
from pitstop.plugins.allocators import prefix as prefix_module
from pitstop.plugins.allocators._common import AllocatorUsageError, OutOfPagesError
from pitstop.plugins.allocators.paged import PagedAllocator
from pitstop.plugins.allocators.preallocated import PreallocatedAllocator
from pitstop.plugins.allocators.prefix import PrefixCachingAllocator
from pitstop.requests.sequence import Sequence
from pitstop.testing import allocator_state_machine, check_allocator

CONTRACT = hypothesis.settings(max_examples=200, stateful_step_count=40, deadline=None)


def snapshot(allocator: Allocator, *seqs: Sequence) -> tuple:
    return allocator.stats(), [
        (list(allocator.block_table(s)), allocator.num_held_tokens(s)) for s in seqs
    ]


# ---------------------------------------------------------------- the contract, on every built-in

TestPagedContract = allocator_state_machine(
    lambda: PagedAllocator(4, 12), name="PagedContract"
).TestCase
TestPagedContract.settings = CONTRACT

TestPrefixContract = allocator_state_machine(
    lambda: PrefixCachingAllocator(4, 12), name="PrefixContract"
).TestCase
TestPrefixContract.settings = CONTRACT

TestPrefixSmallPoolContract = allocator_state_machine(
    lambda: PrefixCachingAllocator(3, 14, max_cached_pages=2), name="PrefixSmallPoolContract"
).TestCase
TestPrefixSmallPoolContract.settings = CONTRACT

TestPreallocatedContract = allocator_state_machine(
    lambda: PreallocatedAllocator(4, 26, max_model_len=32),
    exact_block_tables=False,
    name="PreallocatedContract",
).TestCase
TestPreallocatedContract.settings = CONTRACT


class _Draws:
    """Stands in for Hypothesis' ``data`` in a rule called by hand: its draws, in order."""

    def __init__(self, *values: object) -> None:
        self.values = list(values)

    def draw(self, strategy: object, label: str | None = None) -> object:
        return self.values.pop(0)


def test_contract_never_truncates_into_a_shared_page_behind_an_unshared_one() -> None:
    # CI drew this: "a" (8 zeros) and "b" admitted before either computed, "b" computes its
    # first page first, so "a"'s first page is b's twin (not cached) and its second page is
    # cached chained to b's; "c" (9 zeros) hits b's first page and a's second. The machine
    # took only a leading run of pages as shared and truncated "a" to 5 tokens, into page 1
    machine = allocator_state_machine(lambda: PrefixCachingAllocator(4, 12))()
    a, b, c = seq([0] * 8, "a"), seq([0] * 4 + [1], "b"), seq([0] * 9, "c")
    for s in (a, b):
        machine.waiting[s.seq_id] = s
        machine._admit(s, _Draws(False))  # admitted, not prefilled
    machine._compute(b, 5)
    machine._compute(a, 8)
    machine.waiting[c.seq_id] = c
    machine._admit(c, _Draws(False))
    allocator = machine.allocator
    own, shared = allocator.block_table(a)
    assert (allocator.refcount(own), allocator.refcount(shared)) == (1, 2)
    assert allocator.block_table(c)[:2] == [allocator.block_table(b)[0], shared]
    machine.pages_are_owned_once_or_shared_soundly()  # sound sharing, just not a leading run
    assert machine._truncation_targets(a) == [1, 2, 3, 4, 8]
    before = snapshot(allocator, a, c)
    with pytest.raises(AllocatorUsageError, match="share"):
        allocator.truncate(a, 3)  # 5 tokens: inside the shared page, refused
    assert snapshot(allocator, a, c) == before
    machine.truncate(_Draws(a.seq_id, 4))  # the rule drops the shared page whole
    assert allocator.block_table(a) == [own] and allocator.refcount(shared) == 1
    machine.tables_cover_what_is_held()
    machine.pages_are_owned_once_or_shared_soundly()
    machine.statistics_add_up()


# ---------------------------------------------------------------- the contract has teeth

CATCH = hypothesis.settings(
    max_examples=300, stateful_step_count=40, deadline=None, database=None, phases=[Phase.generate], derandomize=True,
    report_multiple_bugs=False,
)  # fmt: skip


class LeaksOnFree(PagedAllocator):
    """Forgets to return a sequence's last page."""

    def free(self, seq: Sequence) -> None:
        holding = self._holdings.get(seq.seq_id)
        table = holding.table if holding is not None else None
        if table and len(table) > 1:
            table.pop()
        super().free(seq)


class HandsOutTwice(PagedAllocator):
    """Leaves an admitted sequence's last page on the free list, so it goes out again."""

    def allocate(self, seq: Sequence) -> int:
        cached = super().allocate(seq)
        self._free.append(self._holdings[seq.seq_id].table[-1])
        return cached


class RefusesDirtily(PagedAllocator):
    """Counts a refused sequence's tokens as held before finding out it does not fit."""

    def allocate(self, seq: Sequence) -> int:
        if not self.can_allocate(seq):
            self._tokens_held += seq.num_tokens
        return super().allocate(seq)


class TrustsTheHash(PrefixCachingAllocator):
    """Serves a page on a hash match alone, without comparing tokens."""

    def _find(self, hash_: int, parent_uid: int, token_ids: tuple[int, ...]) -> int | None:
        bucket = self._buckets.get(hash_)
        return bucket[0] if bucket else None


@pytest.mark.parametrize("broken", [LeaksOnFree, HandsOutTwice, RefusesDirtily])
def test_contract_catches_broken_allocators(broken: type[PagedAllocator]) -> None:
    with pytest.raises(AssertionError):
        check_allocator(lambda: broken(4, 12), settings=CATCH)


def test_contract_catches_a_hash_collision_served_as_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_module, "page_hash", lambda parent, tokens: 7)
    with pytest.raises(AssertionError, match="KV|shared"):
        check_allocator(lambda: TrustsTheHash(4, 12), settings=CATCH)


def test_contract_passes_the_prefix_allocator_under_constant_hash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prefix_module, "page_hash", lambda parent, tokens: 7)
    check_allocator(
        lambda: PrefixCachingAllocator(4, 12), settings=CATCH.__class__(CATCH, max_examples=60)
    )


# ---------------------------------------------------------------- loading by name


@pytest.mark.parametrize("name", ["preallocated", "paged", "prefix"])
def test_each_allocator_loads_through_the_plugin_manager(name: str) -> None:
    pm = PluginManager()
    strategy = pm.get("allocator", name)
    assert strategy.distribution == "pitstop"
    allocator = pm.create("allocator", name, EngineConfig(max_model_len=64, page_size=8), 32)
    assert isinstance(allocator, Allocator)
    assert allocator.page_size == 8 and allocator.num_pages == 32
    s = seq(range(20))
    assert allocator.can_allocate(s) and allocator.allocate(s) == 0
    assert allocator.num_held_tokens(s) == 20
    allocator.free(s)
    assert allocator.stats().pages_free == 32


def test_preallocated_needs_max_model_len() -> None:
    with pytest.raises(ConfigError, match="max_model_len"):
        PluginManager().create("allocator", "preallocated", EngineConfig(), 32)


def test_prefix_capacity_option_is_validated() -> None:
    with pytest.raises(ConfigError, match="prefix.max_cached_pages"):
        PluginManager().create(
            "allocator", "prefix", EngineConfig(options={"prefix.max_cached_pages": -1}), 8
        )
    allocator = PluginManager().create(
        "allocator", "prefix", EngineConfig(options={"prefix.max_cached_pages": 3}), 8
    )
    assert allocator.max_cached_pages == 3


# ---------------------------------------------------------------- preallocated


def test_preallocated_fits_num_pages_over_region_sequences() -> None:
    allocator = PreallocatedAllocator(
        page_size=16, num_pages=30, max_model_len=100
    )  # 7-page regions
    assert allocator.pages_per_region == 7 and allocator.num_regions == 4
    seqs = [seq(range(5), f"r{i}") for i in range(5)]
    for s in seqs[:4]:
        assert allocator.can_allocate(s)
        allocator.allocate(s)
    tables = [allocator.block_table(s) for s in seqs[:4]]
    assert sorted(p for t in tables for p in t) == list(range(28))
    for t in tables:
        assert t == list(range(t[0], t[0] + 7))  # one contiguous run
    assert not allocator.can_allocate(seqs[4])
    before = snapshot(allocator, *seqs[:4])
    with pytest.raises(OutOfPagesError):
        allocator.allocate(seqs[4])
    assert snapshot(allocator, *seqs[:4]) == before
    stats = allocator.stats()
    assert stats.tokens_held == 20 and stats.tokens_reserved == 400 and stats.pages_free == 2
    # growth inside the region always succeeds, up to max_model_len
    assert allocator.can_append(seqs[0], 95) and not allocator.can_append(seqs[0], 96)
    allocator.append(seqs[0], 95)
    with pytest.raises(OutOfPagesError):
        allocator.append(seqs[0], 1)
    allocator.free(seqs[1])
    assert allocator.can_allocate(seqs[4])


def test_preallocated_refuses_a_sequence_longer_than_max_model_len() -> None:
    allocator = PreallocatedAllocator(page_size=4, num_pages=16, max_model_len=8)
    long = seq(range(9))
    assert not allocator.can_allocate(long)
    with pytest.raises(AllocatorUsageError, match="max_model_len"):
        allocator.allocate(long)
    assert allocator.stats().pages_free == 16


# ---------------------------------------------------------------- paged


def test_paged_holds_ceil_tokens_over_page_size() -> None:
    allocator = PagedAllocator(page_size=16, num_pages=64)
    s = seq(range(100))
    allocator.allocate(s)
    assert len(allocator.block_table(s)) == 7
    stats = allocator.stats()
    assert (stats.tokens_held, stats.tokens_reserved, stats.pages_free) == (100, 112, 57)
    assert stats.utilization == pytest.approx(100 / 112)
    allocator.append(s, 12)  # 112: still 7 pages
    assert len(allocator.block_table(s)) == 7
    allocator.append(s, 1)
    assert len(allocator.block_table(s)) == 8


def test_paged_truncate_across_page_boundaries_returns_pages() -> None:
    allocator = PagedAllocator(page_size=4, num_pages=8)
    s = seq(range(10))  # 3 pages
    allocator.allocate(s)
    allocator.append(s, 7)  # 17 tokens: 5 pages
    table = list(allocator.block_table(s))
    assert len(table) == 5 and allocator.stats().pages_free == 3
    allocator.truncate(s, 9)  # 8 tokens: exactly 2 pages
    assert allocator.block_table(s) == table[:2] and allocator.num_held_tokens(s) == 8
    assert allocator.stats().pages_free == 6
    allocator.truncate(s, 0)
    assert allocator.num_held_tokens(s) == 8
    with pytest.raises(AllocatorUsageError):
        allocator.truncate(s, 9)
    allocator.append(s, 1)
    assert len(allocator.block_table(s)) == 3


def test_paged_refusals_change_nothing() -> None:
    allocator = PagedAllocator(page_size=4, num_pages=4)
    a, b = seq(range(10), "a"), seq(range(9), "b")
    allocator.allocate(a)  # 3 pages
    before = snapshot(allocator, a)
    assert not allocator.can_allocate(b) and not allocator.can_append(a, 7)
    with pytest.raises(OutOfPagesError):
        allocator.allocate(b)
    with pytest.raises(OutOfPagesError):
        allocator.append(a, 7)
    with pytest.raises(AllocatorUsageError):
        allocator.allocate(a)  # already admitted
    assert snapshot(allocator, a) == before
    allocator.free(b)  # unknown: a no-op
    assert snapshot(allocator, a) == before


def test_paged_reuses_the_most_recently_freed_page_first() -> None:
    allocator = PagedAllocator(page_size=4, num_pages=8)
    a, b, c = seq(range(8), "a"), seq(range(4), "b"), seq(range(8), "c")
    allocator.allocate(a)
    allocator.allocate(b)
    assert allocator.block_table(a) == [0, 1] and allocator.block_table(b) == [2]
    allocator.free(a)
    allocator.allocate(c)
    assert allocator.block_table(c) == [0, 1]


# ---------------------------------------------------------------- prefix


def test_prefix_hit_after_a_first_sequence_computed_the_shared_prefix() -> None:
    allocator = PrefixCachingAllocator(page_size=4, num_pages=16)
    shared = list(range(100, 110))  # 2 full pages + 2 tokens
    first, second = seq(shared + [1, 2], "first"), seq(shared + [3], "second")
    assert allocator.allocate(first) == 0
    # Not computed yet: nothing to share.
    early = seq(shared + [5], "early")
    assert allocator.allocate(early) == 0
    allocator.free(early)
    compute_all(allocator, first)
    assert allocator.allocate(second) == 8
    assert allocator.block_table(second)[:2] == allocator.block_table(first)[:2]
    assert allocator.block_table(second)[2] != allocator.block_table(first)[2]
    assert [allocator.refcount(p) for p in allocator.block_table(second)] == [2, 2, 1]
    stats = allocator.stats()
    assert stats.prefix_queried_tokens == 12 + 11 + 11 and stats.prefix_hit_tokens == 8
    assert stats.tokens_held == 23 and stats.pages_free == 16 - 4


def test_prefix_reset_forgets_every_cached_page() -> None:
    allocator = PrefixCachingAllocator(page_size=4, num_pages=16)
    a, held = seq(range(12), "a"), seq(range(100, 112), "held")
    for s in (a, held):
        allocator.allocate(s)
        compute_all(allocator, s)
    allocator.free(a)  # its pages stay cached, evictable
    assert allocator.num_evictable_pages == 3
    assert allocator.reset_prefix_cache() is True
    assert allocator.num_evictable_pages == 0
    assert allocator.allocate(seq(range(12), "again")) == 0  # nothing cached any more
    assert allocator.allocate(seq(range(100, 112), "held again")) == 0
    allocator.free(held)
    assert not any(allocator.is_cached(p) for p in range(16))


def test_prefix_always_recomputes_the_last_token() -> None:
    allocator = PrefixCachingAllocator(page_size=4, num_pages=16)
    a = seq(range(12), "a")
    allocator.allocate(a)
    compute_all(allocator, a)
    allocator.free(a)
    again = seq(range(12), "again")
    assert allocator.allocate(again) == 8  # 3 pages cached, the last one is recomputed
    assert allocator.block_table(again)[:2] == [0, 1] and allocator.block_table(again)[2] != 2


def test_prefix_a_hash_collision_never_serves_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_module, "page_hash", lambda parent, tokens: 42)
    allocator = PrefixCachingAllocator(page_size=4, num_pages=16)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    allocator.allocate(a)
    compute_all(allocator, a)
    # Same second page, different first page: the chain differs, so no hit at all.
    b = seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")
    assert allocator.allocate(b) == 0
    # The second page's tokens differ: only the first page is a hit.
    c = seq([1, 2, 3, 4, 5, 6, 7, 0, 9], "c")
    assert allocator.allocate(c) == 4
    # The second page alone, as a first page: its parent differs, no hit.
    d = seq([5, 6, 7, 8, 1], "d")
    assert allocator.allocate(d) == 0
    # The real prefix still hits through the collisions.
    e = seq([1, 2, 3, 4, 5, 6, 7, 8, 0], "e")
    assert allocator.allocate(e) == 8


def test_prefix_lru_evicts_the_least_recently_freed_page_first() -> None:
    allocator = PrefixCachingAllocator(page_size=2, num_pages=6)
    a, b = seq([1, 1, 1, 1, 9], "a"), seq([2, 2, 2, 2, 9], "b")  # 3 pages each, 2 cacheable
    allocator.allocate(a)
    allocator.allocate(b)
    compute_all(allocator, a)
    compute_all(allocator, b)
    pa, pb = list(allocator.block_table(a)), list(allocator.block_table(b))
    allocator.free(a)  # a's tail first: a[1], a[0] join the pool
    allocator.free(b)
    assert allocator.evictable_pages() == [pa[1], pa[0], pb[1], pb[0]]
    assert allocator.stats().pages_free == 6
    # 2 never-cached free pages (the last pages), then eviction in LRU order
    c = seq([3, 3, 3, 3, 3, 3, 3], "c")  # 4 pages
    allocator.allocate(c)
    assert sorted(allocator.block_table(c)[:2]) == sorted([pa[2], pb[2]])
    assert allocator.block_table(c)[2:] == [pa[1], pa[0]]
    assert allocator.evictable_pages() == [pb[1], pb[0]]
    assert not allocator.is_cached(pa[0]) and allocator.is_cached(pb[0])
    allocator.free(c)
    assert allocator.allocate(seq([2, 2, 2, 2, 9], "b again")) == 4
    assert allocator.allocate(seq([1, 1, 1, 1, 9], "a again")) == 0


def test_prefix_a_hit_refreshes_a_page_in_the_pool() -> None:
    allocator = PrefixCachingAllocator(page_size=2, num_pages=4)
    a, b = seq([1, 1, 9], "a"), seq([2, 2, 9], "b")
    for s in (a, b):
        allocator.allocate(s)
        compute_all(allocator, s)
    pa0 = allocator.block_table(a)[0]
    allocator.free(a)
    allocator.free(b)
    a2 = seq([1, 1, 7], "a2")
    assert allocator.allocate(a2) == 2  # a's page leaves the pool
    allocator.free(a2)  # and re-enters it as the most recent
    assert allocator.evictable_pages()[-1] == pa0


def test_prefix_capacity_knob_bounds_the_pool() -> None:
    allocator = PrefixCachingAllocator(page_size=2, num_pages=8, max_cached_pages=1)
    a = seq([1, 1, 2, 2, 3, 3, 9], "a")  # 3 cacheable pages
    allocator.allocate(a)
    compute_all(allocator, a)
    allocator.free(a)
    assert allocator.num_evictable_pages == 1
    assert allocator.stats().pages_free == 8
    assert allocator.allocate(seq([1, 1, 2, 2, 3, 3, 9], "again")) == 2  # the first page survived

    none_kept = PrefixCachingAllocator(page_size=2, num_pages=8, max_cached_pages=0)
    b, c = seq([1, 1, 2, 2, 9], "b"), seq([1, 1, 2, 2, 8], "c")
    none_kept.allocate(b)
    compute_all(none_kept, b)
    assert none_kept.allocate(c) == 4  # shared while b is alive
    none_kept.free(b)
    none_kept.free(c)
    assert none_kept.num_evictable_pages == 0
    assert none_kept.allocate(seq([1, 1, 2, 2, 9], "d")) == 0


def test_prefix_truncate_keeps_shared_pages_for_their_other_holders() -> None:
    allocator = PrefixCachingAllocator(page_size=4, num_pages=16)
    a = seq(range(13), "a")
    allocator.allocate(a)
    compute_all(allocator, a)
    b = seq(list(range(12)) + [99], "b")
    assert allocator.allocate(b) == 12
    shared = list(allocator.block_table(b)[:3])
    before = snapshot(allocator, a, b)
    with pytest.raises(AllocatorUsageError, match="share"):
        allocator.truncate(b, 3)  # would leave b writing into a shared page
    assert snapshot(allocator, a, b) == before
    allocator.truncate(b, 5)  # 8 tokens: drops one shared page whole, and b's own page
    assert allocator.block_table(b) == shared[:2]
    assert allocator.refcount(shared[2]) == 1 and allocator.block_table(a)[2] == shared[2]
    allocator.append(b, 1)
    assert allocator.block_table(b)[2] not in allocator.block_table(a)


def test_prefix_truncating_into_a_cached_page_uncaches_it() -> None:
    allocator = PrefixCachingAllocator(page_size=4, num_pages=16)
    a = seq(range(9), "a")
    allocator.allocate(a)
    compute_all(allocator, a)
    second = allocator.block_table(a)[1]
    assert allocator.is_cached(second)
    allocator.truncate(a, 3)  # 6 tokens: page 1 is partial and will be rewritten
    del a.token_ids[6:]
    a.num_computed_tokens = 6
    assert not allocator.is_cached(second)
    assert allocator.allocate(seq(range(9), "b")) == 4


def test_prefix_refusals_change_nothing() -> None:
    allocator = PrefixCachingAllocator(page_size=2, num_pages=4)
    a = seq([1, 1, 2, 2, 9], "a")
    allocator.allocate(a)
    compute_all(allocator, a)
    big = seq([1, 1, 2, 2, 3, 3, 4, 4, 5], "big")  # 5 pages, 2 of them cached: needs 3, 1 free
    before = snapshot(allocator, a)
    assert not allocator.can_allocate(big) and not allocator.can_append(a, 4)
    with pytest.raises(OutOfPagesError):
        allocator.allocate(big)
    with pytest.raises(OutOfPagesError):
        allocator.append(a, 4)
    assert snapshot(allocator, a) == before
    assert allocator.can_allocate(seq([1, 1, 2, 2, 3, 3], "fits"))  # 3 pages, 2 cached


def test_prefix_preempted_sequence_hits_its_own_pages() -> None:
    allocator = PrefixCachingAllocator(page_size=4, num_pages=16)
    s = seq(range(10), "s")
    allocator.allocate(s)
    compute_all(allocator, s)
    for token in (50, 51, 52):
        s.append_token(token)
        allocator.append(s, 1)
        compute_all(allocator, s)
    allocator.free(s)  # preempted by recompute
    s.num_computed_tokens = 0
    assert allocator.allocate(s) == 12
