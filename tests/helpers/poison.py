"""Poisoned outputs for kernel tests: an element a kernel never wrote cannot pass for data."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Every torch.empty inside fills floats with NaN (integers with their maximum)."""
    import torch.utils.deterministic as det

    was_on, was_fill = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on)
        det.fill_uninitialized_memory = was_fill
