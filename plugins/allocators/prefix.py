"""``prefix``: ``paged`` plus reuse of full pages whose whole token prefix was seen.

How a page becomes reusable. After each step the engine calls
``on_tokens_computed(seq)``; every page of ``seq`` that is now full *and*
whose tokens all have KV gets a chained hash, ``page_hash(parent's hash,
this page's token ids)``, and is entered in the cache together with its token
ids and the identity (``uid``) of the cached page before it. When a
sequence is admitted its full pages are looked up in order; a page is a hit
only if its hash matches, its stored token ids equal the sequence's, and its
stored parent is exactly the page matched just before. So a hash collision
can never serve wrong KV: the tokens of the whole prefix are compared.

Adapters. A sequence that runs with an adapter (``seq.adapter_id``, its LoRA's
``lora_int_id``) chains its first page from a root keyed by that id
(:func:`chain_root`), so the same prompt under two adapters, or under one and
the base model, never shares a cached page: their KV differ.

Sharing. A hit is shared read-only (a reference count per page); hits are
whole pages and the last token of a sequence is always recomputed, so new
tokens always go to pages of the sequence's own. A sequence whose last
holder frees a cached page leaves it in an LRU pool, still findable, until a
new page is needed and no never-cached page is free (then the least
recently freed one is evicted), or until the pool exceeds its capacity.

Setting (:class:`PrefixSettings`; ``--prefix.max-cached-pages``, ``[plugins.prefix]``):

``prefix.max_cached_pages``
    the most pages kept in the LRU pool once no sequence uses them (an
    integer >= 0; default: no limit besides the cache itself). ``0`` keeps
    nothing after its last holder is freed: pages are then shared only
    between sequences that are alive at the same time.

Counters: ``stats().prefix_queried_tokens`` adds every admitted sequence's
token count; ``prefix_hit_tokens`` the tokens served from the cache.
Free pages are a stack (the most recently freed page is reused first), and
within one freed sequence its last page enters the LRU pool first, so a
shared prefix outlives the tails that hang off it.

``truncate`` may drop shared pages whole (other holders keep them), but
refuses (``AllocatorUsageError``) to cut into the middle of a page another
sequence shares, because the next token would overwrite it, as
``Allocator.truncate`` allows. A shared page need not be in a leading run:
a page whose content was cached first in another page (its twin) is not
entered, and the page after it is entered chained to the twin, so a later
hit shares that page but not the one before it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import attrs

import pitstop
from pitstop.plugin_system.protocols import AllocatorStats
from pitstop.plugin_system.settings import setting
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


_ROOT_HASH = 0
_ROOT_UID = 0  # the "parent" of a sequence's first page; real uids start at 1


def page_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """The chained hash of one full page (deterministic within a process)."""
    return hash((parent_hash, token_ids))


def chain_root(seq: Sequence) -> tuple[int, int]:
    """(hash, uid) a sequence's first page chains from: keyed by its adapter, so that two
    adapters (or an adapter and the base model) never share cached pages of one prompt."""
    adapter = getattr(seq, "adapter_id", 0)
    if not adapter:
        return _ROOT_HASH, _ROOT_UID
    return hash(("adapter", adapter)), -adapter  # uids of real pages are >= 1


class _CachedPage:
    """What the cache knows about one hashed page."""

    __slots__ = ("hash", "parent_uid", "token_ids", "uid")

    def __init__(self, hash_: int, parent_uid: int, uid: int, token_ids: tuple[int, ...]) -> None:
        self.hash = hash_
        self.parent_uid = parent_uid
        self.uid = uid  # unique per cache entry, never reused: a child names its exact parent
        self.token_ids = token_ids


class _PrefixHolding(Holding):
    """A sequence's :class:`Holding` plus the cache keys of its leading full computed pages."""

    __slots__ = ("chain",)

    def __init__(self, table: list[int], held: int, chain: list[tuple[int, int]]) -> None:
        super().__init__(table, held)
        self.chain = chain  # (hash, uid of the cache entry with that content) per full page


