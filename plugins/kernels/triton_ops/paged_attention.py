"""Paged attention over the KV cache: split-K decode and GQA-packed varlen causal prefill.

The cache is ``[num_pages, page_size, Hkv, D]`` for K and for V; a sequence's
token ``n`` lives at page ``block_tables[seq, n // page_size]``, offset
``n % page_size``. A cached prefix (prefix caching, chunked prefill) is read
in place, so one kernel serves a fresh prompt and a chunk over a cached prefix.

Both kernels run the same loop, :func:`.attend._attend`: key tiles of ``BLOCK_N``
tokens gathered through the block table (:func:`.attend._page_rows`; ``page_size``
is a compile-time constant, so the address arithmetic is shifts and masks),
loaded as whole 16-byte vectors into the software pipeline's shared-memory
stages (``num_stages``, cp.async), ``q @ k^T`` and ``p @ v`` through
``tl.dot`` (wgmma on Hopper) accumulated in float32, and an online softmax in
the log2 domain (scores times ``scale * log2(e)``, then ``exp2``). Only the
tiles that need a mask get one.

GQA packing: a program holds the query heads of one KV group, so every K/V
tile it loads serves ``group`` query heads. Its ``BLOCK_M`` rows are
``BLOCK_Q = BLOCK_M // group`` query tokens times the group's heads (row
``r`` is token ``r // group``, head ``r % group``; any group size works, rows
past ``BLOCK_Q * group`` are padding).

Prefill (sequences computing several tokens, prefills first in the batch):
    grid ``(Hkv, cdiv(max_query_len, BLOCK_Q), num_prefills)``, the
    query blocks in reverse so that the longest (last) rows start first. Keys
    below a block's first query position are visible to every row and need no
    mask; the diagonal tiles get the causal mask; tiles above the diagonal are
    skipped.

Decode (sequences computing one token):
    grid ``(num_decodes, Hkv, num_splits)``: the group's heads are the rows of
    one tile (padded to 16), the context is cut into ``num_splits`` equal
    parts per sequence (computed on the device from its context length) and
    a second small kernel merges the parts' partial softmax states.
    ``num_splits`` depends only on the batch size and the configured maximum
    context (never on this step's lengths), so the grid is fixed for a fixed
    batch size and the launch can be captured in a CUDA graph.

One-launch merge (``PagedAttention(decode_merge="last-program")``, issue 29;
the default ``"separate"`` keeps the second kernel, unchanged): with more than
one split, each split program writes its partial ``(o, m, l)`` as before (an
empty split its zero ``o`` too), then increments the arrival counter of its
(decode, KV head), an int32 owned by the ``PagedAttention``
(:attr:`PagedAttention.decode_counters`, zeroed once at construction). The
program that reads ``num_splits - 1`` from the counter arrived last: it loads
every split's partial, merges them as the second kernel would (the same
formula, split after split in split order; the sums, not the arrival order,
fix the bits, so the result is deterministic), writes the output and stores
0 into the counter. No program waits for another (nothing spins, so nothing
depends on which programs are resident), and every launch leaves the counters
as it found them: zero, without a memset per call, which keeps it graph-safe.

    Memory ordering. Triton executes a scalar atomic in one thread of the
    program and broadcasts its result through shared memory. The writer: all
    threads store their part of the partial (plain ``st.global``), then
    ``tl.debug_barrier()`` (``bar.sync``: every thread's stores precede
    whatever the program does next, in the PTX model's causality order),
    then ``atomic_add(counter, 1, sem="acq_rel", scope="gpu")``, whose release
    is cumulative: it publishes every store ordered before it, the other
    threads' included. The reader: the increments of one counter are totally
    ordered (its modification order); reading ``num_splits - 1`` means every
    other split's increment came before, and as each is an ``acq_rel`` RMW,
    each one's release synchronizes with the next one's acquire down the
    chain: every split's partial stores happen before the last program's
    acquire. Its other threads are ordered after that acquire by the result's
    broadcast and a second ``tl.debug_barrier()``, and its loads of the
    partials bypass L1 (``.cg``), so no line cached there earlier can be
    read. The reset is a plain store: every increment of this launch has
    happened, and the next launch on the stream (or the next node of a graph)
    starts after this grid completes. Counters are per (decode, KV head) of
    one launch, so launches must not run concurrently on two streams (the
    engine uses one). Triton's interpreter runs programs one after another
    (the last split always merges), so the CPU tests check the arithmetic and
    the counters' reset, not this argument; tests/plugins/kernels/test_fused_gpu.py replays a
    captured graph hundreds of times and requires the same bits every time.

    An aborted launch: a program that never increments (a device fault
    mid-grid) would leave a count behind, and the next launch would merge
    early and wrong. CUDA faults are sticky (the context must be recreated,
    and the counters with it); otherwise
    :meth:`PagedAttention.reset_decode_counters` zeroes them. ``num_splits``
    gives more than one split only while ``num_decodes * Hkv <= split_waves
    * num_sms / 2``, so ``split_waves * num_sms`` counters cover every split
    launch of the engine; a forced split count past that grows them, outside
    a capture only.

Tile shapes are kept in code, keyed by head size and GQA ratio
(:data:`PREFILL_TILES`, :data:`DECODE_TILES`); they were chosen by the sweep
``python benchmarks/kernels_bench.py --tune`` on the H200. Nothing is tuned at
start-up.

An fp8 cache (``float8_e4m3fn``, ``float8_e5m2``: half the bytes of bf16 per
tile) is read as it is stored and widened in registers (exact: every fp8
value is a bf16 and an fp16 value); its scales (``kv_scale`` ``[2]``, read on
the device) are folded in where they cost nothing: K's into the softmax
scale, V's into the output once per program. The widening is a compile-time
choice (``PagedAttention(fp8_widen=...)``):

- ``"fp16"`` (the default; bf16 queries only): K and V tiles are widened to
  fp16, one hardware conversion per pair on Hopper (``cvt.rn.f16x2.e4m3x2``)
  where e4m3 to bf16 takes several instructions (which bounded the decode
  kernel at 45% of copy bandwidth on the H200, issue 29); both products run on fp16 operands with float32 accumulation, the
  probabilities rounded to fp16 (3 more mantissa bits than bf16) before P·V.
  The query tile is converted once per program, scaled by a power of two
  ``2^-e`` taken from the bits of its largest magnitude (``e`` = its exponent
  minus 14, clamped to [-112, 113]) so that the largest element lands in
  [2^14, 2^15) (lower for a tile below 2^-98, e.g. all zeros): nothing overflows fp16's 65504 whatever the bf16 query
  holds, every element within 2^-28 of the largest converts exactly (bf16's
  8 significant bits fit fp16's 11), smaller ones keep fp16's subnormal
  spacing (an error below 2^-39 of the largest); ``2^e`` is folded into the
  softmax scale (exact: a power of two), so no score changes.
- ``"query"``: K and V widened to the query's dtype (bf16), as before.
- ``"qk-fp8"`` (bf16 queries over an e4m3 cache; an e5m2 cache takes
  ``"fp16"``): each query row is scaled by a power of two ``2^-e_i`` (its
  largest magnitude into [2^7, 2^8)) and rounded to e4m3, so ``q . k`` runs on
  the fp8 tensor cores straight from the stored K tile, with no widening;
  ``2^e_i`` multiplies row ``i``'s scores back (exact). V is widened to fp16
  and P rounded to fp16 for ``P . V``, as in ``"fp16"``. The query's rounding
  to 3 mantissa bits is the one loss (FlashAttention 3's fp8 path rounds the
  query too); a test holds the kernel to attention over that rounded query,
  computed in float64.

fp16 and float32 queries always widen to their own dtype (fp16 already is
the one-instruction path; float32 keeps IEEE products), and a bf16 cache
compiles the same kernel whatever ``fp8_widen`` says.

PDL (``PagedAttention(pdl=...)``, :mod:`.pdl`): every kernel waits (``gdc_wait``)
before its first read, since all it reads (q, the cache, the tables, the
lengths, the partials) may come from the kernels before it; it lets the next
kernel launch once its key loop is done.

``precision="fp32"`` runs float32 inputs' matrix products in IEEE fp32;
``"fast"`` lets them use TF32 (for bf16/fp16 inputs the products are on the
tensor cores either way, the probabilities rounded to the input dtype before
P·V as every flash kernel does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pitstop.ground.attention import AttentionMetadata
from pitstop.plugins.kernels.cudnn_prefill import CudnnPrefill
from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops import prefix_share
from pitstop.plugins.kernels.triton_ops.attend import (
    _attend,
    _attend_begin,
    _fp8_query,
    _fp16_query,
    _head_rows,
    _v_scaled,
)
from pitstop.plugins.kernels.triton_ops.launch_math import cdiv, next_power_of_2

LOG2E = 1.4426950408889634
FP8_WIDEN = ("fp16", "query", "qk-fp8")  # PagedAttention(fp8_widen=...): module docstring
DECODE_MERGE = ("separate", "last-program")  # PagedAttention(decode_merge=...): module docstring


class PrefillTiles(NamedTuple):
    """Launch shape of the prefill kernel: rows (tokens x group heads) and keys per tile."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


