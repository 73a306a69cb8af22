"""The allocator contract suite: a Hypothesis state machine any allocator runs against itself.

The machine plays the engine: it creates sequences (many share a prefix
drawn from a small pool, so a prefix-caching allocator gets hits), admits
them, grows them, truncates them, computes their tokens, preempts, aborts
and frees them (each change to a sequence through its own methods, as the
engine makes it), and asks for more than fits so that refusals happen. It
keeps a shadow of the KV cache (for every slot, the token prefix whose KV
was written there) and checks after every step that

- every held page is an integer in ``range(num_pages)``, and no table lists
  a page twice;
- no page is in two block tables unless it is a shared prefix page: full
  and computed for every holder, at the same index, with identical token
  prefixes whose KV is the one written there;
- no token is ever computed into a page another sequence holds (a shared
  page is read-only);
- ``pages_free`` + the pages in all block tables == ``num_pages`` (cached
  pages that no sequence holds count as free);
- a block table covers exactly ceil(held / page_size) pages (or, for an
  allocator that reserves more up front, at least that many), and
  ``num_held_tokens`` and ``stats().tokens_held`` agree with what was asked,
  and ``tokens_shared`` counts each shared slot's extra holders (utilization <= 1);
- ``can_*`` never changes state, and a refused ``allocate``/``append``
  raises and changes nothing (statistics and every block table compared);
- the cached tokens ``allocate`` reports are whole pages whose KV is exactly
  the sequence's own prefix (a hash collision would show here);
- freeing everything restores the starting free count with nothing held.

Run it against your own allocator from your test suite, in one of two ways::

    from pitstop.testing.allocator import allocator_state_machine, check_allocator

    def make():
        return MyAllocator(page_size=4, num_pages=16)

    # 1. a unittest.TestCase that pytest collects
    TestMyAllocatorContract = allocator_state_machine(make).TestCase

    # 2. or one call inside a test, with your own Hypothesis settings
    def test_my_allocator_contract():
        check_allocator(make, settings=hypothesis.settings(max_examples=50))

or subclass :class:`AllocatorStateMachine` and override
:meth:`~AllocatorStateMachine.make_allocator`. Keep the cache small (a dozen
or two pages of a few tokens each) so that the machine runs out of pages
often. An allocator that reserves more pages than the tokens need (like
``preallocated``, whose block table is the whole region) passes
``exact_block_tables=False``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, ClassVar

import hypothesis
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.plugin_system.protocols import Allocator, AllocatorBase, AllocatorStats
from pitstop.requests.sequence import Sequence

__all__ = ["AllocatorStateMachine", "allocator_state_machine", "check_allocator"]

_Snapshot = tuple[AllocatorStats, dict[int, tuple[list[int], int]]]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ShadowKV:
    """The machine's KV cache: for every slot, which token prefix's KV it holds.

    A tensor shaped like the runner's cache (``[1 layer, K and V, pages, page_size,
    1 head, 1]``) holding one integer per slot (the prefix's number, -1 for nothing
    written), so that an allocator that copies pages' contents (``bind_kv_cache``)
    copies these too, and a wrong copy shows as a wrong prefix.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        import torch

        self.tensor = torch.full((1, 2, num_pages, page_size, 1, 1), -1, dtype=torch.int64)
        self._ids: dict[tuple[int, ...], int] = {}
        self._prefixes: list[tuple[int, ...]] = []

    def write(self, page: int, offset: int, prefix: tuple[int, ...]) -> None:
        """The KV of ``prefix``'s last token was computed into ``page`` at ``offset``."""
        number = self._ids.setdefault(prefix, len(self._prefixes))
        if number == len(self._prefixes):
            self._prefixes.append(prefix)
        self.tensor[:, :, page, offset] = number

    def read(self, page: int, offset: int) -> tuple[int, ...] | None:
        """The prefix whose KV the slot holds (None: nothing written); K and V must agree."""
        k, v = (int(x) for x in self.tensor[0, :, page, offset, 0, 0])
        if k != v:
            return None
        return self._prefixes[k] if k >= 0 else None