class PrefixCachingAllocator(OnDemandPages):
    """Pages on demand, plus shared, refcounted, LRU-cached full prefix pages."""

    # The engine admits the other samples of an n > 1 request after the first computed the
    # prompt, so that they share its full pages instead of computing them again.
    shares_prefix_pages = True
    caches_prefixes = True  # allocate() serves cached leading pages without computing them

    def __init__(self, page_size: int, num_pages: int, max_cached_pages: int | None = None) -> None:
        super().__init__(page_size, num_pages)  # self._free: never-cached free pages, a stack
        self.max_cached_pages = num_pages if max_cached_pages is None else max_cached_pages
        self._evictable: OrderedDict[int, None] = (
            OrderedDict()
        )  # cached pages nobody holds, oldest first
        self._refs = [0] * num_pages
        self._cached: dict[int, _CachedPage] = {}  # page -> its cache entry
        self._buckets: dict[int, list[int]] = {}  # hash -> cached pages with that hash
        self._next_uid = _ROOT_UID + 1
        self._holdings: dict[int, _PrefixHolding] = {}  # seq_id -> table, tokens held, chain
        self._tokens_shared = 0  # (holders - 1) x page_size over the shared pages
        self._queried = 0
        self._hit = 0

    # ------------------------------------------------------------------ the cache
    def _find(self, hash_: int, parent_uid: int, token_ids: tuple[int, ...]) -> int | None:
        for page in self._buckets.get(hash_, ()):
            entry = self._cached[page]
            if entry.parent_uid == parent_uid and entry.token_ids == token_ids:
                return page
        return None

    def _register(self, page: int, hash_: int, parent_uid: int, token_ids: tuple[int, ...]) -> int:
        uid = self._next_uid
        self._next_uid += 1
        self._cached[page] = _CachedPage(hash_, parent_uid, uid, token_ids)
        self._buckets.setdefault(hash_, []).append(page)
        return uid

    def _unregister(self, page: int) -> None:
        entry = self._cached.pop(page)
        bucket = self._buckets[entry.hash]
        bucket.remove(page)
        if not bucket:
            del self._buckets[entry.hash]

    def _lookup(self, seq: Sequence) -> tuple[list[int], list[tuple[int, int]]]:
        """The cached pages that hold ``seq``'s leading full pages (never its last token)."""
        ps = self.page_size
        tokens = seq.token_ids
        pages: list[int] = []
        chain: list[tuple[int, int]] = []
        parent_hash, parent_uid = chain_root(seq)
        for i in range((seq.num_tokens - 1) // ps):
            chunk = tuple(tokens[i * ps : (i + 1) * ps])
            hash_ = page_hash(parent_hash, chunk)
            page = self._find(hash_, parent_uid, chunk)
            if page is None:
                break
            parent_hash, parent_uid = hash_, self._cached[page].uid
            pages.append(page)
            chain.append((parent_hash, parent_uid))
        return pages, chain

    # ------------------------------------------------------------------ pages
    def _available(self) -> int:
        return len(self._free) + len(self._evictable)

    def _take(self) -> int:
        """A page for new tokens: a never-cached one first, else evict the least recently freed."""
        if self._free:
            return self._free.pop()
        page, _ = self._evictable.popitem(last=False)
        self._unregister(page)
        return page

    def _release(self, page: int) -> None:
        if self._refs[page] > 1:
            self._tokens_shared -= self.page_size
        self._refs[page] -= 1
        if self._refs[page]:
            return
        if page in self._cached:
            self._evictable[page] = None
            while len(self._evictable) > self.max_cached_pages:
                old, _ = self._evictable.popitem(last=False)
                self._unregister(old)
                self._free.append(old)
        else:
            self._free.append(page)

    # ------------------------------------------------------------------ admission
    def _new_pages_needed(self, seq: Sequence, hits: list[int]) -> tuple[int, int]:
        """(pages to take, pages available for them) when admitting ``seq`` with ``hits``."""
        idle_hits = sum(1 for page in hits if not self._refs[page])  # they leave the LRU pool
        return pages_for(seq.num_tokens, self.page_size) - len(hits), self._available() - idle_hits

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``seq`` is new and its uncached pages fit."""
        if seq.seq_id in self._holdings or seq.num_tokens <= 0:
            return False
        need, available = self._new_pages_needed(seq, self._lookup(seq)[0])
        return need <= available

    def allocate(self, seq: Sequence) -> int:
        """Admit ``seq``, sharing its cached leading pages; return how many tokens they hold."""
        if seq.seq_id in self._holdings:
            raise AllocatorUsageError(f"sequence {seq.request_id!r} is already admitted")
        check_admissible(seq)
        hits, chain = self._lookup(seq)
        need, available = self._new_pages_needed(seq, hits)
        if need > available:
            raise OutOfPagesError(
                f"sequence {seq.request_id!r} needs {need} new pages ({len(hits)} cached); {available} are free"
            )
        for page in hits:  # take hits out of the LRU pool before evicting for new pages
            if not self._refs[page]:
                del self._evictable[page]
            else:
                self._tokens_shared += self.page_size  # a full page, now held once more
            self._refs[page] += 1
        table = hits + [self._take() for _ in range(need)]
        for page in table[len(hits) :]:
            self._refs[page] = 1
        self._holdings[seq.seq_id] = _PrefixHolding(table, seq.num_tokens, chain)
        self._tokens_held += seq.num_tokens
        cached_tokens = len(hits) * self.page_size
        self._queried += seq.num_tokens
        self._hit += cached_tokens
        return cached_tokens

    # ------------------------------------------------------------------ growth
    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the admitted ``seq`` can hold ``num_tokens`` more tokens."""
        holding = self._holdings.get(seq.seq_id)
        if holding is None or num_tokens < 0:
            return False
        need = pages_for(holding.held + num_tokens, self.page_size) - len(holding.table)
        return need <= self._available()

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq`` hold ``num_tokens`` more tokens, in pages of its own."""
        check_count(num_tokens, "append")
        holding = self._holding(seq)
        table = holding.table
        need = pages_for(holding.held + num_tokens, self.page_size) - len(table)
        if need > self._available():
            raise OutOfPagesError(
                f"sequence {seq.request_id!r} needs {need} more pages; {self._available()} are free"
            )
        for _ in range(need):
            page = self._take()
            self._refs[page] = 1
            table.append(page)
        holding.held += num_tokens
        self._tokens_held += num_tokens

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back ``seq``'s last ``num_tokens`` tokens; shared pages stay with their other holders."""
        holding = self._holding_to_truncate(seq, num_tokens)
        table, held = holding.table, holding.held
        new_held = held - num_tokens
        keep = pages_for(new_held, self.page_size)
        partial = (
            table[keep - 1] if new_held % self.page_size else None
        )  # the page new tokens will go to
        if partial is not None and self._refs[partial] > 1:
            raise AllocatorUsageError(
                f"cannot truncate sequence {seq.request_id!r} to {new_held} tokens: that cuts into page "
                f"{partial}, which other sequences share through the prefix cache"
            )
        while len(table) > keep:
            self._release(table.pop())
        if partial is not None and partial in self._cached:
            self._unregister(partial)  # its tail will be overwritten
        del holding.chain[new_held // self.page_size :]
        holding.held = new_held
        self._tokens_held -= num_tokens

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s pages; cached ones nobody else holds join the LRU pool, last page first."""
        holding = self._pop_holding(seq)
        if holding is None:
            return
        for page in reversed(holding.table):
            self._release(page)

    # ------------------------------------------------------------------ hashing
    def on_tokens_computed(self, seq: Sequence) -> None:
        """Enter in the cache every page of ``seq`` that is now full and computed."""
        holding = self._holdings.get(seq.seq_id)
        if holding is None:
            return
        ps = self.page_size
        table, chain = holding.table, holding.chain
        num_full = min(seq.num_computed_tokens, holding.held, seq.num_tokens) // ps
        if num_full <= len(chain):
            return
        parent_hash, parent_uid = chain[-1] if chain else chain_root(seq)
        tokens = seq.token_ids
        for i in range(len(chain), num_full):
            chunk = tuple(tokens[i * ps : (i + 1) * ps])
            hash_ = page_hash(parent_hash, chunk)
            page = table[i]
            twin = self._find(hash_, parent_uid, chunk)
            if page in self._cached and twin != page:  # a stale entry: this page's KV was rewritten
                self._unregister(page)
            if twin is None:
                uid = self._register(page, hash_, parent_uid, chunk)
            else:  # the same content is cached already (in another page, or this very one)
                uid = self._cached[twin].uid
            chain.append((hash_, uid))
            parent_hash, parent_uid = hash_, uid

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name), e.g. after the weights changed: their
        K and V belong to the old weights. Cached pages nobody holds become free; held ones
        stop being findable and go to the free stack when released. Returns True."""
        for page in list(self._cached):
            self._unregister(page)
        self._free.extend(self._evictable)
        self._evictable.clear()
        return True

    # ------------------------------------------------------------------ queries
    def refcount(self, page: int) -> int:
        """How many live sequences hold ``page``."""
        return self._refs[page]

    def is_cached(self, page: int) -> bool:
        """Whether ``page`` is in the prefix cache (findable by a later sequence)."""
        return page in self._cached

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages no sequence holds (the LRU pool)."""
        return len(self._evictable)

    def evictable_pages(self) -> list[int]:
        """The LRU pool, next to be evicted first."""
        return list(self._evictable)

    def stats(self) -> AllocatorStats:
        """Free pages include the LRU pool (they are reclaimed on demand)."""
        free = self._available()
        return AllocatorStats(
            num_pages=self.num_pages,
            pages_free=free,
            tokens_held=self._tokens_held,
            tokens_reserved=(self.num_pages - free) * self.page_size,
            tokens_shared=self._tokens_shared,
            prefix_queried_tokens=self._queried,
            prefix_hit_tokens=self._hit,
        )


@attrs.frozen
class PrefixSettings:
    """The settings of the ``prefix`` allocator."""

    max_cached_pages: int | None = setting(
        None,
        type=int,
        minimum=0,
        optional=True,
        help="most freed-but-cached prefix pages kept for reuse (LRU beyond it; unset: all pages)",
    )


def create_prefix(
    config: EngineConfig, num_pages: int, *, settings: PrefixSettings
) -> PrefixCachingAllocator:
    """Paged plus reuse of full pages whose token prefix was seen before (chained hash, refcount, LRU)."""
    return PrefixCachingAllocator(config.page_size, num_pages, settings.max_cached_pages)


@pitstop.hookimpl
def register_allocators(register) -> None:
    register("prefix", create_prefix, settings=PrefixSettings)
