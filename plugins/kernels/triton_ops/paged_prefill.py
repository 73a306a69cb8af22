"""Paged prefill attention: GQA-packed varlen causal attention over the paged cache.

The launcher is :meth:`.paged_attention.PagedAttention.prefill`; the loop over key tiles is
:func:`.attend._attend`, shared with the decode kernel.

Prefill (sequences computing several tokens, prefills first in the batch):
    grid ``(Hkv, cdiv(max_query_len, BLOCK_Q), num_prefills)``, the
    query blocks in reverse so that the longest (last) rows start first. Keys
    below a block's first query position are visible to every row and need no
    mask; the diagonal tiles get the causal mask; tiles above the diagonal are
    skipped.
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

    # an fp8 cache: K's scale goes into the scores' scale here, V's into the output (_v_scaled);
    # its bf16 query as fp16 operands (WIDEN_F16: K/V tiles and P follow q in _attend_tile) or
    # e4m3 rows (Q_FP8: q . k on fp8 tensor cores, P . V in fp16), each row's 2^e in q_up
    q, q_up, scale_log2e, m_i, l_i, acc, table, k_ptr, v_ptr = _attend_begin(
        q, scale_log2e, kv_scale_ptr, block_tables_ptr, seq, stride_bt, k_cache_ptr, v_cache_ptr,
        kvh, stride_ch, BLOCK_M, HEAD, QUANT, WIDEN_F16, Q_FP8,
    )  # fmt: skip

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