class DecodeTiles(NamedTuple):
    """Launch shape of the decode kernel: keys per tile."""

    block_n: int
    num_warps: int
    num_stages: int


# The winners of `kernels_bench.py --tune` on the H200 (bf16, 4,096 and 16,384 tokens, page 16,
# 2026-12-01), keyed by (head_size, group); other shapes take the rule in prefill_tiles().
PREFILL_TILES: dict[tuple[int, int], PrefillTiles] = {
    (128, 1): PrefillTiles(128, 128, 8, 3),
    (128, 2): PrefillTiles(128, 64, 4, 3),
    (128, 4): PrefillTiles(256, 64, 8, 3),
    (128, 8): PrefillTiles(128, 64, 4, 3),
    (64, 4): PrefillTiles(128, 64, 4, 3),
}
# Decode, keyed by head size, for groups of up to 8 query heads per KV head (two warps per
# program and four stages: the best worst case over batch 256 x 512 and 64 x 2,048; 1-warp
# programs were within run-to-run noise of it); larger groups need more warps.
DECODE_TILES: dict[int, DecodeTiles] = {
    128: DecodeTiles(64, 2, 4),
    64: DecodeTiles(64, 2, 4),
}
# decode_tiles="by-batch" (fused.decode_tiles): the H200 decode sweep's best tiles at head size
# 128, group 4 (docs/benchmarks.md, 2026-12-02): (32, 1, 2) from 128 decodes a launch (bf16
# 92.5% -> 99.9% of copy bandwidth at 256 x 512, fp8 59.6% -> 70.2%), and (64, 2, 2) for an
# fp8 cache below that (63.0% -> 65.7% at 64 x 2,048); bf16 below 128 keeps DECODE_TILES.
DECODE_TILE_RULES = ("fixed", "by-batch")  # PagedAttention(decode_tile_rule=...)
WIDE_BATCH_DECODE = 128
WIDE_BATCH_TILES = DecodeTiles(32, 1, 2)
FP8_DECODE_TILES = DecodeTiles(64, 2, 2)
# the interpreter: small tiles so that small test shapes still cross tile borders
INTERPRETER_PREFILL = PrefillTiles(32, 16, 1, 1)
INTERPRETER_DECODE = DecodeTiles(16, 1, 1)


