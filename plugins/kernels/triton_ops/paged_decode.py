"""Paged decode attention: one query token a sequence, its context in splits, merged.

The launcher is :meth:`.paged_attention.PagedAttention.decode`; the loop over key tiles is
:func:`.attend._attend`, shared with the prefill kernel.

Decode (sequences computing one token):
    grid ``(num_decodes, Hkv, num_splits)``: the group's heads are the rows of
    one tile (padded to 16), the context is cut into ``num_splits`` equal
    parts per sequence (computed on the device from its context length) and
    a second small kernel merges the parts' partial softmax states.
    ``num_splits`` depends only on the batch size and the configured maximum
    context (never on this step's lengths), so the grid is fixed for a fixed
    batch size and the launch can be captured in a CUDA graph.

Pieces of a fixed length (``PagedAttention(split_tokens=...)``, ``SPLIT_TOKENS``): where
the batch rule gives one split a sequence (large batches), each context is cut into
pieces of ``SPLIT_TOKENS`` tokens instead, ``cdiv(max_context, SPLIT_TOKENS)`` splits in
the grid. A piece past its context's end exits before reading anything (split 0 always
runs, so a padding row still writes its empty state) and the reduce kernel merges only
the ``cdiv(context, SPLIT_TOKENS)`` pieces a context reaches, so unwritten partials are
never read. Every program's work is then bounded whatever its sequence's length.

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
"""

from __future__ import annotations

import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops.attend import (
    _attend,
    _attend_begin,
    _head_rows,
    _v_scaled,
)


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

    # an fp8 cache: K's scale goes into the scores' scale here, V's into the output (_v_scaled);
    # its bf16 query as fp16 operands (WIDEN_F16: K/V tiles and P follow q in _attend_tile) or
    # e4m3 rows (Q_FP8: q . k on fp8 tensor cores, P . V in fp16), each row's 2^e in q_up
    q, q_up, scale_log2e, m_i, l_i, acc, table, k_ptr, v_ptr = _attend_begin(
        q, scale_log2e, kv_scale_ptr, block_tables_ptr, seq, stride_bt, k_cache_ptr, v_cache_ptr,
        kvh, stride_ch, BLOCK_G, HEAD, QUANT, WIDEN_F16, Q_FP8,
    )  # fmt: skip
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
