"""``TieredAllocator``: the prefix allocator plus a host tier of evicted prefix pages.

The device tier is :class:`~pitstop.plugins.allocators.prefix.PrefixCachingAllocator`
unchanged (chained hashes, refcounts, an LRU pool of cached pages nobody
holds). The host tier (:class:`~.host_pool.HostPool`, its bytes in a
:class:`~.copier.PageCopier`) keeps copies of cached pages, keyed the same way.

Saving. A cached page leaves the device cache only when its page is taken
for new tokens (the LRU pool's oldest). Two paths bring it to the host:

- *ahead*: at each step boundary (:meth:`before_launch`) the oldest
  ``offload_ahead`` pages of the LRU pool that have no host copy are copied,
  asynchronously; by the time one is evicted its copy is usually done, and
  it leaves the device at no cost (the copy time is *hidden*);
- *at eviction*: a page evicted without a finished host copy is copied then,
  and the allocator waits for that copy before the call that took the page
  returns (*exposed* time), so a page is never handed out while a copy
  reads it.

Loading. ``allocate`` walks the device cache first, then the host tier from
where the device walk stopped. Pages that hit on the host get device pages
like any new page, are copied into them asynchronously and entered in the
device cache under the host entry's identity; ``allocate`` counts them as
cached. The step that reads them is ordered after the copy: on CUDA
:meth:`before_launch` makes the compute stream wait on the copy's event
(the step in flight is never blocked; a copy not yet done when the next
step is launched counts as exposed).

In flight. Every copy is a :class:`~.copier.PageCopy`; while one is
in flight its device pages and host slots are *busy*: a busy host slot is
never reused, and a busy device page is waited for before it is handed out
for new tokens. Finished copies are reaped at each boundary and whenever a
busy page or slot is needed.

Without a bound KV cache (built alone, or a host pool of 0 pages) it is the
prefix allocator exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch

from pitstop.plugin_system.protocols import AllocatorStats
from pitstop.plugins.allocators.prefix import (
    PrefixCachingAllocator,
    _CachedPage,
    chain_root,
    page_hash,
)
from pitstop.plugins.allocators.tiered.copier import PageCopier, PageCopy
from pitstop.plugins.allocators.tiered.counters import TierCounters
from pitstop.plugins.allocators.tiered.host_pool import HostEntry, HostPool

if TYPE_CHECKING:
    from pitstop.requests.sequence import Sequence

SAVE_AHEAD_CHUNK = 64  # pages per copy when saving ahead of eviction

CopierFactory = Callable[[torch.Tensor, int], Any]
"""``(kv_cache, host slots) -> copier`` (:class:`PageCopier`; tests pass their own)."""


class TieredAllocator(PrefixCachingAllocator):
    """Prefix caching on the device, plus a host pool of pages the device cache evicted."""

    def __init__(
        self,
        page_size: int,
        num_pages: int,
        *,
        host_bytes: int = 0,
        max_host_pages: int | None = None,
        offload_ahead: int = 1024,
        copier_factory: CopierFactory = PageCopier,
    ) -> None:
        super().__init__(page_size, num_pages)
        self.host_bytes = host_bytes
        self.max_host_pages = max_host_pages
        self.offload_ahead = offload_ahead
        self._copier_factory = copier_factory
        self.copier: Any = None  # set by bind_kv_cache
        self.host = HostPool(0)
        self.counters = TierCounters()
        self._in_flight: list[PageCopy] = []  # every copy not yet reaped, oldest first
        self._dev_busy: dict[int, list[PageCopy]] = {}  # device page -> copies touching it
        self._saves: dict[int, tuple[int, int, int, tuple[int, ...]]] = {}  # copy id -> keys
        self._pending_keys: dict[int, list[tuple[int, int, int, tuple[int, ...]]]] = {}
        self._pending_uids: set[int] = set()  # uids of the pages the saves in flight copy
        self._to_save: list[tuple[int, _CachedPage]] = []  # evicted this call, not on the host
        self._fenced: set[int] = set()  # ids of copies the compute stream already waits on

    # ------------------------------------------------------------------ set-up
    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Size the host pool on ``kv_cache``'s page bytes and allocate it (pinned on CUDA)."""
        page_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        slots = self.host_bytes // page_bytes if page_bytes else 0
        if self.max_host_pages is not None:
            slots = min(slots, self.max_host_pages) if self.host_bytes else self.max_host_pages
        if slots <= 0:
            return
        self.copier = self._copier_factory(kv_cache, slots)
        self.host = HostPool(slots)

    @property
    def tier_on(self) -> bool:
        """Whether the host tier exists (a KV cache was bound and the pool has slots)."""
        return self.copier is not None

    # ------------------------------------------------------------------ copies in flight
    def _track(self, copy: PageCopy) -> PageCopy:
        self._in_flight.append(copy)
        for page in copy.pages:
            self._dev_busy.setdefault(page, []).append(copy)
        self.host.mark_busy(copy.host_slots)
        return copy

    def _retire(self, copy: PageCopy) -> None:
        """Book a finished copy: pages and slots idle, a save's entries findable."""
        self._in_flight.remove(copy)
        for page in copy.pages:
            left = [c for c in self._dev_busy[page] if c is not copy]
            if left:
                self._dev_busy[page] = left
            else:
                del self._dev_busy[page]
        self.host.mark_idle(copy.host_slots)
        for slot, key in zip(copy.host_slots, self._pending_keys.pop(id(copy), ()), strict=False):
            self.host.enter(slot, *key)
            self._pending_uids.discard(key[2])
        self.counters.book(copy, exposed=copy.exposed)
        self._fenced.discard(id(copy))

    def reap(self) -> None:
        """Book every copy that has finished."""
        for copy in [c for c in self._in_flight if c.done()]:
            self._retire(copy)

    def _wait_page(self, page: int) -> None:
        """Wait for the copies touching device ``page`` (exposed time), then book them."""
        for copy in list(self._dev_busy.get(page, ())):
            self.counters.waited_s += copy.wait()
            copy.exposed = True
            self._fenced.add(id(copy))
            self._retire(copy)

    def busy_pages(self) -> set[int]:
        """Device pages a copy in flight touches."""
        return set(self._dev_busy)

    def busy_slots(self) -> set[int]:
        """Host slots a copy in flight touches."""
        return set(self.host.busy)

    def in_flight(self) -> list[PageCopy]:
        """The copies not yet booked, oldest first."""
        return list(self._in_flight)

    # ------------------------------------------------------------------ saving
    def _take(self) -> int:
        """A page for new tokens (see the prefix allocator); an evicted page without a host copy
        is queued for :meth:`_flush_saves`, and a busy one waited for first."""
        if not self._free and self.tier_on:
            victim = next(iter(self._evictable))
            self._wait_page(victim)
            entry = self._cached[victim]
            if not self.host.holds_uid(entry.uid) and not self._save_pending(entry.uid):
                self._to_save.append((victim, entry))
        page = super()._take()
        self._wait_page(page)
        return page

    def _save_pending(self, uid: int) -> bool:
        return uid in self._pending_uids

    def _save(self, pages: list[tuple[int, _CachedPage]]) -> PageCopy | None:
        """Start one copy of ``pages`` into free host slots (as many as are not busy)."""
        slots: list[int] = []
        kept: list[tuple[int, _CachedPage]] = []
        for page, entry in pages:
            slot = self.host.take_slot()
            if slot is None:
                self.counters.saves_dropped += 1
                continue
            slots.append(slot)
            kept.append((page, entry))
        if not kept:
            return None
        copy = self.copier.to_host([p for p, _ in kept], slots)
        self._pending_keys[id(copy)] = [(e.hash, e.parent_uid, e.uid, e.token_ids) for _, e in kept]
        self._pending_uids.update(e.uid for _, e in kept)  # not saved again while in flight
        return self._track(copy)

    def _flush_saves(self) -> None:
        """Copy the pages evicted during this call to the host, and wait: their device pages
        are handed out when the call returns."""
        if not self._to_save:
            return
        pages, self._to_save = self._to_save, []
        copy = self._save(pages)
        if copy is not None:
            self.counters.waited_s += copy.wait()
            copy.exposed = True
            self._fenced.add(id(copy))
            self._retire(copy)

    def _save_ahead(self) -> None:
        """Start copying the LRU pool's oldest pages that have no host copy yet."""
        batch: list[tuple[int, _CachedPage]] = []
        for page in self._evictable:
            if len(batch) >= self.offload_ahead:
                break
            entry = self._cached[page]
            if self.host.holds_uid(entry.uid) or entry.uid in self._pending_uids:
                continue
            batch.append((page, entry))
        for at in range(0, len(batch), SAVE_AHEAD_CHUNK):  # an eviction waits for its chunk only
            self._save(batch[at : at + SAVE_AHEAD_CHUNK])

    # ------------------------------------------------------------------ loading
    def _host_hits(self, seq: Sequence, chain: list[tuple[int, int]]) -> list[HostEntry]:
        """The host entries of ``seq``'s full pages right after its device hits."""
        ps = self.page_size
        tokens = seq.token_ids
        parent_hash, parent_uid = chain[-1] if chain else chain_root(seq)
        hits: list[HostEntry] = []
        for i in range(len(chain), (seq.num_tokens - 1) // ps):
            chunk = tuple(tokens[i * ps : (i + 1) * ps])
            entry = self.host.find(page_hash(parent_hash, chunk), parent_uid, chunk)
            if entry is None:
                break
            hits.append(entry)
            parent_hash, parent_uid = entry.hash, entry.uid
        return hits

    def allocate(self, seq: Sequence) -> int:
        """Admit ``seq``: device hits shared, host hits loaded into new pages (async), the rest
        new; return the tokens both tiers hold."""
        chain_before = self._lookup(seq)[1] if self.tier_on else []
        host_hits = self._host_hits(seq, chain_before) if self.tier_on else []
        protected = [e.slot for e in host_hits]
        self.host.mark_busy(protected)  # not reused by the saves of the pages this call evicts
        try:
            cached = super().allocate(seq)  # may raise, changing nothing
            self._flush_saves()
        finally:
            self.host.mark_idle(protected)
        self.counters.device_hit_tokens += cached
        if host_hits:
            holding = self._holdings[seq.seq_id]
            first = cached // self.page_size
            targets = holding.table[first : first + len(host_hits)]
            self._track(self.copier.to_device([e.slot for e in host_hits], targets))
            for page, entry in zip(targets, host_hits, strict=True):
                self._cached[page] = _CachedPage(
                    entry.hash, entry.parent_uid, entry.uid, entry.token_ids
                )
                self._buckets.setdefault(entry.hash, []).append(page)
                holding.chain.append((entry.hash, entry.uid))
            for entry in reversed(host_hits):  # the first page most recently used
                self.host.touch(entry)
            loaded = len(host_hits) * self.page_size
            self._hit += loaded
            self.counters.host_hit_tokens += loaded
            cached += loaded
        self.counters.miss_tokens += seq.num_tokens - cached
        return cached

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq`` (see the prefix allocator); pages it evicts go to the host first."""
        try:
            super().append(seq, num_tokens)
        finally:
            self._flush_saves()

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back ``seq``'s last tokens (see the prefix allocator); a page the next token will
        overwrite is first let go by any copy still reading or writing it."""
        super().truncate(seq, num_tokens)
        holding = self._holdings[seq.seq_id]
        if holding.held % self.page_size:
            self._wait_page(holding.table[-1])

    # ------------------------------------------------------------------ the step boundary
    def before_launch(self) -> None:
        """Book finished copies, order the next step after the loads it reads, and start
        copying the LRU pool's oldest pages to the host."""
        if not self.tier_on:
            return
        self.reap()
        for copy in self._in_flight:
            if copy.direction != "to_device" or id(copy) in self._fenced:
                continue
            self._fenced.add(id(copy))
            copy.exposed = copy.exposed or not copy.done()
            copy.fence()
        self._save_ahead()

    # ------------------------------------------------------------------ statistics
    def stats(self) -> AllocatorStats:
        """The prefix allocator's statistics, with the tier's counters (running totals)."""
        return attrs.evolve(super().stats(), counters=self.counters.as_dict())