def prefill_tiles(head_size: int, group: int, dtype: torch.dtype) -> PrefillTiles:
    """The prefill tiles for this head size and GQA ratio on a CUDA device."""
    if dtype == torch.float32:  # IEEE fp32 products run on FMA units: small tiles, 8 warps
        return PrefillTiles(64, 32, 8, 2) if head_size <= 128 else PrefillTiles(32, 16, 4, 2)
    tiles = PREFILL_TILES.get((head_size, group)) or PREFILL_TILES.get((head_size, 4))
    if tiles is None:
        tiles = PrefillTiles(128, 64, 4, 3) if head_size <= 128 else PrefillTiles(64, 32, 4, 3)
    if group > tiles.block_m:  # at least one query token per tile
        tiles = tiles._replace(block_m=next_power_of_2(group))
    return tiles


def decode_tiles(head_size: int, group: int, dtype: torch.dtype) -> DecodeTiles:
    """The decode tiles for this head size and GQA ratio on a CUDA device."""
    if dtype == torch.float32:  # with 4 warps ptxas spills
        return DecodeTiles(32, 8, 2)
    if head_size in DECODE_TILES and group <= 8:
        return DECODE_TILES[head_size]
    return DecodeTiles(64, 4, 3) if head_size <= 128 else DecodeTiles(32, 4, 2)


# q_row0 and seq0 change every mixed step, and stride_bt with the step's block-table width:
# not specializing on them (== 1, % 16) keeps one compiled variant per split count instead
# of several, all compiled at start-up (otherwise mixed steps compiled ~1 s each on first use).
@triton.jit(do_not_specialize=["q_row0", "seq0", "stride_bt"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    counters_ptr,
    share_start_ptr,
    scale_log2e,
    q_row0,
    seq0,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
    WIDEN_F16: tl.constexpr,
    Q_FP8: tl.constexpr,
    MERGE_LAST: tl.constexpr,
    MERGE_G: tl.constexpr,
    PDL: tl.constexpr,
    SHARE_SPLITS: tl.constexpr = 0,
    SPLIT_TOKENS: tl.constexpr = 0,
):
    # SPLIT_TOKENS > 0 (decode_split_tokens): each split covers that many tokens (a multiple of
    # BLOCK_N), so a program's work is bounded whatever its sequence's length; the splits past
    # a context's end exit at once (split 0 always writes: a padding row's empty state), and
    # the reduce kernel merges only the splits the context reaches.
    # SHARE_SPLITS > 0 (prefix_share): the context starts at share_start[b] (a group's shared
    # pass, .prefix_share, covers the tokens before), and the partials have SHARE_SPLITS more
    # slots after the splits, which a decode outside any group marks empty
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = (seq0 + b).to(tl.int64)
    # the context length before the wait: the runner copies it in before the step's first
    # kernel (no kernel of the chain writes it)
    ctx = tl.load(context_lens_ptr + seq)
    _pdl.wait(PDL)  # q, the cache (this step's token), the partials' slots: the kernels' before
    first = 0
    if SHARE_SPLITS > 0:
        first = tl.load(share_start_ptr + b)
    if SPLIT_TOKENS > 0:
        per_split = SPLIT_TOKENS
    else:
        per_split = tl.cdiv(tl.cdiv(ctx - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    if SPLIT_TOKENS > 0:
        if (split > 0) & (start >= ctx):
            return
    end = tl.minimum(start + per_split, ctx)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD)
    g_mask = g < GROUP
    heads = kvh * GROUP + g
    row = (q_row0 + b).to(tl.int64)
    q_rows = _head_rows(q_ptr, row, heads, d, stride_qt, stride_qh)
    q = tl.load(q_rows, mask=g_mask[:, None], other=0.0)

    # an fp8 cache: K's scale goes into the scores' scale here, V's into the output (_v_scaled)
    scale_log2e, m_i, l_i, acc, table, k_ptr, v_ptr = _attend_begin(
        scale_log2e, kv_scale_ptr, block_tables_ptr, seq, stride_bt, k_cache_ptr, v_cache_ptr,
        kvh, stride_ch, BLOCK_G, HEAD, QUANT,
    )  # fmt: skip
    q_up = l_i  # Q_FP8 only: each row's 2^e (a placeholder otherwise, never read)
    if WIDEN_F16:  # fp8 cache, bf16 query: fp16 operands (K/V tiles and P follow q in _attend_tile)
        q, scale_log2e = _fp16_query(q, scale_log2e)
    if Q_FP8:  # e4m3 cache, bf16 query: q . k on fp8 tensor cores, P . V in fp16
        q, q_up = _fp8_query(q)
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, g, k_ptr, v_ptr, table, start, full_end, end, scale_log2e,
        stride_cp, stride_cs, PAGE_SIZE, BLOCK_N, HEAD, 0, DOT_PRECISION, UPCAST, q_up, Q_FP8,
    )  # fmt: skip
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, g, k_ptr, v_ptr, table, full_end, end, end, scale_log2e,
        stride_cp, stride_cs, PAGE_SIZE, BLOCK_N, HEAD, 1, DOT_PRECISION, UPCAST, q_up, Q_FP8,
    )  # fmt: skip
    acc = _v_scaled(acc, kv_scale_ptr, QUANT)
    _pdl.launch_dependents(PDL)

    if NUM_SPLITS == 1 and SHARE_SPLITS == 0:
        o = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(
            _head_rows(out_ptr, row, heads, d, stride_ot, stride_oh),
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None],
        )
    else:
        # partial state of (decode b, query head, split): o [D] (not for an empty split: the
        # merge skips it), then m and l
        slots = (b * (GROUP * tl.num_programs(1)) + heads).to(tl.int64) * (
            NUM_SPLITS + SHARE_SPLITS
        )
        part = slots + split
        if SHARE_SPLITS > 0:
            if (split == 0) & (first == 0):  # in no group: the shared slots hold no keys
                for i in tl.static_range(SHARE_SPLITS):
                    empty = slots + NUM_SPLITS + i
                    tl.store(
                        part_ml_ptr + empty * 2,
                        tl.full([BLOCK_G], float("-inf"), tl.float32),
                        mask=g_mask,
                    )
                    tl.store(
                        part_ml_ptr + empty * 2 + 1, tl.zeros([BLOCK_G], tl.float32), mask=g_mask
                    )
        if MERGE_LAST:  # an empty split writes its o too (zeros): the merge loads o unmasked
            o_mask = g_mask[:, None]
        else:
            o_mask = (g_mask & (l_i > 0))[:, None]
        tl.store(part_o_ptr + part[:, None] * HEAD + d[None, :], acc, mask=o_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)
        if MERGE_LAST:
            # every thread's partial stores before the one thread's release (module docstring)
            tl.debug_barrier()
            counter = counters_ptr + b * tl.num_programs(1) + kvh
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_SPLITS - 1:  # the last of the splits: every partial is visible
                tl.debug_barrier()  # the acquire (one thread) before every thread's loads
                _merge_splits(
                    out_ptr, part_o_ptr, part_ml_ptr, b, kvh, row, stride_ot, stride_oh,
                    GROUP, MERGE_G, HEAD, NUM_SPLITS,
                )  # fmt: skip
                tl.store(counter, 0)  # zero again for the next launch (or graph replay)


