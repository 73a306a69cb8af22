"""Multi-LoRA shrink/expand in plain PyTorch: the numerical reference of the Triton kernels.

Same layout and signatures as :mod:`pitstop.plugins.kernels.triton_ops.lora` (its
module docstring describes the slots, ``slot_of_row`` and the slices); a loop over
the slots present in the batch, gathering each one's rows with ``index_select`` and
writing them back with ``index_copy_`` (a slot of rank 0 is empty: its rows are left
alone, as by the kernels). Arithmetic in float32 (float64 when the
inputs are float64, which makes it an exact-enough truth for tests); ``y + delta``
rounded once to y's dtype, as the kernel does. ``meta``, ``out``, ``config`` and
``pdl`` are accepted and ignored (``out`` is written when given), so either module
can be called the same way. Easy to read, not fast: it syncs with the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch


class ProjectionLoRA(NamedTuple):
    """One projection's LoRA as a fused layer takes it (``lora=`` of the ``FusedLayerOps``):
    the ``lora`` plugin's slot tensors of every slice (q|k|v, gate|up or one), which a fused
    GEMM adds inside (:mod:`pitstop.plugins.kernels.triton_ops.fused_linear`), and ``add``,
    the plugin's own ``y += delta(x)`` (in place; returns y) for every other way the
    projection runs. For a projection after an RMSNorm, A holds the norm's gain
    (``A * g[None, :]``, as the fused layer's weights do), so both take the raw rows.
    ``add_again``: the same delta where ``add`` may run only once a step (its intermediate a
    workspace cleared once a step), safe to call any number of times (the fused layer's
    timing calls the cuBLAS way many times on one step's inputs); None: ``add`` is.
    ``stacked``: where the plugin adds the delta inside the base GEMM itself (the ``lora``
    plugin's stacked layout: ``[x | h'] @ W_ext^T``), ``stacked(x, weight, gemm)`` runs the
    caller's ``gemm(a, w)`` (``a @ w.T`` in the caller's form: with a bias, into a residual)
    over the packed rows and the stacked weight, or over ``x`` and ``weight`` with the delta
    added after it; ``weight`` must be the projection's own (not a copy); None: the GEMM,
    then ``add``. ``h_in``: where the projection before this one, run in Triton, sums this
    one's shrink (``x A^T`` of each row's slot) for it to read instead of computing it."""

    A: tuple[torch.Tensor, ...]  # per slice [slots, rank_max, K], contiguous
    B: tuple[torch.Tensor, ...]  # per slice [slots, N_i, rank_max], contiguous
    slot_of_row: torch.Tensor  # [>= T] int32: each token row's slot, -1 for none
    scaling: torch.Tensor  # [slots] (or [slots, slices]) float32
    ranks: torch.Tensor  # [slots] int32: each slot's rank, 0 for an empty slot
    add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    add_again: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    stacked: (
        Callable[
            [torch.Tensor, torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
            torch.Tensor,
        ]
        | None
    ) = None
    # where the projection before this one sums this projection's shrink in its epilogue
    # (``next_lora=`` of the fused layer's Triton GEMMs; [>= T, slices x padded rank] float32,
    # zeroed once a step by the adapter plugin); None: this projection computes its own
    h_in: torch.Tensor | None = None


# the key of a fused layer's ``projection_lora`` (the adapter plugin sets it beside the layer's
# own projections' deltas) that holds the next layer's QKV delta, whose shrink the layer's down
# projection may sum into its ``h_in`` (``next_lora=``)
NEXT_LAYER_QKV = "next_layer.qkv_proj"


def scaling_of(lora_alpha: float, rank: int, use_rslora: bool = False) -> float:
    """PEFT's LoRA scaling: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
    return lora_alpha / (math.sqrt(rank) if use_rslora else rank)


