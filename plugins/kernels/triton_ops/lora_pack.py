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

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops.launch_math import cdiv, k_per_split, next_power_of_2

INTERPRETER_TILES = (16, 16, 32)  # (BLOCK_M, BLOCK_N, BLOCK_K): small, so tests cross tiles
COPY_BLOCK = 256  # columns of x copied by one program


@triton.jit
def dot_rows(acc, xt, at, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc + xt @ at.T`` (rows of x by rows of A): the shrink step of the LoRA kernels."""
    if UPCAST:  # the interpreter multiplies bf16 dot operands wrongly: exact float32 copies
        return tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(xt, tl.trans(at.to(xt.dtype)), acc, input_precision=DOT_PRECISION)


@triton.jit
def _pack_kernel(
    x_ptr,
    stride_xm,
    a_ptr,
    p_ptr,
    stride_pm,
    slot_ptr,
    scale_ptr,
    ws_ptr,
    count_ptr,
    T,
    K,
    E,
    WIDTH,
    SLOTS,
    H_TILES,
    K_PER_SPLIT,
    SPLIT: tl.constexpr,
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
    if pid_c >= H_TILES * SPLIT:  # copy a block of x into P's first K columns
        _pdl.wait(PDL)
        k = (pid_c - H_TILES * SPLIT) * BC + tl.arange(0, BC)
        mask = m_ok[:, None] & (k < K)[None, :]
        xt = tl.load(x_ptr + m64[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
        _pdl.launch_dependents(PDL)
        tl.store(p_ptr + m64[:, None] * stride_pm + k[None, :], xt, mask=mask)
        return
    tile = pid_c // SPLIT
    split = pid_c % SPLIT
    c = tile * BN + tl.arange(0, BN)
    c_ok = c < E
    _pdl.wait(PDL)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_lo = split * K_PER_SPLIT
    for kk in range(0, K_PER_SPLIT, BK):
        k = k_lo + kk + tl.arange(0, BK)
        k_ok = (k < K) & (kk + tl.arange(0, BK) < K_PER_SPLIT)
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
        acc = dot_rows(acc, xt, at, UPCAST, DOT_PRECISION)
    _pdl.launch_dependents(PDL)
    tile_mask = m_ok[:, None] & c_ok[None, :]
    if SPLIT > 1:  # add into the float32 workspace; the split that arrives last finishes
        # every thread's adds are performed before the counter's release (the barrier), and the
        # last split reads the sums and leaves zeros in one exchange at L2, after its acquire
        ws = ws_ptr + m64[:, None] * E + c[None, :]
        tl.atomic_add(ws, acc, mask=tile_mask, sem="relaxed")
        tl.debug_barrier()
        counter = count_ptr + pid_m * H_TILES + tile
        if tl.atomic_add(counter, 1, sem="acq_rel") != SPLIT - 1:
            return
        bits = ws.to(tl.pointer_type(tl.int32))  # as int32: the interpreter exchanges no floats
        zeros = tl.zeros([BM, BN], dtype=tl.int32)
        acc = tl.atomic_xchg(bits, zeros, mask=tile_mask, sem="acquire").to(
            tl.float32, bitcast=True
        )
        tl.store(counter, 0)  # for the next launch on the stream
    slot = tl.load(slot_ptr + m, mask=m_ok, other=-1)
    valid = (slot >= 0) & (slot < SLOTS)
    scale = tl.load(scale_ptr + tl.where(valid, slot, 0), mask=m_ok & valid, other=0.0)
    mine = valid[:, None] & ((c // WIDTH)[None, :] == slot[:, None])
    h = tl.where(mine, acc * scale[:, None], 0.0)
    out = p_ptr + m64[:, None] * stride_pm + K + c[None, :]
    tl.store(out, h.to(p_ptr.dtype.element_ty), mask=tile_mask)


PROGRAMS = 128  # the product's programs a launch aims at where its tiles are few
MIN_SPLIT_K = 256  # the fewest columns of K a split takes
# from this many tiles (row tiles x column tiles) a launch does not split K: the splits'
# atomics cost more than the serial K loop they shorten (below)
SPLIT_BELOW_TILES = 64
LARGE_ROWS = 1024  # from this many rows a launch takes the wide tiles of a prefill chunk


class PackTiles(NamedTuple):
    """Launch shape of :func:`lora_pack`: rows and columns of h' per tile, the K step, and
    how many splits of K share a tile (their sums meet in a float32 workspace)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def pack_tiles(
    rows: int, columns: int, k: int, dtype: torch.dtype, device: torch.device
) -> PackTiles:
    """The launch shape for ``rows`` rows, ``columns`` (E) columns of h' and ``k``: row tiles of
    16, column tiles of 32 (16 for a narrower E), and, where the tiles are fewer than
    :data:`SPLIT_BELOW_TILES`, K split until the launch has about :data:`PROGRAMS` programs,
    each at least :data:`MIN_SPLIT_K` of K.

    Measured on an H100 (2026-12-07, ``lora_bench.py --pack-tiles``, eleventh session in
    docs/benchmarks.md), µs a launch in CUDA graphs: at `nano`'s 256 rows over 8 adapters the
    earlier rule (row tiles of 32, column tiles of 64, K split to about 128 programs) took
    36.7 µs for a layer's four packs, this one 23.6 (unsplit 16 x 32 tiles: q|k|v 4.99, o
    6.09, gate|up 4.10, down 8.38); over one adapter 23.1 against about 16.9 (split where E
    gives 16 or 32 tiles); at one row (`single`) both split alike (14.6).

    From :data:`LARGE_ROWS` rows (prefill chunks): tiles of 64 rows and 128 columns of h'
    (64 where E is under 256), 8 warps, 3 stages. Measured on an H100 (2026-12-07,
    thirteenth session) at 8,192 rows of qwen3-0.6b, a layer's four packs over 8 adapters
    took 243.0 µs with the small tiles, 151.0 with 64 x 64 (K steps of 128) and 138.1 with
    64 x 128 (K steps of 64); over one adapter 117.9, 87.8 and 124.3: the wide columns pay
    where E is wide (q|k|v's 384 and gate|up's 256 columns over 8 adapters)."""
    if device.type != "cuda":
        bm, bn, bk = INTERPRETER_TILES
        return PackTiles(bm, bn, bk, 1)
    if rows >= LARGE_ROWS:  # a prefill chunk: wide tiles, 8 warps, K never split
        bn = 128 if columns >= 256 else 64
        bk = 64 if bn == 128 or dtype == torch.float32 else 128
        return PackTiles(64, bn, bk, 1, 8, 3)
    bm = 16
    bn = min(32, max(16, next_power_of_2(columns)))
    tiles = cdiv(rows, bm) * cdiv(columns, bn)
    split = 1
    if tiles < SPLIT_BELOW_TILES:
        split = max(1, min(cdiv(PROGRAMS, tiles), k // MIN_SPLIT_K))
    return PackTiles(bm, bn, 64 if dtype == torch.float32 else 128, split)


def pack_workspace(
    rows: int, columns: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed float32 workspace ``[rows * columns]`` and int32 tile counters for split
    launches of up to ``rows`` rows and ``columns`` columns of h' (the last split of each tile
    zeroes its part again, so one pair serves every launch that follows on the stream)."""
    ws = torch.zeros(rows * columns, dtype=torch.float32, device=device)
    counters = torch.zeros(cdiv(rows, 16) * cdiv(columns, 16), dtype=torch.int32, device=device)
    return ws, counters


def lora_pack(
    x: torch.Tensor,
    A_all: torch.Tensor,
    slot_of_row: torch.Tensor,
    scaling: torch.Tensor,
    width: int,
    *,
    out: torch.Tensor | None = None,
    tiles: PackTiles | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_split: int | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``P = [x | h']`` of the stacked layout (module docstring), ``[T, K + E]`` in x's dtype.

    ``x [T, K]`` (unit column stride); ``A_all [E, K]`` contiguous, of x's dtype; ``width``:
    the columns of one slot (``slices * rank``), so ``E = slots * width``; ``slot_of_row
    [T]`` int32 (-1 or out of range: no adapter); ``scaling [slots]`` float32; ``out``:
    ``[T, K + E]`` of x's dtype, unit column stride (allocated when None); ``workspace``:
    :func:`pack_workspace` of at least T rows and E columns, used when the launch splits K
    (allocated for the call when None); ``max_split``: the most splits of K (1: none).
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
    bm, bn, bk, split, warps, stages = tiles or pack_tiles(rows, e, k, x.dtype, x.device)
    split = split if max_split is None else max(1, min(split, max_split))
    per_split = k_per_split(k, split, bk)
    split = cdiv(k, per_split)
    h_tiles = cdiv(e, bn)
    if split == 1:  # the kernel never touches them: any pointers of the types do
        ws, counters = workspace or (scaling, slot_of_row)
    else:
        ws, counters = workspace or pack_workspace(rows, e, x.device)
        assert ws.numel() >= rows * e and counters.numel() >= cdiv(rows, bm) * h_tiles
    use_pdl = _pdl.enabled(x.device, pdl)
    grid = (cdiv(rows, bm), h_tiles * split + cdiv(k, COPY_BLOCK))
    _pack_kernel[grid](
        x,
        x.stride(0),
        A_all,
        p,
        p.stride(0),
        slot_of_row,
        scaling,
        ws,
        counters,
        rows,
        k,
        e,
        width,
        scaling.shape[0],
        h_tiles,
        per_split,
        SPLIT=split,
        BM=bm,
        BN=bn,
        BK=bk,
        BC=COPY_BLOCK,
        UPCAST=x.device.type != "cuda" and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=use_pdl,
        num_warps=warps,
        num_stages=stages,
        **_pdl.launch_kwargs(use_pdl),
    )
    return p
