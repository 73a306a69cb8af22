"""The K step and the epilogue of the skinny GEMMs (:mod:`.fused_linear`, :mod:`.fused_linear_stream_k`).

Jit helpers both kernels inline: the float32 product of a weight tile and an x tile (swap AB:
the weight tile is the MMA's M side), the K-masked tile load, one K step of the GEMM with the
rows' sums of squares beside, a program's partials stored to and summed from the workspace
(split-K's splits, stream-K's parts of a cut tile), and the epilogue (row scale, bias,
SiLU·mul, residual, one rounding). Their own module so that the split and stream-K kernels share them without either
importing the other.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops.rope_store import _rounded


@triton.jit
def _dot(w, x, acc, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc + w @ x`` in float32 (``UPCAST``: on float32 copies, for Triton's interpreter,
    which multiplies bf16 operands wrongly; the same exact products, float32 sums)."""
    if UPCAST:
        return tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(w, x, acc, input_precision=DOT_PRECISION)


@triton.jit
def _load_k(ptrs, k, k_end, EVEN_K: tl.constexpr, K_AXIS: tl.constexpr):
    """A tile whose columns (``K_AXIS`` 1) or rows (0) are the K offsets ``k``; masked past ``k_end``."""
    if EVEN_K:
        return tl.load(ptrs)
    elif K_AXIS == 1:
        return tl.load(ptrs, mask=(k < k_end)[None, :], other=0.0)
    else:
        return tl.load(ptrs, mask=(k < k_end)[:, None], other=0.0)


@triton.jit
def _k_product(
    w, u, xt, acc, acc_u, sq, GATE_UP: tl.constexpr, NORM: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The weight tile (gate-up: and its up tile ``u``) times the x tile into the accumulators,
    the x tile's squares into the rows' sums; returns the three."""
    acc = _dot(w, xt, acc, UPCAST, DOT_PRECISION)
    if GATE_UP:
        acc_u = _dot(u, xt, acc_u, UPCAST, DOT_PRECISION)
    if NORM:
        xf = xt.to(tl.float32)
        sq += tl.sum(xf * xf, axis=0)
    return acc, acc_u, sq


@triton.jit
def _k_step(
    w_rows, x_cols, k, k_end, acc, acc_u, sq, N, stride_wn, GATE_UP: tl.constexpr,
    NORM: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One K step at offsets ``k``: its tiles loaded, then :func:`_k_product`; returns the
    accumulators, the sums and the x tile (the LoRA shrink reads it too)."""
    w = _load_k(w_rows + k[None, :], k, k_end, EVEN_K, 1)
    xt = _load_k(x_cols + k[:, None], k, k_end, EVEN_K, 0)
    u = w
    if GATE_UP:
        u = _load_k(w_rows + N * stride_wn + k[None, :], k, k_end, EVEN_K, 1)
    acc, acc_u, sq = _k_product(w, u, xt, acc, acc_u, sq, GATE_UP, NORM, UPCAST, DOT_PRECISION)
    return acc, acc_u, sq, xt


@triton.jit
def _store_part(
    ws_ptr, sq_ptr, slot, acc, acc_u, sq, GATE_UP: tl.constexpr, NORM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """A program's float32 partial accumulator(s) and rows' sums of squares into workspace
    slot ``slot`` (split-K's (tile, split), stream-K's (tile, part))."""
    ACCS: tl.constexpr = 2 if GATE_UP else 1
    TILE: tl.constexpr = BLOCK_N * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rows[None, :]
    tl.store(ws_ptr + slot * (ACCS * TILE) + offs, acc)
    if GATE_UP:
        tl.store(ws_ptr + slot * (ACCS * TILE) + TILE + offs, acc_u)
    if NORM:
        tl.store(sq_ptr + slot * BLOCK_M + rows, sq)


@triton.jit
def _add_part(
    ws_ptr, sq_ptr, slot, acc, acc_u, sq, GATE_UP: tl.constexpr, NORM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """The accumulators and sums plus slot ``slot``'s (:func:`_store_part`), read past L1
    (``.cg``: another program wrote them); returns the three."""
    ACCS: tl.constexpr = 2 if GATE_UP else 1
    TILE: tl.constexpr = BLOCK_N * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rows[None, :]
    acc += tl.load(ws_ptr + slot * (ACCS * TILE) + offs, cache_modifier=".cg")
    if GATE_UP:
        acc_u += tl.load(ws_ptr + slot * (ACCS * TILE) + TILE + offs, cache_modifier=".cg")
    if NORM:
        sq += tl.load(sq_ptr + slot * BLOCK_M + rows, cache_modifier=".cg")
    return acc, acc_u, sq


@triton.jit
def _epilogue(
    acc,
    acc_u,
    sq,
    n,
    m,
    M,
    N,
    K,
    eps,
    bias_ptr,
    res_ptr,
    out_ptr,
    stride_rm,
    stride_om,
    NORM: tl.constexpr,
    GATE_UP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    """Row scale, bias, SiLU·mul, residual on the float32 ``[BLOCK_N, BLOCK_M]`` tile; one
    rounding. Returns the tile as stored (the output dtype)."""
    if NORM:
        rstd = 1.0 / tl.sqrt(sq / K + eps)
        acc = acc * rstd[None, :]
        if GATE_UP:
            acc_u = acc_u * rstd[None, :]
    n_mask = n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if GATE_UP:
            acc_u += tl.load(bias_ptr + N + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if GATE_UP:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_u
    mask = n_mask[:, None] & (m < M)[None, :]
    m64 = m.to(tl.int64)[None, :]
    if RESIDUAL:
        r = tl.load(res_ptr + m64 * stride_rm + n[:, None], mask=mask, other=0.0)
        acc += r.to(tl.float32)
    dt: tl.constexpr = out_ptr.dtype.element_ty
    y = _rounded(acc, dt).to(dt)
    tl.store(out_ptr + m64 * stride_om + n[:, None], y, mask=mask)
    return y
