"""What the built-in allocators share: their errors, a few checks, and the
bookkeeping of pages handed out on demand (:class:`OnDemandPages`).

``OutOfPagesError`` is what ``allocate``/``append`` raise when called without
room (callers are meant to ask ``can_allocate``/``can_append`` first and
preempt); ``AllocatorUsageError`` is a caller's mistake (an unknown
sequence, admitting one twice, truncating more than it holds). Both are
raised before any state changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pitstop.errors import OutOfPagesError as _CoreOutOfPagesError
from pitstop.errors import PitstopError
from pitstop.plugin_system.protocols import AllocatorBase

if TYPE_CHECKING:
    from pitstop.requests.sequence import Sequence


class AllocatorError(PitstopError, RuntimeError):
    """Base class of the errors the built-in allocators raise."""


class OutOfPagesError(AllocatorError, _CoreOutOfPagesError):
    """No free KV-cache pages for the request; nothing was changed (preempt and retry).

    A subclass of :class:`pitstop.errors.OutOfPagesError`, which callers catch.
    """


class AllocatorUsageError(AllocatorError):
    """The allocator was called out of contract (unknown sequence, double admission, bad count)."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """How many pages hold ``num_tokens`` tokens: ceil(num_tokens / page_size)."""
    return -(-num_tokens // page_size)


def check_count(num_tokens: int, what: str) -> None:
    """Refuse a negative or non-integer token count."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise AllocatorUsageError(f"{what} needs a token count >= 0, got {num_tokens!r}")


def check_admissible(seq: Sequence) -> None:
    """Refuse to admit a sequence without tokens (there is nothing to hold or compute)."""
    if seq.num_tokens <= 0:
        raise AllocatorUsageError(f"sequence {seq.request_id!r} has no tokens to admit")


class Holding:
    """What an allocator keeps for one admitted sequence: its block table and the tokens it holds.

    One record per sequence, in the allocator that owns it (not on the
    sequence: the ``draft`` proposer's allocator holds the same sequences as
    the engine's).
    """

    __slots__ = ("held", "table")

    def __init__(self, table: list[int], held: int) -> None:
        self.table = table
        self.held = held


class HeldSequences(AllocatorBase):
    """Per admitted sequence its :class:`Holding` (``_holdings``), and the tokens they hold in all
    (``_tokens_held``): the lookups and checks every built-in allocator makes on them."""

    _holdings: dict[int, Holding]
    _tokens_held: int

    def _holding(self, seq: Sequence) -> Holding:
        try:
            return self._holdings[seq.seq_id]
        except KeyError:
            raise AllocatorUsageError(f"sequence {seq.request_id!r} is not admitted") from None

    def _holding_to_truncate(self, seq: Sequence, num_tokens: int) -> Holding:
        """``seq``'s holding, after refusing a bad count or more tokens than it holds."""
        check_count(num_tokens, "truncate")
        holding = self._holding(seq)
        if num_tokens > holding.held:
            raise AllocatorUsageError(
                f"cannot truncate {num_tokens} tokens of sequence {seq.request_id!r}, "
                f"which holds {holding.held}"
            )
        return holding

    def _pop_holding(self, seq: Sequence) -> Holding | None:
        """Forget ``seq``'s holding and its tokens; None when it holds none."""
        holding = self._holdings.pop(seq.seq_id, None)
        if holding is not None:
            self._tokens_held -= holding.held
        return holding

    def block_table(self, seq: Sequence) -> list[int]:
        """The pages of ``seq`` in order (the live list: read it, copy it to keep it)."""
        return self._holding(seq).table

    def num_held_tokens(self, seq: Sequence) -> int:
        """Token slots ``seq`` holds (0 when not admitted)."""
        holding = self._holdings.get(seq.seq_id)
        return 0 if holding is None else holding.held


class OnDemandPages(HeldSequences):
    """The state ``paged`` and ``prefix`` share: a stack of free pages, and per admitted
    sequence its :class:`Holding`."""

    def __init__(self, page_size: int, num_pages: int) -> None:
        if page_size <= 0 or num_pages < 0:
            raise AllocatorUsageError(
                f"page_size must be > 0 and num_pages >= 0, got {page_size}, {num_pages}"
            )
        self.page_size = page_size
        self.num_pages = num_pages
        # A stack: pop() takes the most recently freed page; reversed so a fresh allocator gives 0, 1, 2, ...
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._holdings: dict[int, Holding] = {}  # seq_id -> its block table and tokens held
        self._tokens_held = 0