@triton.jit
def _merge_splits(
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    b,
    kvh,
    row,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    MERGE_G: tl.constexpr,
    HEAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """The split partials of the ``GROUP`` query heads of (decode ``b``, KV head ``kvh``) merged into ``out``.

    What :func:`_decode_reduce_kernel` computes for one query head, for the
    group's heads at once (``MERGE_G`` rows, the group padded to a power of
    two), split after split in split order: ``m_max``, the largest ``m``,
    then the denominator ``sum_s 2^(m_s - m_max) l_s`` and
    ``sum_s 2^(m_s - m_max) o_s``. Every per-split value is a ``[MERGE_G, 1]``
    column broadcast over the ``[MERGE_G, HEAD]`` tile, so nothing changes
    layout between splits (no shared-memory round trip, no barrier: each
    split's loads wait for no other split's, the loops are unrolled). Every
    load bypasses L1 (``.cg``): the partials come from L2, where the other
    programs' stores are. The split order, not the arrival order, fixes the
    sums: the output does not depend on which program merges.
    """
    g = tl.arange(0, MERGE_G)
    g_mask = g < GROUP
    d = tl.arange(0, HEAD)
    heads = kvh * GROUP + g
    base = ((b * (GROUP * tl.num_programs(1)) + heads).to(tl.int64) * NUM_SPLITS)[:, None]
    rows = g_mask[:, None]
    m_max = tl.full([MERGE_G, 1], float("-inf"), tl.float32)
    for i in tl.static_range(NUM_SPLITS):
        m_s = tl.load(
            part_ml_ptr + (base + i) * 2, mask=rows, other=float("-inf"), cache_modifier=".cg"
        )
        m_max = tl.maximum(m_max, m_s)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a padding row with no keys: output 0
    denom = tl.zeros([MERGE_G, 1], tl.float32)
    acc = tl.zeros([MERGE_G, HEAD], tl.float32)
    for i in tl.static_range(NUM_SPLITS):
        ml = part_ml_ptr + (base + i) * 2
        w = tl.exp2(tl.load(ml, mask=rows, other=float("-inf"), cache_modifier=".cg") - m_max)
        denom += w * tl.load(ml + 1, mask=rows, other=0.0, cache_modifier=".cg")
        o_s = tl.load(
            part_o_ptr + (base + i) * HEAD + d[None, :], mask=rows, other=0.0, cache_modifier=".cg"
        )
        acc += o_s * w
    o = acc / tl.maximum(denom, 1e-30)
    tl.store(
        _head_rows(out_ptr, row, heads, d, stride_ot, stride_oh),
        o.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None],
    )


