"""Multi-LoRA over a batch that mixes adapters and rows without any (SGMV style), one launch a projection.

Layout (one projection of one layer; a merged projection has one *slice* per part)
---------------------------------------------------------------------------------
Adapter weights live in ``max_loras`` GPU *slots*, allocated once at start-up, as
stacked tensors per projection slice (at most :data:`MAX_SLICES` slices: q|k|v, gate|up):

- ``A [slots, rank_max, K]`` (shrink, PEFT's ``lora_A.weight`` ``[r, K]`` in rows ``:r``);
- ``B [slots, N_i, rank_max]`` (expand, PEFT's ``lora_B.weight`` ``[N_i, r]`` in columns ``:r``);
- ``ranks [slots]`` int32: the slot's adapter rank ``r <= rank_max``, 0 for an empty slot
  (its programs exit at once). Rows ``>= r`` of A and columns ``>= r`` of B are padding:
  the loader zeroes them, and the kernels never read them either (masked by ``ranks``),
  so a slot reused by a smaller adapter needs no clearing;
- ``scaling [slots]`` (or ``[slots, slices]``) float32: ``lora_alpha / r``, or
  ``lora_alpha / sqrt(r)`` for rsLoRA (:func:`pitstop.plugins.kernels.lora_reference.scaling_of`).

Loading an adapter is a copy into its slot's rows of these tensors plus two scalars:
the tensors' addresses never change, so captured graphs keep reading the right memory.
A module that an adapter does not train keeps zeros in its slice (a zero delta).

Step metadata: rows grouped by slot, derived on the device
----------------------------------------------------------
The runner writes one thing per step: ``slot_of_row [T]`` int32, the slot of each row
(token) of the batch, ``-1`` for a row without an adapter (also padding rows of a
captured batch; a value outside ``[0, slots)`` counts as -1). :func:`lora_meta` turns it
into :class:`LoRAMeta` *on the device*, in one launch of ``slots`` programs (a counting
sort; no ``torch.sort``, no host sync, nothing allocated that depends on the data):

- ``sorted_rows [T]`` int32: the rows of slot 0, then of slot 1, ... (each in row order;
  rows of slot -1 appear nowhere; entries past the last segment are never read);
- ``seg_start [slots]``, ``seg_len [slots]`` int32: slot ``s``'s rows are
  ``sorted_rows[seg_start[s] : seg_start[s] + seg_len[s]]``.

Why grouped rather than a per-row slot read by each tile: a tile of rows of one adapter
multiplies one weight tile by many rows (``tl.dot`` on tensor cores), so each adapter's
weights stream once per row tile, not once per row (a 256-row prefill of 8 adapters
reads B 8 times, not 256); rows without an adapter never enter a tile; and the grid is
static: ``(row_tiles(T, slots, BLOCK_M), tiles)`` for any mix. Row program ``p`` takes the
``p``-th row tile of the segments laid end to end (slot 0's tiles, then slot 1's, ...:
:func:`_tile_of` finds its slot from the segments' lengths), and a program past the last
tile, or of a slot of rank 0, exits at once. The row axis needs at most
``cdiv(T, BLOCK_M) + slots - 1`` programs for any mix (:func:`row_tiles`), where a grid of
row tiles x slots would launch ``cdiv(T, BLOCK_M) * slots``, most of which find no rows
when 8 adapters share a 2,048-token prefill chunk. So ``lora_meta`` and the LoRA launches
capture in a CUDA graph at a batch size ``T``, and replays serve any adapter mix written
into the same ``slot_of_row`` buffer. The
per-row slot stays the interface (easy for the runner; one H2D copy into a static
buffer), the grouping is an implementation detail computed once per step and shared by
every LoRA launch of every layer (pass ``meta=``).

Launches: one a LoRA'd projection
---------------------------------
At small batches the cost of multi-LoRA is the number of small launches, not bytes
(issue 47: an adapter on every projection of llama3-8b added 1.2 ms to a 4.9 ms token at
batch 1). A decoder layer of the merged layout (q|k|v, o, gate|up, down) costs
:func:`lora_add`'s **4 launches** (one a projection, every slice in it), plus one
:func:`lora_meta` a step for the whole model. Before: 12 (a memset of the intermediate,
a shrink and an expand per projection); tests/plugins/adapters/test_lora_launches.py
counts them on a model.

:func:`lora_add` (``rows <= FUSED_MAX_ROWS``) launches :func:`_fused_kernel` on the grid
``(row_tiles(T, slots, BLOCK_M), column groups of all slices)``: each program takes one row
tile of one slot's segment and one group of ``n_loop`` column tiles of one slice (the group's
slice, hence its A, B, width, offset and scale, from the group index: groups of slice 0,
then 1, then 2), computes the rank-r intermediate ``h = x_rows @ A_slot^T`` in registers
(float32 accumulation over all of K, no split: no atomics, no memset, deterministic),
then for each column tile ``h @ B_tile^T``, adding ``scaling *`` it into y in place. The
shrink is recomputed per column group: ``K x r`` multiply-adds a row, and the program
reads its rows of x and the slot's A (``K x r``, from L2) whole, ``rank / (BLOCK_N *
n_loop)`` of the base GEMM's work; :func:`fused_config` raises ``n_loop`` (at most
:data:`MAX_N_LOOP`) while the grid keeps a program per SM. Above ``FUSED_MAX_ROWS``
rows (prefill chunks, where re-reading x per column group costs more than a launch) it
runs the shrink into a float32 intermediate (``split_k=1``, not zeroed: the expand reads
only the rows the shrink wrote) and the expand, two launches. With the same tiles both
paths compute the same sums in the same order (bit-equal in the interpreter).

Ops
---
- :func:`lora_add`: ``y[t, off_i + n] += scaling[slot(t)] * sum_j (sum_k x[t, k] *
  A_i[slot(t), j, k]) * B_i[slot(t), n, j]`` for every slice ``i``, in place, one launch
  (see above); what the ``lora`` adapter plugin calls.
- :func:`lora_shrink`: ``h[t, i*rank_max + j] = sum_k x[t, k] * A_i[slot(t), j, k]``
  for every slice ``i`` in one launch; float32 ``[T, slices * rank_max]``, rows of slot
  -1 (and columns ``>= rank``) zero (a memset first). Products of the input dtype, float32
  accumulation; optional split-K over grid axis 1 (float32 ``atomic_add``: the last bits
  may then vary between runs; ``split_k=1`` is bit-deterministic). :func:`lora_add`'s
  two-launch path uses it with ``split_k=1`` and no memset.
- :func:`lora_expand_add`: ``y[t, off_i + n] += scaling[slot(t)] * sum_j h[t, i*rank_max + j]
  * B_i[slot(t), n, j]`` for every slice ``i`` (widths may differ) in one launch, in
  place; the delta in float32 (h is not rounded), one rounding of ``y + delta`` to y's
  dtype (bf16 to nearest-even, as the GPU does, also in the interpreter). Rows of slot
  -1 and columns outside the slices are never read nor written. The same for
  :func:`lora_add`.

PDL (:mod:`.pdl`): every program waits before its first load (everything it reads may
come from the previous kernel) and before an early exit.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops.launch_math import cdiv, k_per_split, next_power_of_2
from pitstop.plugins.kernels.triton_ops.lora_pack import INTERPRETER_TILES, dot_rows
from pitstop.plugins.kernels.triton_ops.lora_pack import lora_pack as lora_pack  # stacked
from pitstop.plugins.kernels.triton_ops.lora_pack import pack_workspace as pack_workspace
from pitstop.plugins.kernels.triton_ops.rope_store import _rounded

MAX_SLICES = 3  # q|k|v; gate|up uses 2, every other projection 1
META_BLOCK = 1024
MAX_N_LOOP = 64  # the fused kernel's most column tiles per program
FUSED_MAX_ROWS = 256  # lora_add: one fused launch up to this many rows, shrink + expand above


class LoRAMeta(NamedTuple):
    """Rows grouped by slot (see the module docstring); int32 device tensors of fixed size."""

    sorted_rows: torch.Tensor  # [T]
    seg_start: torch.Tensor  # [slots]
    seg_len: torch.Tensor  # [slots]


class LoRAConfig(NamedTuple):
    """Launch shape: rows per tile, output columns per tile (expand), K step and splits (shrink);
    ``n_loop``: column tiles per program (the fused kernel only)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    n_loop: int = 1


