"""The stacked LoRA layout's one launch: a projection's input widened by every slot's rank-r product.

Stacked layout (``lora.kernel=stacked``, :mod:`pitstop.plugins.adapters.lora.slots`)
----------------------------------------------------------------------------------
A projection ``y = x @ W.T`` (``W [N, K]``) with adapters in ``slots`` slots, each of
``slices`` slices (q|k|v, gate|up, or one) of at most ``rank`` ranks, so ``E = slots *
slices * rank`` columns of deltas, is one GEMM over widened operands:

- ``W_ext [N, K + E] = [W | B']``, the base weight in its first ``K`` columns; column ``K +
  s*slices*rank + i*rank + j`` holds ``B_i[s, :, j]`` in slice ``i``'s output rows and zero in
  the other slices' rows (so each slice's delta reaches only its own columns of y);
- ``A_all [E, K]``, row ``s*slices*rank + i*rank + j`` = ``A_i[s, j, :]``;
- per step, :func:`lora_pack` writes ``P [T, K + E] = [x | h']`` where ``h'[t, c] =
  scaling[slot(t)] * (x[t] . A_all[c])`` if column ``c`` belongs to the row's slot, else 0
  (rows without an adapter: all zero), rounded to x's dtype;

then ``P @ W_ext.T = x @ W.T + scaling * (x @ A_slot.T) @ B_slot.T`` per row: the base GEMM
(cuBLAS) adds every row's delta itself. A projection with LoRA then costs this one launch
before its GEMM instead of a shrink and an expand after it (the expand's launch and its wait
for the shrink were 12.4 µs of every projection at `nano`'s 256 rows on an H100, 2026-12-06),
for ``E / K`` more GEMM work (8 slots of rank 16: 37% on a q|k|v of K 1,024, 4% on a down
projection of K 3,072).

The kernel computes ``x @ A_all.T`` densely (every slot's columns for every row, then the
mask): ``slots`` times the FLOPs of the rows' own products, which are ``rank / N`` of the
base GEMM's, so negligible, and no grouping of rows by slot is needed. Grid: ``(row tiles,
column tiles of h' + column tiles of the copy of x)``; a program of the first kind runs the
whole K (no split, no atomics, no memset: every element of ``P`` is written once).

PDL (:mod:`.pdl`): A is read before the wait (weights, written only by adapter loads that
the step stream waits for), x and the rows' slots after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops import pdl as _pdl

INTERPRETER_TILES = (16, 16, 32)  # (BLOCK_M, BLOCK_N, BLOCK_K): small, so tests cross tiles
COPY_BLOCK = 256  # columns of x copied by one program


@triton.jit
def _pack_kernel(
    x_ptr,
    stride_xm,
    a_ptr,
    p_ptr,
    stride_pm,
    slot_ptr,
    scale_ptr,
    T,
    K,
    E,
    WIDTH,
    SLOTS,
    H_TILES,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BC: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    m_ok = m < T
    m64 = m.to(tl.int64)
    if pid_c >= H_TILES:  # copy a block of x into P's first K columns
        _pdl.wait(PDL)
        k = (pid_c - H_TILES) * BC + tl.arange(0, BC)
        mask = m_ok[:, None] & (k < K)[None, :]
        xt = tl.load(x_ptr + m64[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
        _pdl.launch_dependents(PDL)
        tl.store(p_ptr + m64[:, None] * stride_pm + k[None, :], xt, mask=mask)
        return
    c = pid_c * BN + tl.arange(0, BN)
    c_ok = c < E
    _pdl.wait(PDL)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        xt = tl.load(
            x_ptr + m64[:, None] * stride_xm + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        at = tl.load(
            a_ptr + c.to(tl.int64)[:, None] * K + k[None, :],
            mask=c_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if UPCAST:  # the interpreter multiplies bf16 dot operands wrongly: exact float32 copies
            acc = tl.dot(
                xt.to(tl.float32), tl.trans(at.to(tl.float32)), acc, input_precision="ieee"
            )
        else:
            acc = tl.dot(xt, tl.trans(at.to(xt.dtype)), acc, input_precision=DOT_PRECISION)
    _pdl.launch_dependents(PDL)
    slot = tl.load(slot_ptr + m, mask=m_ok, other=-1)
    valid = (slot >= 0) & (slot < SLOTS)
    scale = tl.load(scale_ptr + tl.where(valid, slot, 0), mask=m_ok & valid, other=0.0)
    mine = valid[:, None] & ((c // WIDTH)[None, :] == slot[:, None])
    h = tl.where(mine, acc * scale[:, None], 0.0)
    out = p_ptr + m64[:, None] * stride_pm + K + c[None, :]
    tl.store(out, h.to(p_ptr.dtype.element_ty), mask=m_ok[:, None] & c_ok[None, :])


PROGRAMS = 64  # the product's programs a launch aims at (each runs the whole K: no split)


def pack_tiles(
    rows: int, columns: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of :func:`lora_pack` for ``rows`` rows and ``columns`` (E)
    columns of h': row tiles of 16 or 32, and the widest column tile (64, 32 or 16) that
    still gives :data:`PROGRAMS` programs, since a program reads all of K of its rows and
    columns (untuned: the first GPU run's choice)."""
    if device.type != "cuda":
        return INTERPRETER_TILES
    bm = 16 if rows <= 16 else 32
    row_tiles = triton.cdiv(rows, bm)
    bn = next((n for n in (64, 32) if row_tiles * triton.cdiv(columns, n) >= PROGRAMS), 16)
    return bm, bn, 64 if dtype == torch.float32 else 128