class AllocatorStateMachine(RuleBasedStateMachine):
    """The allocator contract as a Hypothesis ``RuleBasedStateMachine``.

    Subclass it and override :meth:`make_allocator` (or use
    :func:`allocator_state_machine`). Class attributes tune it:

    ``exact_block_tables``
        True (default): a sequence holding ``n`` tokens has exactly
        ceil(n / page_size) pages and ``tokens_reserved`` is the pages in
        use times ``page_size``. False: at least that many pages.
    ``max_sequence_tokens``
        the longest prompt the machine makes.
    ``max_live_sequences``
        how many sequences exist at once (waiting + admitted).
    ``vocab_size``
        token ids are drawn from ``range(vocab_size)``.
    """

    exact_block_tables: ClassVar[bool] = True
    max_sequence_tokens: ClassVar[int] = 40
    max_live_sequences: ClassVar[int] = 6
    vocab_size: ClassVar[int] = 5

    def make_allocator(self) -> Allocator:
        """Build a fresh allocator (override this); keep it small so pages run out."""
        raise NotImplementedError("override make_allocator() to return the allocator under test")

    def __init__(self) -> None:
        super().__init__()
        self.allocator = self.make_allocator()
        self.page_size: int = self.allocator.page_size
        self.num_pages: int = self.allocator.num_pages
        self.start = self.allocator.stats()
        assert self.start.num_pages == self.num_pages, (
            f"stats().num_pages {self.start.num_pages} != {self.num_pages}"
        )
        assert self.start.pages_free == self.num_pages, (
            f"a fresh allocator has {self.start.pages_free} of {self.num_pages} pages free"
        )
        assert self.start.tokens_held == 0 and self.start.tokens_reserved == 0, (
            f"a fresh allocator holds {self.start}"
        )
        self.waiting: dict[int, Sequence] = {}
        self.running: dict[int, Sequence] = {}
        self.held: dict[int, int] = {}  # seq_id -> tokens it should hold
        # The shadow KV cache: for every slot, the token prefix whose KV was written there. An
        # allocator that moves pages' contents (a host tier) is bound to it and moves it.
        self.kv = ShadowKV(self.num_pages, self.page_size)
        AllocatorBase.of(self.allocator, "bind_kv_cache")(self.kv.tensor)
        self.prefixes: list[list[int]] = [[]]
        self.names = itertools.count()
        self.last_stats = self.start

    # ------------------------------------------------------------------ helpers
    def _snapshot(self) -> _Snapshot:
        tables = {
            sid: (list(self.allocator.block_table(seq)), self.allocator.num_held_tokens(seq))
            for sid, seq in self.running.items()
        }
        return self.allocator.stats(), tables

    def _assert_unchanged(self, before: _Snapshot, what: str) -> None:
        after = self._snapshot()
        assert after[0] == before[0], f"{what} changed the statistics: {before[0]} -> {after[0]}"
        for sid, (table, held) in before[1].items():
            assert after[1][sid] == (table, held), (
                f"{what} changed sequence {self.running[sid].request_id}'s (block table, held): "
                f"{(table, held)} -> {after[1][sid]}"
            )

    def _expect_refusal(self, call: Callable[[], Any], what: str) -> None:
        before = self._snapshot()
        try:
            call()
        except Exception:
            pass
        else:
            raise AssertionError(f"{what} should have raised")
        self._assert_unchanged(before, f"the refused {what}")

    def _tokens(self, data: st.DataObject, min_size: int, max_size: int) -> list[int]:
        return data.draw(
            st.lists(st.integers(0, self.vocab_size - 1), min_size=min_size, max_size=max_size)
        )

    def _pick(self, data: st.DataObject, pool: dict[int, Sequence]) -> Sequence:
        return pool[data.draw(st.sampled_from(sorted(pool)))]

    def _holders(self) -> dict[int, list[tuple[int, int]]]:
        """page -> [(seq_id, index in its block table)] over the admitted sequences."""
        holders: dict[int, list[tuple[int, int]]] = {}
        for sid, seq in self.running.items():
            for index, page in enumerate(self.allocator.block_table(seq)):
                holders.setdefault(page, []).append((sid, index))
        return holders

    def _check_kv(self, seq: Sequence, num_tokens: int, what: str) -> None:
        """The KV of ``seq``'s first ``num_tokens`` tokens is the KV of its own prefix."""
        table = self.allocator.block_table(seq)
        for t in range(num_tokens):
            page = table[t // self.page_size]
            written = self.kv.read(page, t % self.page_size)
            expected = tuple(seq.token_ids[: t + 1])
            assert written == expected, (
                f"{what}: token {t} of {seq.request_id} is in page {page} slot {t % self.page_size}, "
                f"whose KV was computed for the prefix {written}, not {expected}"
            )

    # ------------------------------------------------------------------ rules
    @initialize(data=st.data())
    def make_prefix_pool(self, data: st.DataObject) -> None:
        """A few shared prefixes of whole and partial pages, so prompts overlap."""
        ps = self.page_size
        for pages in data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)):
            length = min(pages * ps + data.draw(st.integers(0, 1)), self.max_sequence_tokens - 1)
            self.prefixes.append(self._tokens(data, length, length))

    @precondition(lambda self: len(self.waiting) + len(self.running) < self.max_live_sequences)
    @rule(data=st.data())
    def add_sequence(self, data: st.DataObject) -> None:
        """A new request: a pooled prefix (maybe empty) and a tail of its own; mostly admitted at once."""
        prefix = data.draw(st.sampled_from(self.prefixes))
        room = max(self.max_sequence_tokens - len(prefix), 1)
        tail = self._tokens(data, 0 if prefix else 1, room)
        seq = Sequence(
            request_id=f"seq{next(self.names)}",
            prompt_token_ids=prefix + tail,
            sampling_params=SamplingParams(),
        )
        self.waiting[seq.seq_id] = seq
        if data.draw(st.integers(0, 3), label="admit now unless 0"):
            self._admit(seq, data)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit_or_abort(self, data: st.DataObject) -> None:
        """Admit a waiting sequence (or, now and then, abort it: freeing it must change nothing)."""
        seq = self._pick(data, self.waiting)
        if data.draw(st.integers(0, 4), label="admit unless 0"):
            self._admit(seq, data)
            return
        before = self._snapshot()
        self.allocator.free(seq)
        self._assert_unchanged(before, f"freeing the waiting {seq.request_id}")
        del self.waiting[seq.seq_id]

    def _admit(self, seq: Sequence, data: st.DataObject) -> None:
        """Admit ``seq`` if ``can_allocate`` says so, else check the refusal."""
        before = self._snapshot()
        ok = self.allocator.can_allocate(seq)
        self._assert_unchanged(before, "can_allocate")
        if not ok:
            self._expect_refusal(
                lambda: self.allocator.allocate(seq), f"allocate({seq.request_id}) without room"
            )
            return
        cached = self.allocator.allocate(seq)
        assert isinstance(cached, int) and 0 <= cached < seq.num_tokens, (
            f"allocate returned {cached!r} cached tokens for a {seq.num_tokens}-token sequence"
        )
        assert cached % self.page_size == 0, (
            f"allocate reported {cached} cached tokens, not whole pages"
        )
        stats = self.allocator.stats()
        if stats.prefix_queried_tokens:
            hits = stats.prefix_hit_tokens - before[0].prefix_hit_tokens
            assert hits == cached, (
                f"prefix_hit_tokens grew by {hits}, but allocate reported {cached} cached"
            )
        del self.waiting[seq.seq_id]
        self.running[seq.seq_id] = seq
        self.held[seq.seq_id] = seq.num_tokens
        self._check_kv(seq, cached, "a prefix hit")
        seq.admit(cached)
        if data.draw(st.booleans(), label="prefill now"):
            self._compute(seq, seq.num_tokens - cached)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def admit_again(self, data: st.DataObject) -> None:
        """Admitting a sequence twice is refused."""
        seq = self._pick(data, self.running)
        assert not self.allocator.can_allocate(seq), (
            f"can_allocate is true for the admitted {seq.request_id}"
        )
        self._expect_refusal(
            lambda: self.allocator.allocate(seq), f"a second allocate({seq.request_id})"
        )

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        """Grow a sequence by 0..2 pages' worth of tokens (decode, drafts), or check the refusal."""
        seq = self._pick(data, self.running)
        n = data.draw(st.integers(0, 2 * self.page_size + 1))
        before = self._snapshot()
        ok = self.allocator.can_append(seq, n)
        self._assert_unchanged(before, "can_append")
        if not ok:
            self._expect_refusal(
                lambda: self.allocator.append(seq, n), f"append({seq.request_id}, {n}) without room"
            )
            return
        self.allocator.append(seq, n)
        for token in self._tokens(data, n, n):
            seq.append_token(token)
        self.held[seq.seq_id] += n

    def _truncation_targets(self, seq: Sequence) -> list[int]:
        """The token counts ``seq`` may be truncated to: at least one (the engine never
        truncates a sequence to nothing), and never inside a page another sequence holds too
        (``Allocator.truncate``'s contract); a shared page may go whole.

        Any page may be shared, not only a leading run: when a sequence's first page
        repeats one cached before it (its twin, which ``prefix`` keeps instead), its second
        page is cached chained to the twin, and a sequence that hits both shares the
        second page but not the first."""
        holders = self._holders()
        table = self.allocator.block_table(seq)
        ps = self.page_size
        return [
            n
            for n in range(1, self.held[seq.seq_id] + 1)
            if n % ps == 0 or len(holders[table[n // ps]]) < 2
        ]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        """Give back a sequence's tail: anywhere in its own pages, or whole shared pages."""
        seq = self._pick(data, self.running)
        held = self.held[seq.seq_id]
        new_held = data.draw(st.sampled_from(self._truncation_targets(seq)))
        self.allocator.truncate(seq, held - new_held)
        seq.truncate(seq.num_tokens - new_held)  # the computed count is capped at new_held too
        self.held[seq.seq_id] = new_held

    @precondition(
        lambda self: any(s.num_computed_tokens < self.held[sid] for sid, s in self.running.items())
    )
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        """Run a step for a sequence: write the KV of its next tokens, then tell the allocator."""
        pool = {sid: s for sid, s in self.running.items() if s.num_computed_tokens < self.held[sid]}
        seq = self._pick(data, pool)
        self._compute(
            seq, data.draw(st.integers(1, self.held[seq.seq_id] - seq.num_computed_tokens))
        )

    def _compute(self, seq: Sequence, n: int) -> None:
        AllocatorBase.of(self.allocator, "before_launch")()  # the step is about to be launched
        start = seq.num_computed_tokens
        holders = self._holders()
        table = self.allocator.block_table(seq)
        for t in range(start, start + n):
            page = table[t // self.page_size]
            others = [self.running[sid].request_id for sid, _ in holders[page] if sid != seq.seq_id]
            assert not others, (
                f"{seq.request_id} writes token {t} into page {page}, which {others} also hold"
            )
            self.kv.write(page, t % self.page_size, tuple(seq.token_ids[: t + 1]))
        seq.launch(n, samples=False)  # the step computes tokens start .. start + n - 1
        self.allocator.on_tokens_computed(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A sequence finishes: free it; freeing it again is a no-op. Now and then everything finishes."""
        if not data.draw(st.integers(0, 5), label="free everything if 0"):
            self._free_all()
            return
        seq = self._pick(data, self.running)
        self.allocator.free(seq)
        del self.running[seq.seq_id], self.held[seq.seq_id]
        assert self.allocator.num_held_tokens(seq) == 0, (
            f"the freed {seq.request_id} still holds tokens"
        )
        before = self._snapshot()
        self.allocator.free(seq)
        self._assert_unchanged(before, "freeing a freed sequence")

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """Preempt by recompute: free a sequence and queue it again with every token it has."""
        seq = self._pick(data, self.running)
        self.allocator.free(seq)
        del self.running[seq.seq_id], self.held[seq.seq_id]
        seq.preempt()  # no KV, every token kept
        self.waiting[seq.seq_id] = seq

    def _free_all(self) -> None:
        for seq in list(self.running.values()):
            self.allocator.free(seq)
        self.running.clear()
        self.held.clear()
        stats = self.allocator.stats()
        assert stats.pages_free == self.start.pages_free, (
            f"after freeing everything {stats.pages_free} pages are free, not {self.start.pages_free}"
        )
        assert stats.tokens_held == 0 and stats.tokens_reserved == 0, (
            f"after freeing everything: {stats}"
        )

    def teardown(self) -> None:
        self._free_all()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def tables_cover_what_is_held(self) -> None:
        ps = self.page_size
        for sid, seq in self.running.items():
            held = self.allocator.num_held_tokens(seq)
            assert held == self.held[sid], (
                f"{seq.request_id} holds {held} tokens, expected {self.held[sid]}"
            )
            table = self.allocator.block_table(seq)
            need = _ceil_div(held, ps)
            if self.exact_block_tables:
                assert len(table) == need, (
                    f"{seq.request_id} holds {held} tokens in {len(table)} pages, not {need}"
                )
            else:
                assert len(table) >= need, (
                    f"{seq.request_id} holds {held} tokens in only {len(table)} pages"
                )
            assert len(set(table)) == len(table), (
                f"{seq.request_id}'s block table lists a page twice: {table}"
            )
            for page in table:
                assert isinstance(page, int) and 0 <= page < self.num_pages, (
                    f"{seq.request_id} holds page {page!r}, outside range({self.num_pages})"
                )
        for seq in self.waiting.values():
            assert self.allocator.num_held_tokens(seq) == 0, (
                f"the waiting {seq.request_id} holds tokens"
            )

    @invariant()
    def pages_are_owned_once_or_shared_soundly(self) -> None:
        ps = self.page_size
        for page, holders in self._holders().items():
            if len(holders) < 2:
                continue
            names = [self.running[sid].request_id for sid, _ in holders]
            indexes = {index for _, index in holders}
            assert len(indexes) == 1, (
                f"page {page} is held by {names} at different positions {sorted(indexes)}"
            )
            end = (indexes.pop() + 1) * ps
            prefixes = set()
            for sid, _ in holders:
                seq = self.running[sid]
                assert self.held[sid] >= end and seq.num_computed_tokens >= end, (
                    f"page {page} is shared by {names} but is not full and computed for {seq.request_id}"
                )
                prefixes.add(tuple(seq.token_ids[:end]))
            assert len(prefixes) == 1, (
                f"page {page} is shared by {names}, whose token prefixes differ"
            )
            self._check_kv(self.running[holders[0][0]], end, f"shared page {page}")

    @invariant()
    def statistics_add_up(self) -> None:
        stats = self.allocator.stats()
        holders = self._holders()
        in_use = len(holders)
        assert stats.num_pages == self.num_pages
        assert stats.pages_free + in_use == self.num_pages, (
            f"pages_free {stats.pages_free} + pages in block tables {in_use} != num_pages {self.num_pages}"
        )
        assert stats.tokens_held == sum(self.held.values()), (
            f"stats().tokens_held {stats.tokens_held} != {sum(self.held.values())} held"
        )
        if self.exact_block_tables:
            assert stats.tokens_reserved == in_use * self.page_size, (
                f"tokens_reserved {stats.tokens_reserved} != {in_use} pages in use x {self.page_size}"
            )
            # each slot in use counted once: a page holds as many tokens as its fullest holder
            distinct = sum(
                max(
                    min(self.page_size, self.held[sid] - index * self.page_size)
                    for sid, index in hs
                )
                for hs in holders.values()
            )
            assert stats.tokens_held - stats.tokens_shared == distinct, (
                f"tokens_held {stats.tokens_held} - tokens_shared {stats.tokens_shared} != "
                f"{distinct} distinct slots in use (shared pages must be counted once)"
            )
        else:
            assert stats.tokens_reserved >= 0
        assert 0 <= stats.utilization <= 1, f"utilization {stats.utilization} outside [0, 1]"
        assert 0 <= stats.prefix_hit_tokens <= stats.prefix_queried_tokens
        assert stats.prefix_queried_tokens >= self.last_stats.prefix_queried_tokens
        assert stats.prefix_hit_tokens >= self.last_stats.prefix_hit_tokens
        self.last_stats = stats


def allocator_state_machine(
    factory: Callable[[], Allocator],
    *,
    exact_block_tables: bool = True,
    name: str | None = None,
    **attributes: Any,
) -> type[AllocatorStateMachine]:
    """A contract state machine for the allocators ``factory()`` builds (a fresh one per run).

    Its ``.TestCase`` is a ``unittest.TestCase`` pytest collects; set
    ``.TestCase.settings = hypothesis.settings(...)`` to tune it. Extra
    keyword arguments override :class:`AllocatorStateMachine`'s class
    attributes (``max_sequence_tokens=``, ``max_live_sequences=``, ...).
    """
    namespace: dict[str, Any] = {
        "make_allocator": lambda self: factory(),
        "exact_block_tables": exact_block_tables,
        **attributes,
    }
    return type(name or "AllocatorContract", (AllocatorStateMachine,), namespace)


def check_allocator(
    factory: Callable[[], Allocator],
    *,
    settings: hypothesis.settings | None = None,
    exact_block_tables: bool = True,
    **attributes: Any,
) -> None:
    """Run the contract against ``factory()``'s allocators; raise the first violation found (shrunk)."""
    machine = allocator_state_machine(factory, exact_block_tables=exact_block_tables, **attributes)
    run_state_machine_as_test(machine, settings=settings)
