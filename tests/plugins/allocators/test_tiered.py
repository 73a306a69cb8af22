"""The ``tiered`` allocator: the contract suite, and its host tier under copies that stay in flight."""

from __future__ import annotations

import hypothesis
import pytest
import torch
from helpers.sequences import compute_all, seq
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from pitstop import EngineConfig
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.errors import ConfigError
from pitstop.plugins import PluginManager
from pitstop.plugins.allocators.tiered import TieredAllocator
from pitstop.plugins.allocators.tiered.copier import PageCopier, PageCopy
from pitstop.requests.sequence import Sequence
from pitstop.testing import allocator_state_machine
from pitstop.testing.allocator import AllocatorStateMachine

CONTRACT = hypothesis.settings(max_examples=60, stateful_step_count=40, deadline=None)


def tiered(num_pages: int = 12, host: int = 8, ahead: int = 2, **kw) -> TieredAllocator:
    return TieredAllocator(4, num_pages, max_host_pages=host, offload_ahead=ahead, **kw)


# ---------------------------------------------------------------- the contract

TestTieredContract = allocator_state_machine(tiered, name="TieredContract").TestCase
TestTieredContract.settings = CONTRACT

TestTieredTinyHostContract = allocator_state_machine(
    lambda: tiered(num_pages=10, host=3, ahead=0), name="TieredTinyHostContract"
).TestCase
TestTieredTinyHostContract.settings = CONTRACT


# ---------------------------------------------------------------- copies that stay in flight


class _ManualSignal:
    """A copy's end that comes only when the test says (or when someone waits for it)."""

    def __init__(self, log: list[_ManualSignal]) -> None:
        self.finished = False
        log.append(self)

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.finished = True

    def seconds(self) -> float:
        return 0.001

    def fence(self) -> None:
        pass


class ManualCopier(PageCopier):
    """Moves the bytes at once (stream order on a GPU), but each copy stays in flight until
    :meth:`finish` (a GPU copy that has not ended yet)."""

    def __init__(self, kv_cache: torch.Tensor, host_slots: int) -> None:
        super().__init__(kv_cache, host_slots)
        self.signals: list[_ManualSignal] = []

    def _copy(self, direction: str, pages: list[int], slots: list[int]) -> PageCopy:
        self._run(direction, pages, slots)
        nbytes = len(pages) * self.page_bytes
        return PageCopy(direction, pages, slots, nbytes, _ManualSignal(self.signals))

    def finish(self, count: int) -> None:
        for signal in [s for s in self.signals if not s.finished][:count]:
            signal.finished = True


