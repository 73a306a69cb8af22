"""The key loop that paged attention's kernels share: tiles of keys gathered through the
block table, ``q @ k^T`` and ``p @ v`` with an online softmax in the log2 domain.

:mod:`.paged_prefill`, :mod:`.paged_decode` (split-K decode) and :mod:`.prefix_share` (a
group's pass over shared prefix pages) all run :func:`_attend` from the query tile and state
:func:`_attend_begin` makes; :mod:`.paged_attention`'s docstring describes the tiles, the masks, GQA packing and
how fp8 caches are read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops.rope_store import _quantize


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` in float32 (``UPCAST``: both operands in float32 first)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _dot_acc(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` accumulated in place (float32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _powers_of_two(amax, BELOW: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr):
    """``(2^-e, 2^e)`` with ``e`` the exponent of ``amax`` (its bits: exact, no log2) minus
    ``BELOW``, clamped to ``[LO, HI]`` so that both are normal float32 numbers; so ``amax * 2^-e``
    lands in ``[2^BELOW, 2^(BELOW+1))`` (lower where the clamp bites, e.g. a zero ``amax``).
    Works on a scalar or elementwise on a vector of magnitudes."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - BELOW
    e = tl.minimum(tl.maximum(e, LO), HI)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e
    up = ((127 + e) << 23).to(tl.float32, bitcast=True)  # 2^e
    return down, up


@triton.jit
def _fp16_query(q, scale_log2e):
    """``(q * 2^-e in fp16, scale_log2e * 2^e)``: the query tile as fp16 operands (module docstring).

    ``e`` comes from the tile's largest magnitude, so that it lands in
    [2^14, 2^15), clamped to [-112, 113] (:func:`_powers_of_two`; an all-zero
    tile, e.g. padding rows only, stays zero).
    """
    qf = q.to(tl.float32)
    down, up = _powers_of_two(tl.max(tl.max(tl.abs(qf), axis=1), axis=0), 14, -112, 113)
    return (qf * down).to(tl.float16), scale_log2e * up


@triton.jit
def _fp8_query(q):
    """``(q_i * 2^-e_i in e4m3, 2^e_i)`` per row ``i``: the query tile as fp8 operands.

    ``e_i`` comes from row ``i``'s largest magnitude, so that it lands in
    [2^7, 2^8) (e4m3's largest finite value is 448), clamped to [-100, 100]
    (:func:`_powers_of_two`; an all-zero row, e.g. padding, stays zero). Each
    element is rounded to e4m3 (3 mantissa bits): this mode's one loss against
    the ``fp16`` one.
    """
    qf = q.to(tl.float32)
    down, up = _powers_of_two(tl.max(tl.abs(qf), axis=1), 7, -100, 100)
    # rounded on the float32 bits first (ties to even), so that the cast is exact: Triton's
    # interpreter rounds some values to fp8 wrongly (rope_store._quantize says which)
    rounded = _quantize(qf * down[:, None], 1.0, 448.0, 3, 0.015625)
    return rounded.to(tl.float8e4nv), up