@triton.jit(do_not_specialize=["q_row0", "seq0"])
def _decode_reduce_kernel(
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    context_lens_ptr,
    q_row0,
    seq0,
    stride_ot,
    stride_oh,
    HEAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr = 0,
):
    _pdl.wait(PDL)  # the decode kernel's partials
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD)
    s_mask = s < NUM_SPLITS
    if SPLIT_TOKENS > 0:  # the splits past the context exited without writing: not read
        ctx = tl.load(context_lens_ptr + (seq0 + b).to(tl.int64))
        s_mask = s_mask & (s < tl.maximum(tl.cdiv(ctx, SPLIT_TOKENS), 1))
    part = (b * tl.num_programs(1) + h).to(tl.int64) * NUM_SPLITS + s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a padding row with no keys: output 0
    w = tl.exp2(m - m_max)
    denom = tl.maximum(tl.sum(w * l_s, axis=0), 1e-30)
    o_mask = (s_mask & (l_s > 0))[:, None]  # an empty split wrote no o
    o = tl.load(part_o_ptr + part[:, None] * HEAD + d[None, :], mask=o_mask, other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / denom
    _pdl.launch_dependents(PDL)
    row = (q_row0 + b).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


# stride_bt (the step's block-table width) changes from step to step: see _decode_kernel
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    cu_query_lens_ptr,
    out_ptr,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
    WIDEN_F16: tl.constexpr,
    Q_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl.wait(PDL)  # before the early return too: every program waits (pdl.py: the chain)
    kvh = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)  # the longest rows first
    seq = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cu_query_lens_ptr + seq)
    q_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
    if mb * BLOCK_Q >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len  # keys already cached before this step's tokens

    # row r: token mb * BLOCK_Q + r // GROUP of the sequence, query head kvh * GROUP + r % GROUP
    r = tl.arange(0, BLOCK_M)
    tok = mb * BLOCK_Q + r // GROUP
    head = kvh * GROUP + r % GROUP
    r_mask = (r < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = prefix + tok
    d = tl.arange(0, HEAD)
    rows = (q_start + tok).to(tl.int64)
    q_rows = _head_rows(q_ptr, rows[:, None], head, d, stride_qt, stride_qh)
    q = tl.load(q_rows, mask=r_mask[:, None], other=0.0)

    # an fp8 cache: K's scale goes into the scores' scale here, V's into the output (_v_scaled)
    scale_log2e, m_i, l_i, acc, table, k_ptr, v_ptr = _attend_begin(
        scale_log2e, kv_scale_ptr, block_tables_ptr, seq, stride_bt, k_cache_ptr, v_cache_ptr,
        kvh, stride_ch, BLOCK_M, HEAD, QUANT,
    )  # fmt: skip
    q_up = l_i  # Q_FP8 only: each row's 2^e (a placeholder otherwise, never read)
    if WIDEN_F16:  # fp8 cache, bf16 query: fp16 operands (K/V tiles and P follow q in _attend_tile)
        q, scale_log2e = _fp16_query(q, scale_log2e)
    if Q_FP8:  # e4m3 cache, bf16 query: q . k on fp8 tensor cores, P . V in fp16
        q, q_up = _fp8_query(q)

    # keys every row of the block sees: up to the block's first query position
    first_pos = prefix + mb * BLOCK_Q
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table, 0, full_end, ctx, scale_log2e,
        stride_cp, stride_cs, PAGE_SIZE, BLOCK_N, HEAD, 0, DOT_PRECISION, UPCAST, q_up, Q_FP8,
    )  # fmt: skip
    # the diagonal, up to the block's last query position; tiles above it are skipped
    diag_end = prefix + tl.minimum(q_len, (mb + 1) * BLOCK_Q)
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table, full_end, diag_end, diag_end, scale_log2e,
        stride_cp, stride_cs, PAGE_SIZE, BLOCK_N, HEAD, 2, DOT_PRECISION, UPCAST, q_up, Q_FP8,
    )  # fmt: skip
    acc = _v_scaled(acc, kv_scale_ptr, QUANT)
    _pdl.launch_dependents(PDL)

    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(
        _head_rows(out_ptr, rows[:, None], head, d, stride_ot, stride_oh),
        o.to(out_ptr.dtype.element_ty),
        mask=r_mask[:, None],
    )


def _row_strides(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor
) -> tuple[int, ...]:
    """The strides both kernels take, in their order: ``stride_qt`` ... ``stride_oh``."""
    return (
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
    )


