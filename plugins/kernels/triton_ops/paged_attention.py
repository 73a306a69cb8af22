"""Paged attention over the KV cache: decode (flash-decoding) and varlen causal prefill.

The cache is ``[num_pages, page_size, Hkv, D]`` for K and for V; a sequence's
token ``n`` lives at page ``block_tables[seq, n // page_size]``, offset
``n % page_size``. Every tile of keys is gathered token by token through the
block table, so any ``page_size`` works and a cached prefix (prefix caching,
chunked prefill) is read in place.

Decode (sequences computing one token):
    grid ``(num_decodes, Hkv, num_splits)``. One program handles *all* query
    heads of one KV head (the GQA group, padded to 16 rows for ``tl.dot``),
    so each K/V page is read once per KV head; the context is cut into
    ``num_splits`` equal parts per sequence (computed on the device from its
    context length) and a second small kernel merges the parts' partial
    softmax states. ``num_splits`` depends only on the batch size and the
    configured maximum context (never on this step's lengths), so the grid is
    fixed for a fixed batch size and the launch can be captured in a CUDA graph.

Prefill (sequences computing several tokens, prefills first in the batch):
    grid ``(cdiv(max_query_len, BLOCK_M), Hq, num_prefills)``. FlashAttention-2
    style: one program holds ``BLOCK_M`` query rows of one head, loops over key
    tiles with an online softmax in float32; the keys below the block's first
    query position need no mask, only the last tiles (the diagonal) do.

Scores are kept in the log2 domain (q·k times ``scale * log2(e)`` in float32) so
the softmax uses ``exp2``. Accumulation is float32. ``precision="fp32"`` runs
float32 inputs' matrix products in IEEE fp32; ``"fast"`` lets them use TF32
(for bf16/fp16 inputs the products are on the tensor cores either way, the
probabilities rounded to the input dtype before P·V as every flash kernel does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pitstop.attention import AttentionMetadata

LOG2E = 1.4426950408889634


@triton.jit
def _mma(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in float32 (``UPCAST``: both operands in float32 first)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


# q_row0 and seq0 change every mixed step: not specializing on them (== 1, % 16)
# keeps one compiled variant per split count instead of up to nine.
@triton.jit(do_not_specialize=["q_row0", "seq0"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
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
    page_size,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = (seq0 + b).to(tl.int64)
    ctx = tl.load(context_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD)
    g_mask = g < GROUP
    heads = kvh * GROUP + g
    row = (q_row0 + b).to(tl.int64)
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        page = tl.load(table + n // page_size, mask=n_mask, other=0).to(tl.int64)
        offs = (page * stride_cp + (n % page_size) * stride_cs + kvh * stride_ch)[:, None] + d[
            None, :
        ]
        k = tl.load(k_cache_ptr + offs, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=n_mask[:, None], other=0.0)
        s = _mma(q, tl.trans(k.to(q.dtype)), DOT_PRECISION, UPCAST) * scale_log2e
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(
            out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None],
        )
    else:
        # partial state of (decode b, query head, split): o [D], then m and l
        part = (b * (GROUP * tl.num_programs(1)) + heads).to(tl.int64) * NUM_SPLITS + split
        tl.store(part_o_ptr + part[:, None] * HEAD + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)


@triton.jit(do_not_specialize=["q_row0"])
def _decode_reduce_kernel(
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    q_row0,
    stride_ot,
    stride_oh,
    HEAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD)
    s_mask = s < NUM_SPLITS
    part = (b * tl.num_programs(1) + h).to(tl.int64) * NUM_SPLITS + s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a padding row with no keys: output 0
    w = tl.exp2(m - m_max)
    denom = tl.maximum(tl.sum(w * l_s, axis=0), 1e-30)
    o = tl.load(part_o_ptr + part[:, None] * HEAD + d[None, :], mask=s_mask[:, None], other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / denom
    row = (q_row0 + b).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
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
    page_size,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cu_query_lens_ptr + seq)
    q_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len  # keys already cached before this step's tokens
    kvh = h // GROUP

    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = r < q_len
    q_pos = prefix + r
    d = tl.arange(0, HEAD)
    rows = (q_start + r).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=r_mask[:, None],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt

    # keys every row of the block sees: below the block's first query position
    full_end = ((prefix + mb * BLOCK_M) // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        page = tl.load(table + n // page_size).to(tl.int64)
        offs = (page * stride_cp + (n % page_size) * stride_cs + kvh * stride_ch)[:, None] + d[
            None, :
        ]
        k = tl.load(k_cache_ptr + offs)
        s = _mma(q, tl.trans(k.to(q.dtype)), DOT_PRECISION, UPCAST) * scale_log2e
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + offs)
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new

    # the diagonal: causal mask, and the end of the context
    diag_end = tl.minimum(ctx, prefix + (mb + 1) * BLOCK_M)
    for n0 in range(full_end, diag_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < diag_end
        page = tl.load(table + n // page_size, mask=n_mask, other=0).to(tl.int64)
        offs = (page * stride_cp + (n % page_size) * stride_cs + kvh * stride_ch)[:, None] + d[
            None, :
        ]
        k = tl.load(k_cache_ptr + offs, mask=n_mask[:, None], other=0.0)
        s = _mma(q, tl.trans(k.to(q.dtype)), DOT_PRECISION, UPCAST) * scale_log2e
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + offs, mask=n_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new

    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=r_mask[:, None],
    )


class PagedAttention:
    """Launches the prefill and decode kernels for one step's mixed batch.

    Tile sizes and the split count are fixed at construction from the device,
    the dtype and ``max_context`` (the configured ``max_model_len``), so that a
    decode launch's grid depends only on its batch size.
    """

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        max_context: int,
        precision: str = "fp32",
        num_sms: int | None = None,
    ) -> None:
        self.device, self.dtype, self.max_context = device, dtype, max_context
        # input_precision matters for float32 inputs only: IEEE fp32, or TF32 tensor cores when "fast"
        self.dot_precision = "ieee" if precision == "fp32" and dtype == torch.float32 else "tf32"
        on_gpu = device.type == "cuda"
        # Triton 3.9's interpreter multiplies bf16 operands of tl.dot as raw 16-bit integers:
        # on CPU, products run on float32 copies (exact products, float32 sums: the same math).
        self.upcast_dot = not on_gpu and dtype == torch.bfloat16
        if num_sms is None:
            num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 4
            )
        self.num_sms = num_sms
        wide = dtype != torch.float32
        if on_gpu:
            self.decode_block_n = 64 if wide else 32
            self.prefill_block_m, self.prefill_block_n = (128, 64) if wide else (64, 32)
            self.prefill_warps, self.prefill_stages = (4, 3) if wide else (4, 2)
            self.decode_warps, self.decode_stages = 4, 3 if wide else 2
        else:  # the interpreter: small tiles so that small test shapes still cross tile borders
            self.decode_block_n = 16
            self.prefill_block_m, self.prefill_block_n = 16, 16
            self.prefill_warps = self.prefill_stages = self.decode_warps = self.decode_stages = 1
        # the fewest tokens worth a split of their own
        self.min_split_tokens = 256 if on_gpu else 16

    def num_splits(self, num_decodes: int, num_kv_heads: int) -> int:
        """Context splits per decode sequence: ~2 waves of programs, no split under ``min_split_tokens``.

        Depends only on the batch size (and constants fixed at construction),
        so a captured CUDA graph's grid stays valid for every context length.
        """
        programs = max(1, num_decodes * num_kv_heads)
        want = triton.cdiv(2 * self.num_sms, programs)
        cap = max(1, triton.cdiv(self.max_context, self.min_split_tokens))
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
    ) -> torch.Tensor:
        """Causal attention of q ``[T, Hq, D]`` over the paged cache; returns a fresh ``[T, Hq, D]``."""
        t, hq, d = q.shape
        hkv = k_cache.shape[2]
        assert hq % hkv == 0 and k_cache.shape[3] == d and k_cache.stride() == v_cache.stride()
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
        group = hq // hkv
        scale_log2e = scale * LOG2E
        bt = meta.block_tables
        if meta.num_prefills:
            grid = (triton.cdiv(meta.max_query_len, self.prefill_block_m), hq, meta.num_prefills)
            _prefill_kernel[grid](
                q,
                k_cache,
                v_cache,
                bt,
                meta.context_lens,
                meta.cu_query_lens,
                out,
                scale_log2e,
                q.stride(0),
                q.stride(1),
                k_cache.stride(0),
                k_cache.stride(1),
                k_cache.stride(2),
                bt.stride(0),
                out.stride(0),
                out.stride(1),
                meta.page_size,
                GROUP=group,
                HEAD=d,
                BLOCK_M=self.prefill_block_m,
                BLOCK_N=self.prefill_block_n,
                DOT_PRECISION=self.dot_precision,
                UPCAST=self.upcast_dot,
                num_warps=self.prefill_warps,
                num_stages=self.prefill_stages,
            )
        if meta.num_decodes:
            self.decode(q, k_cache, v_cache, meta, scale_log2e, out, hkv)
        return out

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale_log2e: float,
        out: torch.Tensor,
        hkv: int,
    ) -> None:
        """Split-K decode of the batch's last ``num_decodes`` sequences (one query token each) into ``out``."""
        nd = meta.num_decodes
        _, hq, d = q.shape
        group = hq // hkv
        splits = self.num_splits(nd, hkv)
        bt = meta.block_tables
        if splits > 1:
            part_o = torch.empty((nd, hq, splits, d), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((nd, hq, splits, 2), dtype=torch.float32, device=q.device)
        else:
            part_o = part_ml = out  # unused
        _decode_kernel[(nd, hkv, splits)](
            q,
            k_cache,
            v_cache,
            bt,
            meta.context_lens,
            out,
            part_o,
            part_ml,
            scale_log2e,
            meta.num_prefill_tokens,
            meta.num_prefills,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            bt.stride(0),
            out.stride(0),
            out.stride(1),
            meta.page_size,
            GROUP=group,
            BLOCK_G=max(16, triton.next_power_of_2(group)),
            HEAD=d,
            BLOCK_N=self.decode_block_n,
            NUM_SPLITS=splits,
            DOT_PRECISION=self.dot_precision,
            UPCAST=self.upcast_dot,
            num_warps=self.decode_warps,
            num_stages=self.decode_stages,
        )
        if splits > 1:
            _decode_reduce_kernel[(nd, hq)](
                out,
                part_o,
                part_ml,
                meta.num_prefill_tokens,
                out.stride(0),
                out.stride(1),
                HEAD=d,
                NUM_SPLITS=splits,
                BLOCK_S=triton.next_power_of_2(splits),
                num_warps=4,
            )