@triton.jit
def _page_rows(
    table,
    n,
    key_end,
    stride_cp,
    stride_cs,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Element offsets of the key tokens ``n`` of one sequence in its pages.

    Each row's page comes from the block table (``PAGE_SIZE`` is a compile-time
    constant, so ``n // PAGE_SIZE`` and ``n % PAGE_SIZE`` are shifts and masks
    for powers of two); the rows of one page read the same entry and sit
    ``stride_cs`` apart, so a tile's K and V load as whole 16-byte vectors into
    the software pipeline's shared-memory buffers (measured on the H200: one
    scalar entry per tile, or one entry per page broadcast to its rows, stall
    that pipeline and run slower). ``MASKED``: rows at or past ``key_end`` read
    no entry (the table is -1 there) and take page 0; the caller masks their loads.
    """
    if MASKED:
        page = tl.load(table + n // PAGE_SIZE, mask=n < key_end, other=0)
    else:
        page = tl.load(table + n // PAGE_SIZE)
    return page.to(tl.int64) * stride_cp + (n % PAGE_SIZE) * stride_cs


@triton.jit
def _attend(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_ptr,
    v_ptr,
    table,
    start,
    end,
    key_end,
    scale_log2e,
    stride_cp,
    stride_cs,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD: tl.constexpr,
    MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    q_up,
    Q_FP8: tl.constexpr,
):
    """Online-softmax attention of the rows ``q`` over the keys ``start..end`` in tiles of ``BLOCK_N``.

    ``k_ptr``/``v_ptr`` point at the KV head's first element in the caches,
    ``table`` at the sequence's block-table row. ``MASK``: 0, every key of
    every tile is visible; 1, keys at or past ``key_end`` are not (the last
    tile of a context); 2, also causal: row ``i`` sees the keys ``<= q_pos[i]``
    (the diagonal). ``Q_FP8``: ``q`` is e4m3, row ``i`` scaled by ``2^-e_i``
    (:func:`_fp8_query`), ``q_up`` holds the ``2^e_i`` (otherwise unused).
    Returns the updated ``(acc, m_i, l_i)`` (log2 domain).
    """
    for n0 in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table, n0, key_end, scale_log2e,
            stride_cp, stride_cs, PAGE_SIZE, BLOCK_N, HEAD, MASK, DOT_PRECISION, UPCAST,
            q_up, Q_FP8,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_ptr,
    v_ptr,
    table,
    n0,
    key_end,
    scale_log2e,
    stride_cp,
    stride_cs,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD: tl.constexpr,
    MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    q_up,
    Q_FP8: tl.constexpr,
):
    """One key tile of :func:`_attend`."""
    n = n0 + tl.arange(0, BLOCK_N)
    rows = _page_rows(table, n, key_end, stride_cp, stride_cs, PAGE_SIZE, MASK != 0)
    offs = rows[:, None] + tl.arange(0, HEAD)[None, :]
    if MASK == 0:
        k = tl.load(k_ptr + offs)
    else:
        k = tl.load(k_ptr + offs, mask=(n < key_end)[:, None], other=0.0)
    s = _dot(q, tl.trans(k.to(q.dtype)), DOT_PRECISION, UPCAST)
    if Q_FP8:  # e4m3 q . e4m3 k on the fp8 tensor cores; each row's 2^e back (exact)
        s = s * q_up[:, None]
    if MASK == 0:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2e)
    else:
        if MASK == 1:
            visible = (n < key_end)[None, :]
        else:
            visible = (n[None, :] <= q_pos[:, None]) & (n < key_end)[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2e)
    p = tl.exp2(s * scale_log2e - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASK == 0:
        v = tl.load(v_ptr + offs)
    else:
        v = tl.load(v_ptr + offs, mask=(n < key_end)[:, None], other=0.0)
    if Q_FP8:  # P and V in fp16 (V widened as the "fp16" mode does): P keeps 11 bits
        acc = _dot_acc(
            p.to(tl.float16), v.to(tl.float16), acc * alpha[:, None], DOT_PRECISION, UPCAST
        )
    else:
        acc = _dot_acc(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], DOT_PRECISION, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _head_rows(ptr, tokens, heads, d, stride_t, stride_h):
    """Pointers ``[rows, D]`` to the heads ``heads`` of ``tokens`` in a ``[T, H, D]`` tensor.

    ``tokens`` is one token (every row's) or a column ``[rows, 1]`` (a token per row).
    """
    return ptr + tokens * stride_t + heads[:, None] * stride_h + d[None, :]


@triton.jit
def _attend_begin(
    q,
    scale_log2e,
    kv_scale_ptr,
    block_tables_ptr,
    seq,
    stride_bt,
    k_cache_ptr,
    v_cache_ptr,
    kvh,
    stride_ch,
    ROWS: tl.constexpr,
    HEAD: tl.constexpr,
    QUANT: tl.constexpr,
    WIDEN_F16: tl.constexpr,
    Q_FP8: tl.constexpr,
):
    """What every kernel starts :func:`_attend` from, for the ``ROWS`` query rows ``q`` of KV
    head ``kvh``.

    Returns ``(q, q_up, scale_log2e, m_i, l_i, acc, table, k_ptr, v_ptr)``: the query
    tile as :func:`_attend` takes it (``WIDEN_F16``, an fp8 cache under a bf16 query: fp16
    operands, :func:`_fp16_query`; ``Q_FP8``, an e4m3 cache: e4m3 rows and their ``2^e``
    in ``q_up``, :func:`_fp8_query`; else as given, ``q_up`` a placeholder never read), the
    softmax scale (with an fp8 cache's K scale, ``kv_scale[0]``, folded in when ``QUANT``,
    and the fp16 query's ``2^e``), an empty online-softmax state, the sequence's
    block-table row and the KV head's first element in the K and V caches.
    """
    if QUANT:
        scale_log2e = scale_log2e * tl.load(kv_scale_ptr)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    k_ptr = k_cache_ptr + kvh * stride_ch
    v_ptr = v_cache_ptr + kvh * stride_ch
    q_up = l_i
    if WIDEN_F16:
        q, scale_log2e = _fp16_query(q, scale_log2e)
    if Q_FP8:
        q, q_up = _fp8_query(q)
    return q, q_up, scale_log2e, m_i, l_i, acc, table, k_ptr, v_ptr


@triton.jit
def _v_scaled(acc, kv_scale_ptr, QUANT: tl.constexpr):
    """``acc`` times an fp8 cache's V scale (``kv_scale[1]``) when ``QUANT``, once per program."""
    if QUANT:
        acc = acc * tl.load(kv_scale_ptr + 1)
    return acc
