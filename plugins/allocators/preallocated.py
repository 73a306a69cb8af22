"""``preallocated``: every admitted sequence reserves ``max_model_len`` tokens up front.

The article's baseline. The cache is cut into regions of
ceil(max_model_len / page_size) consecutive pages; an admitted sequence owns
one whole region (its block table is that run of page numbers) whatever its
length, so ``num_pages // pages_per_region`` sequences fit at once and
growth inside the region always succeeds, up to ``max_model_len`` tokens.
Pages left over after the last whole region are never used. Regions come
from a stack: the most recently freed region is reused first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pitstop
from pitstop.errors import ConfigError
from pitstop.plugin_system.protocols import AllocatorStats
from pitstop.plugins.allocators._common import (
    AllocatorUsageError,
    HeldSequences,
    Holding,
    OutOfPagesError,
    check_admissible,
    check_count,
    pages_for,
)

if TYPE_CHECKING:
    from pitstop.config import EngineConfig
    from pitstop.requests.sequence import Sequence


class _RegionHolding(Holding):
    """A sequence's :class:`Holding`: its region's (shared) block table, tokens held, and the region."""

    __slots__ = ("region",)

    def __init__(self, region: int, table: list[int], held: int) -> None:
        super().__init__(table, held)
        self.region = region


class PreallocatedAllocator(HeldSequences):
    """One contiguous ``max_model_len`` region per sequence."""

    def __init__(self, page_size: int, num_pages: int, max_model_len: int) -> None:
        if page_size <= 0 or num_pages < 0 or max_model_len <= 0:
            raise AllocatorUsageError(
                f"page_size and max_model_len must be > 0 and num_pages >= 0, "
                f"got {page_size}, {max_model_len}, {num_pages}"
            )
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.pages_per_region = pages_for(max_model_len, page_size)
        self.num_regions = num_pages // self.pages_per_region
        # Each region's block table, built once; a region is handed out whole.
        self._region_tables = [
            list(range(r * self.pages_per_region, (r + 1) * self.pages_per_region))
            for r in range(self.num_regions)
        ]
        self._free_regions: list[int] = list(
            range(self.num_regions - 1, -1, -1)
        )  # a stack; 0 first
        self._holdings: dict[int, _RegionHolding] = {}  # seq_id -> its region and tokens held
        self._tokens_held = 0

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``seq`` is new, fits in ``max_model_len`` and a region is free."""
        return (
            seq.seq_id not in self._holdings
            and 0 < seq.num_tokens <= self.max_model_len
            and bool(self._free_regions)
        )

    def allocate(self, seq: Sequence) -> int:
        """Give ``seq`` a whole region; nothing is cached, so return 0."""
        if seq.seq_id in self._holdings:
            raise AllocatorUsageError(f"sequence {seq.request_id!r} is already admitted")
        check_admissible(seq)
        if seq.num_tokens > self.max_model_len:
            raise AllocatorUsageError(
                f"sequence {seq.request_id!r} has {seq.num_tokens} tokens, more than max_model_len={self.max_model_len}"
            )
        if not self._free_regions:
            raise OutOfPagesError(
                f"no free region for sequence {seq.request_id!r}: all {self.num_regions} regions of "
                f"{self.pages_per_region} pages (max_model_len={self.max_model_len}) are taken"
            )
        region = self._free_regions.pop()
        self._holdings[seq.seq_id] = _RegionHolding(
            region, self._region_tables[region], seq.num_tokens
        )
        self._tokens_held += seq.num_tokens
        return 0

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` stays within ``max_model_len`` after ``num_tokens`` more."""
        holding = self._holdings.get(seq.seq_id)
        return (
            holding is not None
            and 0 <= num_tokens
            and holding.held + num_tokens <= self.max_model_len
        )

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Hold ``num_tokens`` more tokens inside the region."""
        check_count(num_tokens, "append")
        holding = self._holding(seq)
        if holding.held + num_tokens > self.max_model_len:
            raise OutOfPagesError(
                f"sequence {seq.request_id!r} would hold {holding.held + num_tokens} tokens, "
                f"more than its max_model_len={self.max_model_len} region"
            )
        holding.held += num_tokens
        self._tokens_held += num_tokens

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the last ``num_tokens`` tokens (the region stays reserved)."""
        holding = self._holding_to_truncate(seq, num_tokens)
        holding.held -= num_tokens
        self._tokens_held -= num_tokens

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s region (a no-op for a sequence that holds none)."""
        holding = self._pop_holding(seq)
        if holding is not None:
            self._free_regions.append(holding.region)  # type: ignore[attr-defined]

    def on_tokens_computed(self, seq: Sequence) -> None:
        """Nothing to do: nothing is cached across sequences."""

    def stats(self) -> AllocatorStats:
        """Tokens held; ``max_model_len`` tokens reserved per sequence; pages outside taken regions free."""
        taken = len(self._holdings)
        return AllocatorStats(
            num_pages=self.num_pages,
            pages_free=self.num_pages - taken * self.pages_per_region,
            tokens_held=self._tokens_held,
            tokens_reserved=taken * self.max_model_len,
        )


def create_preallocated(config: EngineConfig, num_pages: int) -> PreallocatedAllocator:
    """Every admitted sequence reserves max_model_len tokens of contiguous cache up front."""
    if config.max_model_len is None:
        raise ConfigError(
            "the preallocated allocator needs max_model_len (the region each sequence reserves); "
            "set max_model_len, or let the engine fill it in from the model"
        )
    return PreallocatedAllocator(config.page_size, num_pages, config.max_model_len)


@pitstop.hookimpl
def register_allocators(register) -> None:
    register("preallocated", create_preallocated)
