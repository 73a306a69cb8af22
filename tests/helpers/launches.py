"""Counting kernel launches on any machine: Triton launches and kernel-launching torch ops.

:class:`KernelLaunches` is a ``TorchDispatchMode`` that counts, while its ``scope`` is
open (``counter.scope += 1`` around the code of interest), every torch op that would
launch a kernel (everything but views and allocations) outside a Triton launch;
:func:`count_triton_launches` patches ``KernelInterface.__getitem__`` so that each
``JITFunction[grid](...)`` is counted by kernel name (those ``counts(kernel)`` accepts).
Used by the launch-count tests of the fused layer and the LoRA plugin.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch nothing: allocations, metadata and dtype computations
FREE = {
    "empty",
    "empty_strided",
    "empty_like",
    "detach",
    "lift_fresh",
    "sym_size",
    "sym_stride",
    "promote_types",
}


class KernelLaunches(TorchDispatchMode):
    """Triton launches by kernel name and kernel-launching torch ops, counted in scope."""

    def __init__(self) -> None:
        super().__init__()
        self.triton: Counter[str] = Counter()
        self.torch: Counter[str] = Counter()
        self.scope = 0  # > 0: count torch ops (Triton launches: see count_triton_launches)
        self.in_triton = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if self.scope and not self.in_triton and not func.is_view and name not in FREE:
            self.torch[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Every launch counted."""
        return sum(self.triton.values()) + sum(self.torch.values())


def count_triton_launches(
    monkeypatch: pytest.MonkeyPatch, counter: KernelLaunches, counts: Callable[[Any], bool]
) -> None:
    """Count each Triton launch whose kernel ``counts(kernel)`` accepts into ``counter.triton``
    (the torch ops a launch runs itself are not counted as launches)."""
    import triton

    get_item = triton.runtime.jit.KernelInterface.__getitem__

    def counted_getitem(kernel: Any, grid: Any) -> Any:
        launch = get_item(kernel, grid)

        def run(*args: Any, **kwargs: Any) -> Any:
            if counts(kernel):
                counter.triton[kernel.fn.__name__] += 1
            counter.in_triton += 1
            try:
                return launch(*args, **kwargs)
            finally:
                counter.in_triton -= 1

        return run

    monkeypatch.setattr(triton.runtime.jit.KernelInterface, "__getitem__", counted_getitem)
