"""``paged``: fixed-size pages handed out on demand through a block table.

A sequence that holds ``n`` tokens holds exactly ceil(n / page_size) pages,
in a per-sequence block table (token ``t`` lives in page
``table[t // page_size]``). Pages come from one free list used as a stack:
the most recently freed page is reused first (its cache lines are the
likeliest to still be warm, and the order is deterministic: a fresh
allocator hands out pages 0, 1, 2, ...). Every call touches only the pages it
adds or removes.

Samples of one prompt (``n > 1``). The engine admits the first sample, and
once it has computed the prompt, calls :meth:`PagedAllocator.share_prompt`
for each other sample before queueing it: that call takes a reference on
the first one's full prompt pages for the sample at once (so they stay
cached even if the first sample finishes, on its first token, before the
others are admitted), and the sample is then admitted with them (read-only,
reference-counted: a page returns to the free list when its last holder
frees it) and computes only the prompt's last partial page and what
follows. Only pages whose KV the first sample has computed are shared, and
the page holding the last prompt token never is, so no sample ever writes
into a shared page. A sample freed before it is admitted (aborted) drops
its references.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pitstop
from pitstop.plugin_system.protocols import AllocatorStats
from pitstop.plugins.allocators._common import (
    AllocatorUsageError,
    Holding,
    OnDemandPages,
    OutOfPagesError,
    check_admissible,
    check_count,
    pages_for,
)

if TYPE_CHECKING:
    from pitstop.config import EngineConfig
    from pitstop.requests.sequence import Sequence


class PagedAllocator(OnDemandPages):
    """Pages on demand; nothing cached; the samples of one prompt share its full pages."""

    shares_prefix_pages = True  # the engine holds an n > 1 request's other samples back

    def __init__(self, page_size: int, num_pages: int) -> None:
        super().__init__(page_size, num_pages)
        # seq_id of a sample not admitted yet -> the prompt pages it will share, one reference
        # each already taken (share_prompt), so that they outlive the sample that computed them;
        # at admission they become the first pages of its Holding
        self._pinned: dict[int, list[int]] = {}
        self._refs: dict[int, int] = {}  # page -> holders, for pages held by more than one

    # ------------------------------------------------------------------ sharing
    def share_prompt(self, child: Sequence, parent: Sequence) -> None:
        """Admit ``child`` (not admitted yet) with ``parent``'s computed full prompt pages.

        The pages are referenced for ``child`` now, so they stay whether or not
        ``parent`` is still running when ``child`` is admitted.
        """
        if child.seq_id in self._holdings:
            raise AllocatorUsageError(f"sequence {child.request_id!r} is already admitted")
        self._unpin(child.seq_id)
        pages = self._shareable_pages(child, parent)
        for page in pages:
            self._refs[page] = self._refs.get(page, 1) + 1
        if pages:
            self._pinned[child.seq_id] = pages

    def _shareable_pages(self, seq: Sequence, parent: Sequence) -> list[int]:
        """The parent's pages ``seq`` can share: full, computed, before the last prompt token."""
        holding = self._holdings.get(parent.seq_id)
        if holding is None or parent.token_ids[: seq.num_prompt_tokens] != seq.prompt_token_ids:
            return []
        full = min(seq.num_prompt_tokens - 1, parent.num_computed_tokens) // self.page_size
        return holding.table[:full]

    def _unpin(self, seq_id: int) -> None:
        """Drop the references a not-admitted sample holds on shared prompt pages."""
        for page in reversed(self._pinned.pop(seq_id, [])):
            self._release(page)

    # ------------------------------------------------------------------ admission
    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``seq`` is not admitted yet and its tokens fit in free pages."""
        if seq.seq_id in self._holdings or seq.num_tokens <= 0:
            return False
        shared = len(self._pinned.get(seq.seq_id, ()))
        return pages_for(seq.num_tokens, self.page_size) - shared <= len(self._free)

    def allocate(self, seq: Sequence) -> int:
        """Admit ``seq`` with pages for all its tokens; return how many it shares (already computed)."""
        if seq.seq_id in self._holdings:
            raise AllocatorUsageError(f"sequence {seq.request_id!r} is already admitted")
        check_admissible(seq)
        shared = self._pinned.get(seq.seq_id, [])
        need = pages_for(seq.num_tokens, self.page_size) - len(shared)
        if need > len(self._free):
            raise OutOfPagesError(
                f"sequence {seq.request_id!r} needs {need} pages for {seq.num_tokens} tokens; {len(self._free)} are free"
            )
        self._pinned.pop(seq.seq_id, None)  # its references pass to the block table
        table = shared + [self._free.pop() for _ in range(need)]
        self._holdings[seq.seq_id] = Holding(table, seq.num_tokens)
        self._tokens_held += seq.num_tokens
        return len(shared) * self.page_size

    # ------------------------------------------------------------------ growth
    def _new_pages_for(self, holding: Holding, num_tokens: int) -> int:
        return pages_for(holding.held + num_tokens, self.page_size) - len(holding.table)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the admitted ``seq`` can hold ``num_tokens`` more tokens."""
        holding = self._holdings.get(seq.seq_id)
        if holding is None or num_tokens < 0:
            return False
        return self._new_pages_for(holding, num_tokens) <= len(self._free)

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq`` hold ``num_tokens`` more tokens, taking pages as they fill."""
        check_count(num_tokens, "append")
        holding = self._holding(seq)
        need = self._new_pages_for(holding, num_tokens)
        if need > len(self._free):
            raise OutOfPagesError(
                f"sequence {seq.request_id!r} needs {need} more pages; {len(self._free)} are free"
            )
        for _ in range(need):
            holding.table.append(self._free.pop())
        holding.held += num_tokens
        self._tokens_held += num_tokens

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back ``seq``'s last ``num_tokens`` tokens; pages left empty return to the free list."""
        holding = self._holding_to_truncate(seq, num_tokens)
        holding.held -= num_tokens
        keep = pages_for(holding.held, self.page_size)
        table = holding.table
        while len(table) > keep:
            self._release(table.pop())
        self._tokens_held -= num_tokens

    def free(self, seq: Sequence) -> None:
        """Release every page of ``seq`` (a no-op for a sequence that holds none)."""
        self._unpin(seq.seq_id)  # a sample aborted before it was admitted
        holding = self._pop_holding(seq)  # preempted: readmitted without sharing
        if holding is None:
            return
        for page in reversed(holding.table):  # the sequence's first page is reused first
            self._release(page)

    def _release(self, page: int) -> None:
        """Drop one holder of ``page``; the last one returns it to the free list."""
        holders = self._refs.get(page)
        if holders is None:
            self._free.append(page)
        elif holders == 2:
            del self._refs[page]
        else:
            self._refs[page] = holders - 1

    # ------------------------------------------------------------------ queries
    def on_tokens_computed(self, seq: Sequence) -> None:
        """Nothing to do: paged caches nothing across sequences."""

    def stats(self) -> AllocatorStats:
        """Tokens held, pages in use x page_size reserved, pages free."""
        free = len(self._free)
        return AllocatorStats(
            num_pages=self.num_pages,
            pages_free=free,
            tokens_held=self._tokens_held,
            tokens_reserved=(self.num_pages - free) * self.page_size,
            tokens_shared=sum(h - 1 for h in self._refs.values()) * self.page_size,
        )


def create_paged(config: EngineConfig, num_pages: int) -> PagedAllocator:
    """Fixed-size pages handed out on demand through a block table."""
    return PagedAllocator(config.page_size, num_pages)


@pitstop.hookimpl
def register_allocators(register) -> None:
    register("paged", create_paged)
