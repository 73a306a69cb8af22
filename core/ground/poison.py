"""Poisoned memory: a debug mode in which memory the engine never wrote cannot pass for data.

A fresh CUDA allocation often holds whatever a previous engine of the same
process left there, and a fresh CPU one zeros; either can look like a right
answer. With ``poison_memory`` on (config key, ``--poison-memory`` flag, or
``PITSTOP_POISON_MEMORY=1``), the engine fills

- the KV cache when it is allocated, and every page again when the allocator
  hands it to a sequence that will write it (a page served from the prefix
  cache keeps its contents: it is data);
- the runner's workspaces and staging buffers (CUDA-graph inputs and
  activations, the sampled-token buffers, pinned host copies, block-table
  rows) once they are built and whenever a row is released;
- every ``torch.empty`` of the process (kernel workspaces and outputs), through
  PyTorch's own ``fill_uninitialized_memory`` under deterministic mode,

with NaN (floating point, fp8 included) or :data:`INT_SENTINEL` (integers), so
that a read of memory nothing wrote turns the output into NaN or an
out-of-range index, an error, instead of a plausible token. It costs a fill
per page handed out and the deterministic-mode checks: for tests and
``pitstop verify``, off in production.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads lazily: the config imports this module, and the CLI the config
    import numpy as np
    import torch

    from pitstop.ground.step import SeqInput


INT_SENTINEL = 2**30 + 7
"""What poisoned integer buffers hold: no token id, page, slot or position is that large."""

_FP8_NAN_BYTE = 0x7F  # NaN in both float8_e4m3fn (S.1111.111) and float8_e5m2 (S.11111.11)


def poison_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill ``tensor`` in place with its dtype's poison (NaN, or :data:`INT_SENTINEL`); returns it."""
    import torch

    if tensor.dtype.is_floating_point:
        if tensor.element_size() == 1:  # fp8: no fill kernel for it on every device, so bytes
            tensor.view(torch.uint8).fill_(_FP8_NAN_BYTE)
        else:
            tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.fill_(INT_SENTINEL if torch.iinfo(tensor.dtype).max >= INT_SENTINEL else -1)
    return tensor


def poison_pages_(kv_cache: torch.Tensor, pages: torch.Tensor) -> None:
    """Poison the pages ``pages`` (dim 2) of a ``[layers, 2, pages, ...]`` KV cache in place."""
    import torch

    if kv_cache.element_size() == 1:  # fp8: NaN bytes
        kv_cache.view(torch.uint8).index_fill_(2, pages, _FP8_NAN_BYTE)
    else:
        kv_cache.index_fill_(2, pages, float("nan"))


def poison_array(array: np.ndarray) -> np.ndarray:
    """Fill a host integer array with :data:`INT_SENTINEL` in place; returns it."""
    array.fill(INT_SENTINEL)
    return array


_torch_fill_on = False


def poison_torch_empty() -> None:
    """Make every ``torch.empty`` of this process come back filled with NaN or the dtype's max.

    PyTorch does this under deterministic mode with
    ``torch.utils.deterministic.fill_uninitialized_memory`` (on by default);
    ``warn_only`` keeps the operations without a deterministic kernel
    running (their warnings are silenced: determinism is not what this mode
    checks). Process-wide and not undone: a debug mode.
    """
    import torch

    global _torch_fill_on
    if _torch_fill_on:
        return
    # cuBLAS's deterministic mode reads this when its handle is created
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    warnings.filterwarnings("ignore", message=".*deterministic.*")
    warnings.filterwarnings("ignore", message=".*CUBLAS_WORKSPACE_CONFIG.*")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    _torch_fill_on = True


class PoisonedReadError(RuntimeError):
    """A step's logits held NaN with ``poison_memory`` on: something read memory nothing wrote."""

    def __init__(self, seq_id: int) -> None:
        super().__init__(
            f"sequence {seq_id} got NaN logits with poison_memory on: a kernel or "
            "workspace read memory the engine never wrote (poisoned with NaN); run with the "
            "reference kernels and enforce_eager to narrow it down"
        )


def nan_rows_of(logits: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits``, whether any value is NaN (on the device, no wait).

    With poisoned memory a NaN is how a read of unwritten KV slots, workspace
    or staging memory shows; unchecked, greedy sampling would turn it into
    token 0, a plausible answer. An infinite logit is not flagged: ``-inf``
    is how masks (grammars, banned tokens) remove a token.
    """
    import torch

    return torch.isnan(logits).any(dim=-1)


def poisoned_seq_ids(seqs: Seq[SeqInput], nonfinite: torch.Tensor | None) -> frozenset[int]:
    """The sampling sequences (``num_logits`` rows each, in order) with a NaN row."""
    if nonfinite is None:
        return frozenset()
    flags = nonfinite.tolist()
    owners = [s.seq_id for s in seqs if s.sample for _ in range(s.num_logits)]
    return frozenset(owner for owner, bad in zip(owners, flags, strict=True) if bad)


class FreshPageTracker:
    """An allocator seen through a window that reports every page it hands out to be written.

    Wraps any allocator (the protocol :class:`~pitstop.plugin_system.protocols.Allocator`)
    and forwards every member; after ``allocate`` the pages past the cached
    prefix, and after ``append`` the pages added, go to ``on_fresh`` (the
    engine poisons them before the step that writes them). Pages a sequence
    shares through the prefix cache or with its ``n`` siblings count as
    cached, so their contents are kept.
    """

    def __init__(self, allocator, on_fresh: Callable[[Seq[int]], None]) -> None:
        self._allocator = allocator
        self._on_fresh = on_fresh

    def __getattr__(self, name: str):
        return getattr(self._allocator, name)

    def allocate(self, seq) -> int:
        """Admit ``seq`` (see the allocator); report the pages past its cached tokens."""
        cached = self._allocator.allocate(seq)
        table = self._allocator.block_table(seq)
        first_fresh = -(-cached // self._allocator.page_size)  # a partly cached page keeps its data
        self._report(table[first_fresh:])
        return cached

    def append(self, seq, num_tokens: int) -> None:
        """Grow ``seq`` (see the allocator); report the pages it gained."""
        before = len(self._allocator.block_table(seq))
        self._allocator.append(seq, num_tokens)
        self._report(self._allocator.block_table(seq)[before:])

    def _report(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        if pages:
            self._on_fresh(pages)