def _slices(w: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [w] if isinstance(w, torch.Tensor) else list(w)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _groups(slot_of_row: torch.Tensor, slots: int) -> list[tuple[int, torch.Tensor]]:
    """(slot, its row indices) for each valid slot present; -1 and out-of-range rows skipped."""
    present = torch.unique(slot_of_row).tolist()
    return [(s, torch.nonzero(slot_of_row == s).flatten()) for s in present if 0 <= s < slots]


def _rank(ranks: torch.Tensor | None, slot: int, rank_max: int) -> int:
    return rank_max if ranks is None else max(0, min(int(ranks[slot]), rank_max))


def lora_shrink(
    x: torch.Tensor,
    A: torch.Tensor | Sequence[torch.Tensor],
    slot_of_row: torch.Tensor,
    ranks: torch.Tensor | None = None,
    *,
    meta: Any = None,
    out: torch.Tensor | None = None,
    config: Any = None,
    pdl: bool | None = None,
    zeroed: bool = False,
) -> torch.Tensor:
    """``h[:, i*rank_max : (i+1)*rank_max] = x @ A_i[slot].T`` per row; ``[T, slices*rank_max]``.

    Float32 (float64 for float64 x); rows of slot -1 and columns ``>= rank`` are zero.
    ``out`` (the Triton op's argument) receives the result when given and is returned; every
    element is written, so ``zeroed`` changes nothing here; ``config`` and ``pdl`` are unused.
    """
    a_list = _slices(A)
    slots, rank_max, _ = a_list[0].shape
    work = _work_dtype(x.dtype)
    h = torch.zeros(x.shape[0], len(a_list) * rank_max, dtype=work, device=x.device)
    for slot, idx in _groups(slot_of_row, slots):
        r = _rank(ranks, slot, rank_max)
        xs = x.index_select(0, idx).to(work)
        for i, a in enumerate(a_list):
            part = torch.zeros(idx.numel(), rank_max, dtype=work, device=x.device)
            part[:, :r] = xs @ a[slot, :r].to(work).T
            h[:, i * rank_max : (i + 1) * rank_max].index_copy_(0, idx, part)
    if out is not None:
        out.copy_(h)
        return out
    return h


def lora_expand_add(
    y: torch.Tensor,
    h: torch.Tensor,
    B: torch.Tensor | Sequence[torch.Tensor],
    slot_of_row: torch.Tensor,
    scaling: torch.Tensor,
    ranks: torch.Tensor | None = None,
    *,
    offset: int = 0,
    offsets: Sequence[int] | None = None,
    meta: Any = None,
    config: Any = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``y[:, off_i : off_i + N_i] += scaling[slot] * h_i @ B_i[slot].T`` per row, in place.

    Slices packed from ``offset`` unless ``offsets`` are given; returns y. Rows of
    slot -1 (or of a slot of rank 0) and the columns outside the slices are untouched.
    """
    b_list = _slices(B)
    slots, _, rank_max = b_list[0].shape
    widths = [b.shape[1] for b in b_list]
    if offsets is None:
        offsets = [offset + sum(widths[:i]) for i in range(len(b_list))]
    work = _work_dtype(y.dtype)
    for slot, idx in _groups(slot_of_row, slots):
        r = _rank(ranks, slot, rank_max)
        if r == 0:  # an empty slot: its rows are left alone, as the kernel's
            continue
        hs = h.index_select(0, idx).to(work)
        for i, (b, off) in enumerate(zip(b_list, offsets, strict=True)):
            scale = scaling[slot] if scaling.dim() == 1 else scaling[slot, i]
            hi = hs[:, i * rank_max : i * rank_max + r]
            delta = (hi @ b[slot, :, :r].to(work).T) * scale.to(work)
            cols = y.narrow(1, off, b.shape[1])
            cols.index_copy_(0, idx, (cols.index_select(0, idx).to(work) + delta).to(y.dtype))
    return y


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor | Sequence[torch.Tensor],
    B: torch.Tensor | Sequence[torch.Tensor],
    slot_of_row: torch.Tensor,
    scaling: torch.Tensor,
    ranks: torch.Tensor | None = None,
    *,
    offset: int = 0,
    offsets: Sequence[int] | None = None,
    meta: Any = None,
    config: Any = None,
    fused: bool | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``y[:, off_i : off_i + N_i] += scaling[slot] * (x @ A_i[slot].T) @ B_i[slot].T`` per row,
    in place: :func:`lora_shrink` then :func:`lora_expand_add` (``fused`` is ignored)."""
    h = lora_shrink(x, A, slot_of_row, ranks)
    return lora_expand_add(y, h, B, slot_of_row, scaling, ranks, offset=offset, offsets=offsets)


def lora_pack(
    x: torch.Tensor,
    A_all: torch.Tensor,
    slot_of_row: torch.Tensor,
    scaling: torch.Tensor,
    width: int,
    *,
    out: torch.Tensor | None = None,
    tiles: Any = None,
    workspace: Any = None,
    max_split: int | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``[x | h']`` of the stacked layout (:mod:`.triton_ops.lora_pack`): ``h'[t, c] =
    scaling[slot] * x[t] . A_all[c]`` where column ``c`` is in the row's slot (``c // width``),
    zero elsewhere and on rows without an adapter; products in float32 (float64 for
    float64 x), rounded once to x's dtype. ``out`` is written when given; ``tiles``,
    ``workspace``, ``max_split`` and ``pdl`` are unused."""
    work = _work_dtype(x.dtype)
    slots = scaling.shape[0]
    h = x.to(work) @ A_all.to(work).T
    slot = slot_of_row.long()
    valid = (slot >= 0) & (slot < slots)
    scale = torch.where(valid, scaling[slot.clamp(0, slots - 1)].to(work), 0.0)
    column_slot = torch.arange(A_all.shape[0], device=x.device) // width
    mine = valid[:, None] & (column_slot[None, :] == slot[:, None])
    h = torch.where(mine, h * scale[:, None], 0.0).to(x.dtype)
    packed = torch.cat([x, h], dim=1)
    if out is not None:
        out.copy_(packed)
        return out
    return packed