def lora_pack(
    x: torch.Tensor,
    A_all: torch.Tensor,
    slot_of_row: torch.Tensor,
    scaling: torch.Tensor,
    width: int,
    *,
    out: torch.Tensor | None = None,
    tiles: tuple[int, int, int] | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``P = [x | h']`` of the stacked layout (module docstring), ``[T, K + E]`` in x's dtype.

    ``x [T, K]`` (unit column stride); ``A_all [E, K]`` contiguous, of x's dtype; ``width``:
    the columns of one slot (``slices * rank``), so ``E = slots * width``; ``slot_of_row
    [T]`` int32 (-1 or out of range: no adapter); ``scaling [slots]`` float32; ``out``:
    ``[T, K + E]`` of x's dtype, unit column stride (allocated when None).
    """
    rows, k = x.shape
    e = A_all.shape[0]
    assert x.stride(1) == 1 and A_all.is_contiguous() and A_all.shape[1] == k
    assert A_all.dtype == x.dtype and width > 0 and e % width == 0, "A_all: [slots*width, K]"
    assert slot_of_row.shape == (rows,) and slot_of_row.dtype == torch.int32
    assert scaling.dim() == 1 and scaling.dtype == torch.float32
    p = out if out is not None else torch.empty(rows, k + e, dtype=x.dtype, device=x.device)
    assert p.shape == (rows, k + e) and p.dtype == x.dtype and p.stride(1) == 1
    if rows == 0:
        return p
    bm, bn, bk = tiles or pack_tiles(rows, e, x.dtype, x.device)
    h_tiles = triton.cdiv(e, bn)
    use_pdl = _pdl.enabled(x.device, pdl)
    grid = (triton.cdiv(rows, bm), h_tiles + triton.cdiv(k, COPY_BLOCK))
    _pack_kernel[grid](
        x,
        x.stride(0),
        A_all,
        p,
        p.stride(0),
        slot_of_row,
        scaling,
        rows,
        k,
        e,
        width,
        scaling.shape[0],
        h_tiles,
        BM=bm,
        BN=bn,
        BK=bk,
        BC=COPY_BLOCK,
        UPCAST=x.device.type != "cuda" and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=use_pdl,
        num_warps=4,
        num_stages=3,
        **_pdl.launch_kwargs(use_pdl),
    )
    return p
