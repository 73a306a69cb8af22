"""Programmatic dependent launch (PDL) for the Triton kernels of this package, decided once.

With PDL (Hopper and later) a kernel launched with ``launch_pdl=True`` may start
while the kernel before it on the stream is still running: as soon as every
program of that one has called ``gdc_launch_dependents()`` (or exited). The new
kernel's programs may do anything that does not depend on the previous kernel
(load weights, compute addresses) and must call ``gdc_wait()`` before their
first read of anything a previous kernel wrote, and before their first global
write (a previous kernel may still be reading that memory). ``gdc_wait`` returns
once the previous grid has completed and its memory operations are visible.

The chain is transitive only if every PDL kernel waits in every program before
it triggers or exits: kernel C's wait covers B's completion, and B completed
after its own wait covered A. Every kernel here therefore calls
:func:`wait` unconditionally near its start (before any early return) and
:func:`launch_dependents` only after that.

What no kernel of the chain writes may be read before the wait: weights and other
constant tables, and the step's inputs that the runner copies in (with plain stream copies,
which complete before the step's first kernel starts) before its first kernel: positions and
KV slots (:mod:`.rope_store`), context lengths (:mod:`.paged_attention`'s decode kernel),
the rows' LoRA slots (:mod:`.fused_linear`). Anything a Triton kernel of the step writes
is read after the wait.

Both are compile-time no-ops when the kernel's ``PDL`` constexpr is off (the
interpreter, an older GPU, a Triton build without ``gdc_wait``), so the
kernels keep their former behaviour bit for bit.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3 (the H200's 3.6 and 3.9 both have it)
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover - old Triton
    HAS_GDC = False

_override: bool | None = None


def set_default(enabled: bool | None) -> None:
    """Force PDL on or off for launches that pass ``pdl=None`` (``None``: decide by the device)."""
    global _override
    _override = enabled
    _device_supports.cache_clear()


def interpreted() -> bool:
    """Whether Triton runs kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _device_supports(device_index: int) -> bool:
    major, _ = torch.cuda.get_device_capability(device_index)
    return major >= 9


def enabled(device: torch.device, pdl: bool | None = None) -> bool:
    """Whether a launch on ``device`` uses PDL: ``pdl`` if given (``True`` is refused where it
    cannot work: a CPU tensor, the interpreter, a Triton without ``gdc_wait``, a GPU below
    compute capability 9.0), else the :func:`set_default` override, else on exactly where it works."""
    if device.type != "cuda" or interpreted() or not HAS_GDC:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    works = _device_supports(index)
    if pdl is None:
        pdl = _override if _override is not None else works
    return bool(pdl) and works


def launch_kwargs(on: bool) -> dict[str, bool]:
    """The extra launch argument of a PDL launch (nothing when off, so the interpreter is untouched)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def wait(PDL: tl.constexpr):
    """``gdc_wait()`` when ``PDL``: the previous kernel's writes are visible after this."""
    if PDL:
        _gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """``gdc_launch_dependents()`` when ``PDL``: the next kernel may start launching."""
    if PDL:
        _gdc_launch_dependents()