def default_config(rows: int, k: int, dtype: torch.dtype, device: torch.device) -> LoRAConfig:
    """The launch shape for ``rows`` rows and a shrink over ``k`` (untuned on the GPU so far)."""
    if device.type != "cuda":
        bm, bn, bk = INTERPRETER_TILES
        return LoRAConfig(bm, bn, bk, 1, 1, 1)
    bm = 16 if rows <= 16 else 32 if rows <= 32 else 64
    bk = 32 if dtype == torch.float32 else 128
    # few programs have rows (one row tile per adapter in decode): cut K to keep the SMs
    # busy, at least 512 columns a split
    split = max(1, min(8, k // 512))
    return LoRAConfig(bm, 64, bk, split, 4, 3)


def new_meta(rows: int, slots: int, device: torch.device | str) -> LoRAMeta:
    """Static metadata buffers for ``rows`` rows and ``slots`` slots (fill with :func:`lora_meta`)."""

    def make(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device=device)

    return LoRAMeta(make(rows), make(slots), make(slots))


@triton.jit
def _meta_kernel(slot_ptr, T, rows_ptr, start_ptr, len_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl.wait(PDL)
    s = tl.program_id(0)
    before = s * 0  # rows of slots 0..s-1 (int32 scalars from the start: loop-carried)
    count = s * 0
    for i in range(0, T, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        sl = tl.load(slot_ptr + offs, mask=offs < T, other=-1)
        before += tl.sum(((sl >= 0) & (sl < s)).to(tl.int32), axis=0)
        count += tl.sum((sl == s).to(tl.int32), axis=0)
    tl.store(start_ptr + s, before)
    tl.store(len_ptr + s, count)
    pos = before
    for i in range(0, T, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        sl = tl.load(slot_ptr + offs, mask=offs < T, other=-1)
        mine = (sl == s).to(tl.int32)
        at = pos + tl.cumsum(mine, axis=0) - 1
        tl.store(rows_ptr + at, offs, mask=mine != 0)
        pos += tl.sum(mine, axis=0)
    _pdl.launch_dependents(PDL)


def lora_meta(
    slot_of_row: torch.Tensor,
    slots: int,
    *,
    out: LoRAMeta | None = None,
    pdl: bool | None = None,
) -> LoRAMeta:
    """Group the rows of ``slot_of_row [T]`` (int32, -1: no adapter) by slot, on the device.

    ``out``: static buffers (:func:`new_meta`, ``sorted_rows`` of at least ``T`` entries,
    ``seg_*`` of ``slots``) to fill in place, as a captured graph needs; a fresh set otherwise.
    """
    assert slot_of_row.dim() == 1 and slot_of_row.dtype == torch.int32, "slot_of_row: [T] int32"
    rows = slot_of_row.shape[0]
    meta = out if out is not None else new_meta(rows, slots, slot_of_row.device)
    assert meta.sorted_rows.shape[0] >= rows and meta.seg_len.shape[0] >= slots
    slot_of_row = slot_of_row.contiguous()
    use_pdl = _pdl.enabled(slot_of_row.device, pdl)
    if slots > 0:
        _meta_kernel[(slots,)](
            slot_of_row,
            rows,
            meta.sorted_rows,
            meta.seg_start,
            meta.seg_len,
            BLOCK=META_BLOCK if slot_of_row.is_cuda else 64,
            PDL=use_pdl,
            num_warps=4,
            **_pdl.launch_kwargs(use_pdl),
        )
    return meta


def row_tiles(rows: int, slots: int, block_m: int) -> int:
    """Programs on a LoRA launch's row axis: enough for every slot's row tiles in any mix.

    Slot ``s`` has ``cdiv(len_s, block_m)`` tiles, and ``cdiv(a) + cdiv(b) <= cdiv(a + b) +
    1``, so the segments of ``slots`` slots over ``rows`` rows never need more than
    ``cdiv(rows, block_m) + slots - 1``; a grid of row tiles x slots (most of whose
    programs find no rows once several adapters share a batch) would launch
    ``cdiv(rows, block_m) * slots``."""
    return cdiv(rows, block_m) + max(slots, 1) - 1


@triton.jit
def _tile_of(pid, len_ptr, S, BM: tl.constexpr, SP: tl.constexpr):
    """Row tile ``pid`` of the launch as (slot, tile within the slot's segment): the tiles of
    slot 0's segment first, then slot 1's, ...; a ``pid`` past the last is slot ``S``."""
    s = tl.arange(0, SP)
    tiles = (tl.load(len_ptr + s, mask=s < S, other=0) + BM - 1) // BM
    slot = tl.sum((tl.cumsum(tiles, axis=0) <= pid).to(tl.int32), axis=0)
    before = tl.sum(tl.where(s < slot, tiles, 0), axis=0)
    return slot, pid - before


@triton.jit
def _segment(
    rows_ptr,
    start_ptr,
    len_ptr,
    rank_ptr,
    pid,
    S,
    R,
    BM: tl.constexpr,
    SP: tl.constexpr,
    HAS_RANK: tl.constexpr,
):
    """Row tile ``pid``'s slot, its rows (int64), their mask, the slot's rank, and whether the
    program has no work (past the last tile, or a slot of rank 0)."""
    slot, pid_m = _tile_of(pid, len_ptr, S, BM, SP)
    past = slot >= S
    slot = tl.minimum(slot, S - 1)  # a program past the last tile reads slot S-1, then exits
    seg_len = tl.where(past, 0, tl.load(len_ptr + slot))
    if HAS_RANK:
        rank = tl.minimum(tl.load(rank_ptr + slot), R)
    else:
        rank = R
    m = pid_m * BM + tl.arange(0, BM)
    m_ok = m < seg_len
    rows = tl.load(rows_ptr + tl.load(start_ptr + slot) + m, mask=m_ok, other=0).to(tl.int64)
    idle = (pid_m * BM >= seg_len) | (rank <= 0)
    return slot, rows, m_ok, rank, idle


@triton.jit
def _shrink_kernel(
    x_ptr,
    stride_xm,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    stride_as,
    stride_ar,
    h_ptr,
    stride_hm,
    rows_ptr,
    start_ptr,
    len_ptr,
    rank_ptr,
    K,
    R,
    S,
    k_per_split,
    SPLIT_K: tl.constexpr,
    BM: tl.constexpr,
    SP: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
    HAS_RANK: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl.wait(PDL)  # before the early exit too (pdl.py: the chain)
    sl = tl.program_id(1) // SPLIT_K
    split = tl.program_id(1) % SPLIT_K
    slot, rows, m_ok, rank, idle = _segment(
        rows_ptr, start_ptr, len_ptr, rank_ptr, tl.program_id(0), S, R, BM, SP, HAS_RANK
    )
    if idle:
        return
    a_ptr = a0_ptr
    if sl == 1:
        a_ptr = a1_ptr
    if sl == 2:
        a_ptr = a2_ptr
    a_ptr += slot.to(tl.int64) * stride_as
    r = tl.arange(0, BR)
    r_ok = r < rank
    k_lo = split * k_per_split
    acc = tl.zeros([BM, BR], dtype=tl.float32)
    for kk in range(0, k_per_split, BK):
        k = k_lo + kk + tl.arange(0, BK)
        k_ok = (k < K) & (kk + tl.arange(0, BK) < k_per_split)
        xt = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        at = tl.load(
            a_ptr + r[:, None] * stride_ar + k[None, :],
            mask=r_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc = dot_rows(acc, xt, at, UPCAST, DOT_PRECISION)
    _pdl.launch_dependents(PDL)
    hp = h_ptr + rows[:, None] * stride_hm + sl * R + r[None, :]
    mask = m_ok[:, None] & (r < R)[None, :]
    if SPLIT_K == 1:
        tl.store(hp, acc, mask=mask)
    else:
        tl.atomic_add(hp, acc, mask=mask)


@triton.jit
def _slice_of(pid_n, t0, t1, sb0, sb1, sb2, n0, n1, n2, off0, off1, off2):
    """Column tile ``pid_n``'s slice (tiles ``[0, t0)`` of slice 0, ``[t0, t0 + t1)`` of slice
    1, then 2): its index, B's slot stride, width, first column in y and first tile."""
    sl = (pid_n >= t0).to(tl.int32) + (pid_n >= t0 + t1).to(tl.int32)
    # integers by tl.where: an argument equal to 1 is a compile-time constant (Triton's
    # specialization), which an if-branch could not reassign to a run-time value
    sb = tl.where(sl == 0, sb0, tl.where(sl == 1, sb1, sb2)).to(tl.int64)
    width = tl.where(sl == 0, n0, tl.where(sl == 1, n1, n2))
    off = tl.where(sl == 0, off0, tl.where(sl == 1, off1, off2))
    first = tl.where(sl == 0, 0, tl.where(sl == 1, t0, t0 + t1))
    return sl, sb, width, off, first


@triton.jit
def _pick(p0, p1, p2, sl):
    """Slice ``sl``'s pointer of three."""
    p = p0
    if sl == 1:
        p = p1
    if sl == 2:
        p = p2
    return p


@triton.jit
def _expand_kernel(
    y_ptr,
    stride_ym,
    h_ptr,
    stride_hm,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    sb0,
    sb1,
    sb2,
    stride_bn,
    n0,
    n1,
    n2,
    off0,
    off1,
    off2,
    t0,
    t1,
    rows_ptr,
    start_ptr,
    len_ptr,
    rank_ptr,
    scale_ptr,
    stride_ss,
    stride_si,
    R,
    S,
    BM: tl.constexpr,
    SP: tl.constexpr,
    BN: tl.constexpr,
    BR: tl.constexpr,
    HAS_RANK: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl.wait(PDL)  # before the early exit too (pdl.py: the chain)
    pid_n = tl.program_id(1)
    slot, rows, m_ok, rank, idle = _segment(
        rows_ptr, start_ptr, len_ptr, rank_ptr, tl.program_id(0), S, R, BM, SP, HAS_RANK
    )
    if idle:
        return
    sl, sb, width, off, first = _slice_of(
        pid_n, t0, t1, sb0, sb1, sb2, n0, n1, n2, off0, off1, off2
    )
    b_ptr = _pick(b0_ptr, b1_ptr, b2_ptr, sl) + slot.to(tl.int64) * sb
    n = (pid_n - first) * BN + tl.arange(0, BN)
    n_ok = n < width
    r = tl.arange(0, BR)
    r_ok = r < rank
    ht = tl.load(
        h_ptr + rows[:, None] * stride_hm + sl * R + r[None, :],
        mask=m_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    bt = tl.load(
        b_ptr + n[:, None] * stride_bn + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0
    )
    delta = tl.dot(ht, tl.trans(bt.to(tl.float32)), input_precision="ieee")
    scale = tl.load(scale_ptr + slot * stride_ss + sl * stride_si)
    yp = y_ptr + rows[:, None] * stride_ym + off + n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    yt = tl.load(yp, mask=mask, other=0.0)
    _pdl.launch_dependents(PDL)
    out = yt.to(tl.float32) + scale * delta
    tl.store(yp, _rounded(out, yt.dtype).to(yt.dtype), mask=mask)


@triton.jit
def _fused_kernel(
    y_ptr,
    stride_ym,
    x_ptr,
    stride_xm,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    stride_as,
    stride_ar,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    sb0,
    sb1,
    sb2,
    stride_bn,
    n0,
    n1,
    n2,
    off0,
    off1,
    off2,
    t0,
    t1,
    rows_ptr,
    start_ptr,
    len_ptr,
    rank_ptr,
    scale_ptr,
    stride_ss,
    stride_si,
    K,
    R,
    S,
    n_loop,
    BM: tl.constexpr,
    SP: tl.constexpr,
    BN: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
    HAS_RANK: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """Shrink and expand in one program: ``h = x_rows @ A^T`` (float32, in registers, over
    all of K), then ``y_tile += scaling * h @ B_tile^T``, for one row tile of one slot and
    ``n_loop`` column tiles of ``BN`` of one slice (``t0``, ``t1``: the slices' groups of
    ``n_loop * BN`` columns)."""
    _pdl.wait(PDL)  # before the early exit too (pdl.py: the chain)
    pid_n = tl.program_id(1)
    slot, rows, m_ok, rank, idle = _segment(
        rows_ptr, start_ptr, len_ptr, rank_ptr, tl.program_id(0), S, R, BM, SP, HAS_RANK
    )
    if idle:
        return
    # this column group's slice (t0, t1 count groups here)
    sl, sb, width, off, first = _slice_of(
        pid_n, t0, t1, sb0, sb1, sb2, n0, n1, n2, off0, off1, off2
    )
    a_ptr = _pick(a0_ptr, a1_ptr, a2_ptr, sl) + slot.to(tl.int64) * stride_as
    b_ptr = _pick(b0_ptr, b1_ptr, b2_ptr, sl) + slot.to(tl.int64) * sb
    r = tl.arange(0, BR)
    r_ok = r < rank
    # the shrink, as _shrink_kernel's with split_k=1 (the same sums in the same order)
    h = tl.zeros([BM, BR], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        xt = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        at = tl.load(
            a_ptr + r[:, None] * stride_ar + k[None, :],
            mask=r_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        h = dot_rows(h, xt, at, UPCAST, DOT_PRECISION)
    # the expand, as _expand_kernel's (h not rounded; columns >= rank of h are zero), over
    # the n_loop column tiles of this program (h computed once for all of them)
    scale = tl.load(scale_ptr + slot * stride_ss + sl * stride_si)
    _pdl.launch_dependents(PDL)
    for j in range(0, n_loop):
        n = ((pid_n - first) * n_loop + j) * BN + tl.arange(0, BN)
        n_ok = n < width
        bt = tl.load(
            b_ptr + n[:, None] * stride_bn + r[None, :],
            mask=n_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        delta = tl.dot(h, tl.trans(bt.to(tl.float32)), input_precision="ieee")
        yp = y_ptr + rows[:, None] * stride_ym + off + n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        yt = tl.load(yp, mask=mask, other=0.0)
        out = yt.to(tl.float32) + scale * delta
        tl.store(yp, _rounded(out, yt.dtype).to(yt.dtype), mask=mask)


def _slices(w: torch.Tensor | Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    ws = [w] if isinstance(w, torch.Tensor) else list(w)
    assert 1 <= len(ws) <= MAX_SLICES, f"{what}: 1 to {MAX_SLICES} slices, not {len(ws)}"
    for t in ws:
        assert t.dim() == 3 and t.is_contiguous(), f"{what}: contiguous [slots, ., .] tensors"
    return ws


def _lanes(n: int) -> int:
    """A block dimension for ``n`` ranks or slots: a power of two, at least 16 (``tl.dot``'s
    least, and the width of :func:`_tile_of`'s vector of slots)."""
    return max(16, next_power_of_2(n))


def _check_rows(slot_of_row: torch.Tensor, rows: int, meta: LoRAMeta | None, slots: int):
    assert slot_of_row.shape == (rows,), f"slot_of_row: [{rows}], not {tuple(slot_of_row.shape)}"
    return meta if meta is not None else lora_meta(slot_of_row, slots)


def lora_shrink(
    x: torch.Tensor,
    A: torch.Tensor | Sequence[torch.Tensor],
    slot_of_row: torch.Tensor,
    ranks: torch.Tensor | None = None,
    *,
    meta: LoRAMeta | None = None,
    out: torch.Tensor | None = None,
    config: LoRAConfig | None = None,
    pdl: bool | None = None,
    zeroed: bool = False,
) -> torch.Tensor:
    """``h = x @ A_i[slot].T`` per row and slice, float32 ``[T, slices * rank_max]``.

    ``x [T, K]`` (bf16, fp16 or fp32, unit column stride); ``A``: one ``[slots, rank_max, K]``
    tensor per slice (same shape for all), of x's dtype; ``slot_of_row [T]`` int32 (-1: no
    adapter); ``ranks [slots]`` int32 (None: every slot at ``rank_max``); ``meta``: from
    :func:`lora_meta` (computed here when None); ``out``: float32 ``[T, slices * rank_max]``
    to write, any row stride (zeroed here first: rows of slot -1 come out zero), or, with
    ``zeroed``, already zero: the caller cleared a workspace once for many shrinks (a split
    of K adds its partial sums into ``out``, so it must start at zero).
    """
    a_list = _check_a(x, A)
    slots, rank_max, _ = a_list[0].shape
    rows = x.shape[0]
    meta = _check_rows(slot_of_row, rows, meta, slots)
    width = len(a_list) * rank_max
    h = out if out is not None else torch.empty(rows, width, dtype=torch.float32, device=x.device)
    assert h.shape == (rows, width) and h.dtype == torch.float32 and h.stride(1) == 1
    assert out is not None or not zeroed, "zeroed describes an out given"
    if not zeroed:
        h.zero_()
    _shrink(x, a_list, h, meta, ranks, config, pdl)
    return h


def _check_a(x: torch.Tensor, A: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    a_list = _slices(A, "A")
    assert x.dim() == 2 and x.shape[1] == a_list[0].shape[2] and x.stride(1) == 1, (
        "x: [T, K], unit column stride"
    )
    assert all(a.shape == a_list[0].shape and a.dtype == x.dtype for a in a_list)
    return a_list


def _shrink(
    x: torch.Tensor,
    a_list: list[torch.Tensor],
    h: torch.Tensor,
    meta: LoRAMeta,
    ranks: torch.Tensor | None,
    config: LoRAConfig | None,
    pdl: bool | None,
) -> None:
    """Launch the shrink into ``h`` (rows of each segment written; the others untouched)."""
    slots, rank_max, k = a_list[0].shape
    rows = x.shape[0]
    if rows == 0 or slots == 0 or rank_max == 0:
        return
    cfg = config or default_config(rows, k, x.dtype, x.device)
    per_split = k_per_split(k, cfg.split_k, cfg.block_k)
    split = cdiv(k, per_split)
    pad = a_list + [a_list[0]] * (MAX_SLICES - len(a_list))
    use_pdl = _pdl.enabled(x.device, pdl)
    grid = (row_tiles(rows, slots, cfg.block_m), len(a_list) * split)
    _shrink_kernel[grid](
        x,
        x.stride(0),
        *pad,
        a_list[0].stride(0),
        a_list[0].stride(1),
        h,
        h.stride(0),
        *meta,
        ranks if ranks is not None else meta.seg_len,
        k,
        rank_max,
        slots,
        per_split,
        SPLIT_K=split,
        BM=cfg.block_m,
        SP=_lanes(slots),
        BR=_lanes(rank_max),
        BK=cfg.block_k,
        HAS_RANK=ranks is not None,
        UPCAST=x.device.type != "cuda" and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=use_pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **_pdl.launch_kwargs(use_pdl),
    )


class _SliceArgs(NamedTuple):
    """The per-slice launch arguments of the expand and the fused kernel (padded to 3 slices)."""

    b: list[torch.Tensor]  # B per slice
    b_strides: list[int]  # its slot stride per slice
    widths: list[int]
    offsets: list[int]
    t0: int  # column tiles of slice 0
    t1: int  # of slice 1
    tiles: int  # of all slices


def _check_b(
    y: torch.Tensor,
    B: torch.Tensor | Sequence[torch.Tensor],
    scaling: torch.Tensor,
    offset: int,
    offsets: Sequence[int] | None,
) -> list[torch.Tensor]:
    b_list = _slices(B, "B")
    slots, _, rank_max = b_list[0].shape
    widths = [b.shape[1] for b in b_list]
    if offsets is None:
        offsets = [offset + sum(widths[:i]) for i in range(len(b_list))]
    assert len(offsets) == len(b_list), "one offset per slice"
    assert y.dim() == 2 and y.stride(1) == 1, "y: [T, N], unit column stride"
    assert all(0 <= o and o + w <= y.shape[1] for o, w in zip(offsets, widths, strict=True))
    assert all(b.shape[0] == slots and b.shape[2] == rank_max for b in b_list)
    assert scaling.dtype == torch.float32 and scaling.shape[0] == slots
    return b_list


def _slice_args(
    b_list: list[torch.Tensor], offset: int, offsets: Sequence[int] | None, block_n: int
) -> _SliceArgs:
    widths = [b.shape[1] for b in b_list]
    if offsets is None:
        offsets = [offset + sum(widths[:i]) for i in range(len(b_list))]
    more = MAX_SLICES - len(b_list)
    tiles = [cdiv(w, block_n) for w in widths] + [0] * more
    pad = b_list + [b_list[0]] * more
    return _SliceArgs(
        pad,
        [b.stride(0) for b in pad],
        widths + [0] * more,
        list(offsets) + [0] * more,
        tiles[0],
        tiles[1],
        sum(tiles),
    )


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
    meta: LoRAMeta | None = None,
    config: LoRAConfig | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``y[:, off_i : off_i + N_i] += scaling[slot] * h_i @ B_i[slot].T`` per row, in place; returns y.

    ``y [T, N]`` (the base GEMM's output, unit column stride); ``h``: :func:`lora_shrink`'s
    float32 ``[T, slices * rank_max]`` (slice ``i`` in columns ``i * rank_max ...``);
    ``B``: one ``[slots, N_i, rank_max]`` tensor per slice (widths may differ);
    ``scaling``: float32 ``[slots]`` or ``[slots, slices]``; ``ranks`` as for the shrink.
    Slice ``i`` lands at column ``offsets[i]``, or by default packed from ``offset``
    (``offset + N_0 + ... + N_{i-1}``: q|k|v of a merged QKV output). Rows of slot -1
    and the other columns of y are untouched.
    """
    b_list = _check_b(y, B, scaling, offset, offsets)
    slots, _, rank_max = b_list[0].shape
    rows = y.shape[0]
    assert h.shape == (rows, len(b_list) * rank_max) and h.dtype == torch.float32
    assert h.stride(1) == 1
    meta = _check_rows(slot_of_row, rows, meta, slots)
    if rows == 0 or slots == 0 or rank_max == 0:
        return y
    cfg = config or default_config(rows, 0, y.dtype, y.device)
    sa = _slice_args(b_list, offset, offsets, cfg.block_n)
    if sa.tiles == 0:
        return y
    stride_si = scaling.stride(1) if scaling.dim() == 2 else 0
    use_pdl = _pdl.enabled(y.device, pdl)
    grid = (row_tiles(rows, slots, cfg.block_m), sa.tiles)
    _expand_kernel[grid](
        y,
        y.stride(0),
        h,
        h.stride(0),
        *sa.b,
        *sa.b_strides,
        sa.b[0].stride(1),
        *sa.widths,
        *sa.offsets,
        sa.t0,
        sa.t1,
        *meta,
        ranks if ranks is not None else meta.seg_len,
        scaling,
        scaling.stride(0),
        stride_si,
        rank_max,
        slots,
        BM=cfg.block_m,
        SP=_lanes(slots),
        BN=cfg.block_n,
        BR=_lanes(rank_max),
        HAS_RANK=ranks is not None,
        PDL=use_pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **_pdl.launch_kwargs(use_pdl),
    )
    return y


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fused_config(
    rows: int, k: int, widths: Sequence[int], dtype: torch.dtype, device: torch.device
) -> LoRAConfig:
    """The fused kernel's launch shape for ``rows`` rows, ``K = k`` and slices of ``widths``
    columns (untuned on the GPU so far).

    No split of K (``split_k`` is 1 and ignored): each program loops over all of K, then
    over ``n_loop`` column tiles. A program's fixed cost is reading its rows of x and its
    slot's A (``K x rank``) whole, and every program of a row tile reads that tile's x, so
    the fewer programs the less is read: ``n_loop`` grows (up to :data:`MAX_N_LOOP`) while
    the grid still has about a program per SM. Row tiles of 16 at any batch: B (``N x
    rank``) is read once per row tile, and x once per column group, and at ``rank`` 16
    small row tiles with long column loops read the least of both (llama3-8b's gate|up at
    256 rows: about 30 MB with 16-row tiles, 70 MB with 64)."""
    if device.type != "cuda":
        bm, bn, bk = INTERPRETER_TILES
        return LoRAConfig(bm, bn, bk, 1, 1, 1)
    bm = 16
    bn = 64 if rows <= 16 else 128
    bk = 32 if dtype == torch.float32 else 256 if rows <= 16 else 128
    index = device.index if device.index is not None else torch.cuda.current_device()
    tiles = sum(cdiv(w, bn) for w in widths) * cdiv(rows, bm)
    n_loop = max(1, min(MAX_N_LOOP, tiles // _sm_count(index)))
    return LoRAConfig(bm, bn, bk, 1, 4, 3, n_loop)


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
    meta: LoRAMeta | None = None,
    config: LoRAConfig | None = None,
    fused: bool | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``y[:, off_i : off_i + N_i] += scaling[slot] * (x @ A_i[slot].T) @ B_i[slot].T`` per row,
    in place, every slice at once; returns y. What a LoRA'd projection adds to its base output.

    Arguments as for :func:`lora_shrink` and :func:`lora_expand_add`. ``fused`` (None: by
    rows, ``rows <= FUSED_MAX_ROWS``): one launch of :func:`_fused_kernel` (the shrink
    recomputed per column tile, in registers); else, for many rows (a prefill, where the
    recomputation would cost more than a launch), the shrink into a float32 intermediate
    (``split_k=1``, not zeroed: only the rows the expand reads are written) and the expand,
    two launches. ``config``: :func:`fused_config`'s or :func:`default_config`'s by default.
    """
    a_list = _check_a(x, A)
    b_list = _check_b(y, B, scaling, offset, offsets)
    slots, rank_max, k = a_list[0].shape
    rows = y.shape[0]
    assert x.shape[0] == rows, "x and y: the same rows"
    assert len(a_list) == len(b_list), "one A and one B per slice"
    assert all(b.shape[0] == slots and b.shape[2] == rank_max for b in b_list)
    meta = _check_rows(slot_of_row, rows, meta, slots)
    if rows == 0 or slots == 0 or rank_max == 0:
        return y
    if fused is None:
        fused = rows <= FUSED_MAX_ROWS
    if not fused:
        cfg = (config or default_config(rows, k, x.dtype, x.device))._replace(split_k=1)
        h = torch.empty(rows, len(a_list) * rank_max, dtype=torch.float32, device=x.device)
        _shrink(x, a_list, h, meta, ranks, cfg, pdl)
        kw = {"offset": offset, "offsets": offsets, "meta": meta, "config": cfg, "pdl": pdl}
        return lora_expand_add(y, h, b_list, slot_of_row, scaling, ranks, **kw)
    cfg = config or fused_config(rows, k, [b.shape[1] for b in b_list], x.dtype, x.device)
    sa = _slice_args(b_list, offset, offsets, cfg.block_n * cfg.n_loop)
    stride_si = scaling.stride(1) if scaling.dim() == 2 else 0
    use_pdl = _pdl.enabled(y.device, pdl)
    grid = (row_tiles(rows, slots, cfg.block_m), sa.tiles)
    _fused_kernel[grid](
        y,
        y.stride(0),
        x,
        x.stride(0),
        *(a_list + [a_list[0]] * (MAX_SLICES - len(a_list))),
        a_list[0].stride(0),
        a_list[0].stride(1),
        *sa.b,
        *sa.b_strides,
        sa.b[0].stride(1),
        *sa.widths,
        *sa.offsets,
        sa.t0,
        sa.t1,
        *meta,
        ranks if ranks is not None else meta.seg_len,
        scaling,
        scaling.stride(0),
        stride_si,
        k,
        rank_max,
        slots,
        cfg.n_loop,
        BM=cfg.block_m,
        SP=_lanes(slots),
        BN=cfg.block_n,
        BR=_lanes(rank_max),
        BK=cfg.block_k,
        HAS_RANK=ranks is not None,
        UPCAST=x.device.type != "cuda" and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=use_pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **_pdl.launch_kwargs(use_pdl),
    )
    return y