class TieredMachine(AllocatorStateMachine):
    """The contract plus the traffic a host tier exists for: a conversation's next turn (its
    whole history plus a new message) after other traffic evicted the history; and the host
    tier's own invariants: no page leaked, no refcount below zero, no page written while a
    copy touches it, the host pool bounded and never reusing a slot a copy touches."""

    fresh = 1000  # token ids of the evicting traffic: no prefix shares them

    def make_allocator(self) -> TieredAllocator:
        return tiered(num_pages=10, host=6, ahead=2)

    @rule(data=st.data())
    def next_turn(self, data: st.DataObject) -> None:
        """A running, fully computed sequence ends; its next turn comes back with a new message."""
        done = {
            sid: s for sid, s in self.running.items() if s.num_computed_tokens == self.held[sid]
        }
        if not done:
            return
        seq = self._pick(data, done)
        history = list(seq.token_ids)
        self.allocator.free(seq)
        del self.running[seq.seq_id], self.held[seq.seq_id]
        room = self.max_sequence_tokens - len(history)
        if room < 1:
            return
        turn = Sequence(
            request_id=f"turn{next(self.names)}",
            prompt_token_ids=history + self._tokens(data, 1, room),
            sampling_params=SamplingParams(),
        )
        self.waiting[turn.seq_id] = turn
        self.prefixes.append(history)
        if data.draw(st.booleans(), label="other traffic first, then the turn"):
            self._other_traffic(data)
            self._admit(turn, data)

    @rule(data=st.data())
    def other_traffic(self, data: st.DataObject) -> None:
        """Other traffic evicts what nobody holds (:meth:`_other_traffic`)."""
        self._other_traffic(data)

    def _other_traffic(self, data: st.DataObject) -> None:
        """A request of tokens nobody shares takes (nearly) every free page, computes, and ends:
        the cached pages nobody holds are evicted."""
        free = self.allocator.stats().pages_free
        if not free:
            return
        n = data.draw(st.integers(max(1, (free - 2) * self.page_size), free * self.page_size))
        other = Sequence(
            request_id=f"other{next(self.names)}",
            prompt_token_ids=list(range(self.fresh, self.fresh + n)),
            sampling_params=SamplingParams(),
        )
        self.fresh += n
        if not self.allocator.can_allocate(other):
            return
        other.admit(self.allocator.allocate(other))
        self.running[other.seq_id] = other
        self.held[other.seq_id] = n
        self._compute(other, n)
        self.allocator.free(other)
        del self.running[other.seq_id], self.held[other.seq_id]

    @rule()
    def step_boundary(self) -> None:
        self.allocator.before_launch()

    def _compute(self, seq: Sequence, n: int) -> None:
        table = self.allocator.block_table(seq)
        start = seq.num_computed_tokens
        written = {table[t // self.page_size] for t in range(start, start + n)}
        self.allocator.before_launch()
        busy = self.allocator.busy_pages() & written
        assert not busy, f"{seq.request_id} writes pages {sorted(busy)} while a copy touches them"
        super()._compute(seq, n)

    @invariant()
    def no_page_leaked(self) -> None:
        a = self.allocator
        held = {p for s in self.running.values() for p in a.block_table(s)}
        free, pool = set(a._free), set(a._evictable)
        assert not free & pool and not free & held and not pool & held, "a page in two states"
        assert free | pool | held == set(range(a.num_pages)), "a page is in no state: leaked"
        assert min(a._refs, default=0) >= 0, f"a refcount below zero: {a._refs}"
        for page in range(a.num_pages):
            holders = sum(p == page for s in self.running.values() for p in a.block_table(s))
            assert a._refs[page] == holders, (
                f"page {page}: refcount {a._refs[page]}, {holders} holders"
            )

    @invariant()
    def host_pool_bounded(self) -> None:
        a = self.allocator
        assert (
            len(a.host)
            + a.host.num_free
            + sum(1 for c in a.in_flight() if c.direction == "to_host" for _ in c.host_slots)
            <= a.host.num_slots
        )
        slots = [e.slot for e in a.host.entries()]
        assert len(slots) == len(set(slots)) and all(0 <= s < a.host.num_slots for s in slots)
        saving = {s for c in a.in_flight() if c.direction == "to_host" for s in c.host_slots}
        assert not saving & set(slots), "a slot being written is findable already"
        handed = [p for c in a.in_flight() if c.direction == "to_host" for p in c.pages]
        held_new = {
            p
            for sid, s in self.running.items()
            for i, p in enumerate(a.block_table(s))
            if (i + 1) * self.page_size > s.num_computed_tokens
        }
        assert not set(handed) & held_new, "a page being saved was handed out for new tokens"

    @invariant()
    def each_page_saved_once(self) -> None:
        """A page (its uid) is on the host at most once, and not saved again while a save of
        it is in flight or done: a duplicate wastes host slots and copy bandwidth (the H200's
        multiturn run copied 334 GiB to a 64 GiB host tier before this held)."""
        a = self.allocator
        held = [e.uid for e in a.host.entries()]
        pending = [key[2] for keys in a._pending_keys.values() for key in keys]
        assert len(held) == len(set(held)), f"a page held twice on the host: {sorted(held)}"
        assert len(pending) == len(set(pending)), f"a page saved twice at once: {pending}"
        assert not set(pending) & set(held), "a page saved again while the host holds it"


TestTieredMachine = TieredMachine.TestCase
TestTieredMachine.settings = CONTRACT


class TieredInFlight(TieredMachine):
    """:class:`TieredMachine` with copies that end late (a GPU's side stream)."""

    def make_allocator(self) -> TieredAllocator:
        return tiered(num_pages=10, host=6, ahead=3, copier_factory=ManualCopier)

    @rule(count=st.integers(0, 3))
    def copies_end(self, count: int) -> None:
        self.allocator.copier.finish(count)


TestTieredInFlight = TieredInFlight.TestCase
TestTieredInFlight.settings = CONTRACT


# ---------------------------------------------------------------- behaviour


def test_an_evicted_prefix_hits_on_the_host_and_its_kv_comes_back() -> None:
    kv = torch.arange(1 * 2 * 6 * 4 * 1 * 1, dtype=torch.float32).reshape(1, 2, 6, 4, 1, 1)
    a = tiered(num_pages=6, host=8, ahead=0)
    a.bind_kv_cache(kv)
    first = seq(range(9), "first")  # two full pages and one token
    a.allocate(first)
    compute_all(a, first)
    pages = list(a.block_table(first)[:2])
    saved = kv[:, :, pages].clone()
    a.free(first)
    other = seq(range(100, 124), "other")  # six pages: evicts both cached pages
    assert a.allocate(other) == 0
    kv[:, :, pages] = -1.0  # overwritten by the other sequence
    compute_all(a, other)
    a.free(other)
    again = seq(list(range(9)) + [7, 7], "again")
    cached = a.allocate(again)
    assert cached == 8, "both full pages come back from the host"
    assert torch.equal(kv[:, :, a.block_table(again)[:2]], saved)
    a.before_launch()  # the step boundary books the finished copies
    stats = a.stats()
    assert stats.counters["host_hit_tokens"] == 8
    assert stats.counters["bytes_to_device"] == 2 * a.copier.page_bytes
    assert stats.counters["bytes_to_host"] >= 2 * a.copier.page_bytes
    assert stats.prefix_hit_tokens == 8


def test_fp8_pages_move_as_bytes() -> None:
    kv = torch.randn(2, 2, 4, 4, 2, 8).to(torch.float8_e4m3fn)
    copier = PageCopier(kv, 3)
    before = kv[:, :, 1].view(torch.uint8).clone()
    copier.to_host([1], [2]).wait()
    kv.view(torch.uint8)[:, :, 1] = 0
    copier.to_device([2], [3]).wait()
    assert torch.equal(kv[:, :, 3].view(torch.uint8), before)


def test_without_a_kv_cache_it_is_the_prefix_allocator() -> None:
    a = tiered()
    s = seq(range(9))
    a.allocate(s)
    assert not a.tier_on and a.host.num_slots == 0
    assert a.stats().counters["host_hit_tokens"] == 0


def test_the_plugin_sizes_its_pool_from_kv_offloading_size() -> None:
    pm = PluginManager()
    config = EngineConfig(model="x", allocator="tiered", options={"kv_offloading_size": 0.001})
    from pitstop.plugin_system.settings import resolve

    a = pm.create("allocator", "tiered", config, 16, settings=resolve(config, pm).of("allocator"))
    kv = torch.zeros(2, 2, 16, config.page_size, 2, 8)
    a.bind_kv_cache(kv)
    page_bytes = kv[:, :, 0].numel() * 4
    assert a.host.num_slots == int(0.001 * 2**30) // page_bytes


def test_tensor_parallel_is_refused_with_the_fix() -> None:
    from pitstop.plugins.allocators.tiered import TieredSettings, create_tiered

    config = EngineConfig(model="x", allocator="tiered", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="allocator='prefix'"):
        create_tiered(config, 16, settings=TieredSettings())