class PagedAttention:
    """Launches the prefill and decode kernels for one step's mixed batch.

    Tile shapes come from :func:`prefill_tiles` / :func:`decode_tiles` at the
    first call of each head size and GQA ratio (or from ``prefill``/``decode``,
    which the tuning sweep passes). The split count is fixed at construction
    from the device and ``max_context`` (the configured ``max_model_len``), so
    that a decode launch's grid depends only on its batch size. ``fp8_widen``:
    how bf16 queries meet an fp8 cache, ``"fp16"`` or ``"query"``;
    ``decode_merge``: how a split decode's partials are merged, ``"separate"``
    (a second kernel) or ``"last-program"`` (inside the decode launch, by the
    split that finishes last; it owns :attr:`decode_counters`). Both in the
    module docstring. ``decode_tile_rule``: ``"fixed"`` (one tile per head size)
    or ``"by-batch"`` (the decode sweep's best tiles for the launch's batch and
    cache dtype: :data:`WIDE_BATCH_TILES`, :data:`FP8_DECODE_TILES`). ``pdl``:
    programmatic dependent launch of every kernel (``None``: where it works, :mod:`.pdl`).
    ``long_prefill``: where a step's prefills are all long, cuDNN's attention instead of the
    prefill kernel (:mod:`pitstop.plugins.kernels.cudnn_prefill`; None: never).
    ``prefix_share_tokens``: decodes that share at least this many tokens of cached pages read
    them once a group (:mod:`.prefix_share`; 0: never; not with the one-launch merge or
    ``qk-fp8``, which keep the plain decode). ``split_tokens``: a decode batch large enough
    for one split a sequence (:meth:`num_splits`) has its contexts cut into pieces of this
    many tokens instead (rounded up to the tile), ``cdiv(max_context, split_tokens)`` splits
    in the grid, those past a context's end exiting at once: every program's work is bounded,
    so a batch of ragged contexts does not wait on the SMs that drew its longest sequences
    (0: off; the separate merge only, no prefix share).
    """

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        max_context: int,
        precision: str = "fp32",
        num_sms: int | None = None,
        prefill: PrefillTiles | None = None,
        decode: DecodeTiles | None = None,
        split_waves: int = 4,
        min_split_tokens: int | None = None,
        fp8_widen: str = "fp16",
        decode_merge: str = "separate",
        decode_tile_rule: str = "fixed",
        pdl: bool | None = None,
        long_prefill: CudnnPrefill | None = None,
        prefix_share_tokens: int = 0,
        split_tokens: int = 0,
    ) -> None:
        self.long_prefill = long_prefill
        self.prefix_share_tokens = prefix_share_tokens
        if split_tokens < 0:
            raise ValueError(f"split_tokens must be >= 0 (0: off), not {split_tokens}")
        if split_tokens and (decode_merge == "last-program" or prefix_share_tokens):
            raise ValueError(
                "split_tokens splits large decode batches into pieces of a fixed length, merged "
                "by the separate reduce kernel: not with decode_merge='last-program' or a "
                "prefix share; leave one of them at its default"
            )
        # large batches' decode contexts in pieces of this many tokens (0: one split a sequence)
        self.split_tokens = split_tokens
        # (the step, whether made inside a CUDA-graph capture, its groups)
        self._share_step: tuple[AttentionMetadata, bool, prefix_share.ShareLayout] | None = None
        if decode_tile_rule not in DECODE_TILE_RULES:
            raise ValueError(
                f"decode_tile_rule must be one of {DECODE_TILE_RULES}, not {decode_tile_rule!r}"
            )
        self.decode_tile_rule = decode_tile_rule
        self.pdl = pdl
        if fp8_widen not in FP8_WIDEN:
            raise ValueError(f"fp8_widen must be one of {FP8_WIDEN}, not {fp8_widen!r}")
        if decode_merge not in DECODE_MERGE:
            raise ValueError(f"decode_merge must be one of {DECODE_MERGE}, not {decode_merge!r}")
        self.decode_merge = decode_merge
        self.device, self.dtype, self.max_context = device, dtype, max_context
        self.fp8_widen = fp8_widen
        # input_precision matters for float32 inputs only: IEEE fp32, or TF32 tensor cores when "fast"
        self.dot_precision = "ieee" if precision == "fp32" and dtype == torch.float32 else "tf32"
        self.on_gpu = device.type == "cuda"
        # Triton 3.9's interpreter multiplies bf16 operands of tl.dot as raw 16-bit integers:
        # on CPU, products run on float32 copies (exact products, float32 sums: the same math).
        self.upcast_dot = not self.on_gpu and dtype == torch.bfloat16
        if num_sms is None:
            num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count if self.on_gpu else 4
            )
        self.num_sms = num_sms
        self._prefill_override, self._decode_override = prefill, decode
        # decode splits: up to split_waves programs per SM, at most max_context / min_split_tokens
        # (H200 sweeps of split counts, timed from CUDA graphs: batch 8 and 32 were fastest at 8
        # and 2 splits, i.e. ~512 programs, 64 x 2,048 at 1; batch 1 at 32 splits for context
        # 4,096 and 64 for 32,768, and 1 x 128 lost only 0.5 us at 32 splits against 1)
        self.split_waves = split_waves
        self.min_split_tokens = min_split_tokens or (128 if self.on_gpu else 16)
        # decode_merge="last-program": one arrival counter per (decode, KV head), zeroed here
        # once and zero again after every launch (its last program resets it). num_splits() > 1
        # needs num_decodes * num_kv_heads <= split_waves * num_sms / 2, so this many always
        # suffice for the engine's split counts (a forced count may need more: _counters()).
        self.decode_counters: torch.Tensor | None = None
        self._retired_counters: list[torch.Tensor | None] = []
        if decode_merge == "last-program":
            self.decode_counters = torch.zeros(
                max(1, split_waves * num_sms), dtype=torch.int32, device=device
            )

    def prefill_tiles(self, head_size: int, group: int, max_query_len: int) -> PrefillTiles:
        """The prefill tiles of this call; short queries (drafts, small chunks) take fewer rows."""
        tiles = self._prefill_override or (
            prefill_tiles(head_size, group, self.dtype) if self.on_gpu else INTERPRETER_PREFILL
        )
        rows = max(16, next_power_of_2(max_query_len * group))
        if rows < tiles.block_m:  # one tile of rows holds every query: no row tile left idle
            tiles = tiles._replace(block_m=rows, num_warps=min(tiles.num_warps, 4))
        return tiles

    def decode_tiles(
        self, head_size: int, group: int, num_decodes: int = 1, fp8: bool = False
    ) -> DecodeTiles:
        """The decode tiles for this head size and GQA ratio (and, under the ``by-batch``
        rule, the launch's number of decodes and whether the cache is fp8)."""
        if self._decode_override is not None:
            return self._decode_override
        if not self.on_gpu:
            return INTERPRETER_DECODE
        tiles = decode_tiles(head_size, group, self.dtype)
        if self.decode_tile_rule == "fixed" or tiles != DECODE_TILES.get(head_size):
            return tiles  # float32, an unswept head size or a large group: the fixed rule
        if num_decodes >= WIDE_BATCH_DECODE:
            return WIDE_BATCH_TILES
        return FP8_DECODE_TILES if fp8 else tiles

    def widen_f16(
        self, q: torch.Tensor, kv_scale: torch.Tensor | None, k_cache: torch.Tensor | None = None
    ) -> bool:
        """Whether this launch widens fp8 K/V to fp16 (an fp8 cache, bf16 queries,
        ``fp8_widen="fp16"``, or ``"qk-fp8"`` over an e5m2 cache, which it does not take)."""
        if kv_scale is None or q.dtype != torch.bfloat16:
            return False
        return self.fp8_widen == "fp16" or (
            self.fp8_widen == "qk-fp8" and not self.query_fp8(q, kv_scale, k_cache)
        )

    def query_fp8(
        self, q: torch.Tensor, kv_scale: torch.Tensor | None, k_cache: torch.Tensor | None
    ) -> bool:
        """Whether this launch rounds the query to e4m3 for fp8 ``q . k`` (``fp8_widen="qk-fp8"``,
        bf16 queries, an e4m3 cache)."""
        return (
            self.fp8_widen == "qk-fp8"
            and kv_scale is not None
            and q.dtype == torch.bfloat16
            and k_cache is not None
            and k_cache.dtype == torch.float8_e4m3fn
        )

    def reset_decode_counters(self) -> None:
        """Zero the arrival counters of ``decode_merge="last-program"`` (not inside a capture).

        Every completed launch leaves them zero; only a launch that never
        finished (a device fault, after which CUDA needs a new context anyway)
        could leave a count behind, and the next launch would then merge early
        and wrong. Call this after recovering from such an error.
        """
        if self.decode_counters is not None:
            self.decode_counters.zero_()

    def _counters(self, pairs: int) -> torch.Tensor:
        """The arrival counters, at least ``pairs`` of them (grown, zeroed, outside a capture)."""
        counters = self.decode_counters
        assert counters is not None
        if pairs > counters.numel():
            if self.on_gpu and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"decode_merge='last-program': {pairs} (decode, KV head) pairs need more "
                    f"counters than the {counters.numel()} allocated; run this batch size "
                    "once before capturing it"
                )
            counters = torch.zeros(
                next_power_of_2(pairs), dtype=torch.int32, device=counters.device
            )
            # a graph captured earlier still points at the old ones: they stay allocated
            self._retired_counters.append(self.decode_counters)
            self.decode_counters = counters
        return counters

    def num_splits(self, num_decodes: int, num_kv_heads: int) -> int:
        """Context splits per decode sequence: up to ``split_waves`` programs per SM.

        Depends only on the batch size (and constants fixed at construction),
        so a captured CUDA graph's grid stays valid for every context length;
        a split past a shorter context's end only writes an empty state.
        """
        programs = max(1, num_decodes * num_kv_heads)
        want = self.split_waves * self.num_sms // programs
        cap = max(1, cdiv(self.max_context, self.min_split_tokens))
        splits = max(1, min(want, cap, 64))
        # a power of two: at most 7 compiled variants of the kernels across all batch sizes
        return 1 << (splits.bit_length() - 1)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of q ``[T, Hq, D]`` over the paged cache; returns a fresh ``[T, Hq, D]``.

        An fp8 cache needs ``kv_scale`` (float32 ``[2]``: K's scale, then V's).
        """
        t, hq, d = q.shape
        hkv = k_cache.shape[2]
        assert hq % hkv == 0 and k_cache.shape[3] == d and k_cache.stride() == v_cache.stride()
        if k_cache.element_size() == 1:
            assert kv_scale is not None and kv_scale.dtype == torch.float32, "fp8 cache: kv_scale"
        else:
            kv_scale = None
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
        scale_log2e = scale * LOG2E
        if meta.num_prefills and not (
            self.long_prefill is not None
            and kv_scale is None
            and self.long_prefill.attend(q, k_cache, v_cache, meta, scale, out)
        ):
            self.prefill(q, k_cache, v_cache, meta, scale_log2e, out, hkv, kv_scale)
        if meta.num_decodes:
            self.decode(q, k_cache, v_cache, meta, scale_log2e, out, hkv, kv_scale)
        return out

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale_log2e: float,
        out: torch.Tensor,
        hkv: int,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        """Causal attention of the batch's first ``num_prefills`` sequences (prompts, chunks, drafts) into ``out``."""
        _, hq, d = q.shape
        group = hq // hkv
        tiles = self.prefill_tiles(d, group, meta.max_query_len)
        block_q = tiles.block_m // group
        bt = meta.block_tables
        grid = (hkv, cdiv(meta.max_query_len, block_q), meta.num_prefills)
        use_pdl = _pdl.enabled(q.device, self.pdl)
        _prefill_kernel[grid](
            q,
            k_cache,
            v_cache,
            out if kv_scale is None else kv_scale,  # any pointer when the cache is not fp8
            bt,
            meta.context_lens,
            meta.cu_query_lens,
            out,
            scale_log2e,
            *_row_strides(q, k_cache, bt, out),
            GROUP=group,
            HEAD=d,
            PAGE_SIZE=meta.page_size,
            BLOCK_M=tiles.block_m,
            BLOCK_Q=block_q,
            BLOCK_N=tiles.block_n,
            DOT_PRECISION=self.dot_precision,
            UPCAST=self.upcast_dot,
            QUANT=kv_scale is not None,
            WIDEN_F16=self.widen_f16(q, kv_scale, k_cache),
            Q_FP8=self.query_fp8(q, kv_scale, k_cache),
            PDL=use_pdl,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            **_pdl.launch_kwargs(use_pdl),
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale_log2e: float,
        out: torch.Tensor,
        hkv: int,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        """Split-K decode of the batch's last ``num_decodes`` sequences (one query token each) into ``out``."""
        nd = meta.num_decodes
        _, hq, d = q.shape
        group = hq // hkv
        tiles = self.decode_tiles(d, group, nd, fp8=kv_scale is not None)
        splits = self.num_splits(nd, hkv)
        split_tokens = 0
        if splits == 1 and self.split_tokens:  # a large batch: pieces of a fixed length
            split_tokens = cdiv(self.split_tokens, tiles.block_n) * tiles.block_n
            splits = max(1, cdiv(self.max_context, split_tokens))
            split_tokens = split_tokens if splits > 1 else 0
        bt = meta.block_tables
        share = self._share_layout(q, kv_scale, k_cache, meta, group, tiles)
        slots = splits + (share.splits if share is not None else 0)
        merge_last = splits > 1 and self.decode_merge == "last-program" and share is None
        if slots > 1:
            part_o = torch.empty((nd, hq, slots, d), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((nd, hq, slots, 2), dtype=torch.float32, device=q.device)
        else:
            part_o = part_ml = out  # unused
        if merge_last:
            assert splits & (splits - 1) == 0, (
                f"last-program merge: {splits} splits, not a power of 2"
            )
            counters = self._counters(nd * hkv)
        else:
            counters = out  # unused
        use_pdl = _pdl.enabled(q.device, self.pdl)
        switches = dict(
            DOT_PRECISION=self.dot_precision,
            UPCAST=self.upcast_dot,
            QUANT=kv_scale is not None,
            WIDEN_F16=self.widen_f16(q, kv_scale, k_cache),
            PDL=use_pdl,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            **_pdl.launch_kwargs(use_pdl),
        )
        if share is not None:
            prefix_share.shared_pass(
                q, k_cache, v_cache, kv_scale, bt, share, part_o, part_ml, scale_log2e,
                meta.num_prefill_tokens, meta.num_prefills, splits, tiles.block_n, switches,
            )  # fmt: skip
        _decode_kernel[(nd, hkv, splits)](
            q,
            k_cache,
            v_cache,
            out if kv_scale is None else kv_scale,  # any pointer when the cache is not fp8
            bt,
            meta.context_lens,
            out,
            part_o,
            part_ml,
            counters,
            share.start if share is not None else out,  # unused without a shared pass
            scale_log2e,
            meta.num_prefill_tokens,
            meta.num_prefills,
            *_row_strides(q, k_cache, bt, out),
            GROUP=group,
            BLOCK_G=max(16, next_power_of_2(group)),
            HEAD=d,
            PAGE_SIZE=meta.page_size,
            BLOCK_N=tiles.block_n,
            NUM_SPLITS=splits,
            Q_FP8=self.query_fp8(q, kv_scale, k_cache),
            MERGE_LAST=merge_last,
            MERGE_G=next_power_of_2(group) if merge_last else 1,
            SHARE_SPLITS=slots - splits,
            SPLIT_TOKENS=split_tokens,
            **switches,
        )
        if slots > 1 and not merge_last:
            _decode_reduce_kernel[(nd, hq)](
                out,
                part_o,
                part_ml,
                meta.context_lens,
                meta.num_prefill_tokens,
                meta.num_prefills,
                out.stride(0),
                out.stride(1),
                HEAD=d,
                NUM_SPLITS=slots,
                BLOCK_S=next_power_of_2(slots),
                PDL=use_pdl,
                SPLIT_TOKENS=split_tokens,
                num_warps=4,
                **_pdl.launch_kwargs(use_pdl),
            )

    def _share_layout(
        self,
        q: torch.Tensor,
        kv_scale: torch.Tensor | None,
        k_cache: torch.Tensor,
        meta: AttentionMetadata,
        group: int,
        tiles: DecodeTiles,
    ) -> prefix_share.ShareLayout | None:
        """This step's decode groups (:func:`.prefix_share.group_decodes`), made at the step's
        first call and kept for its other layers (the same ``meta``); None where the shared
        pass does not apply (off, fewer than two decodes, the one-launch merge, ``qk-fp8``, a
        group too large for a tile)."""
        if self.prefix_share_tokens <= 0:  # off (the default): nothing else to ask
            return None
        members = prefix_share.max_members(group)
        if (
            meta.num_decodes < 2
            or members < 2
            or self.decode_merge == "last-program"
            or self.query_fp8(q, kv_scale, k_cache)
        ):
            return None
        # made at the step's first layer and kept for the others; a capture makes its own (a
        # layout made before it would not be in the graph, so replays would not regroup)
        capturing = self.on_gpu and torch.cuda.is_current_stream_capturing()
        made = self._share_step
        if made is not None and made[0] is meta and made[1] == capturing:
            return made[2]
        layout = prefix_share.group_decodes(
            meta.block_tables,
            meta.context_lens,
            meta.num_prefills,
            meta.num_decodes,
            meta.page_size,
            self.prefix_share_tokens,
            members,
            max(meta.page_size, tiles.block_n),
            prefix_share.share_splits(self.max_context, self.prefix_share_tokens),
        )
        self._share_step = (meta, capturing, layout)
        return layout
