"""Host-side integer helpers for launch shapes.

Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: called from
Python each goes through Triton's wrapper, about 2 µs a call on a busy CPU core against a few
tens of nanoseconds for the arithmetic (2026-12-07). The wrappers of the ops call them several
times a launch, and an eager step (a prefill chunk: no CUDA graph) pays every one on the host,
so they use these instead. Kernels keep ``tl.cdiv``.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ``a`` and positive ``b``, as ``triton.cdiv``."""
    return -(-int(a) // int(b))


def next_power_of_2(n: int) -> int:
    """The least power of two at least ``n`` (0 for 0), as ``triton.next_power_of_2``."""
    n = int(n)
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def k_per_split(k: int, split: int, block_k: int) -> int:
    """The K columns each of ``split`` splits takes, in whole ``block_k`` steps (the split-K
    kernels' rule; ``cdiv(k, it)`` below ``split`` means the last split is left empty)."""
    return cdiv(cdiv(k, split), block_k) * block_k
