"""What the built-in allocators share: their errors and a few checks.

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

if TYPE_CHECKING:
    from pitstop.sequence import Sequence


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
