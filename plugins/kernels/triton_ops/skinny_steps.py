"""The K step and the epilogue of the skinny GEMMs (:mod:`.fused_linear`, :mod:`.fused_linear_stream_k`).

Jit helpers both kernels inline: the float32 product of a weight tile and an x tile (swap AB:
the weight tile is the MMA's M side), the K-masked tile load, one K step of the GEMM with the
rows' sums of squares beside, and the epilogue (row scale, bias, SiLU·mul, residual, one
rounding). Their own module so that the split and stream-K kernels share them without either
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
def _k_step(
    w_rows, x_cols, k, k_end, acc, acc_u, sq, N, stride_wn, GATE_UP: tl.constexpr,
    NORM: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One K step at offsets ``k``: the weight tile (gate-up: and its up tile) times the x
    tile into the accumulators, the x tile's squares into the rows' sums; returns them and
    the x tile (the LoRA shrink reads it too)."""
    w = _load_k(w_rows + k[None, :], k, k_end, EVEN_K, 1)
    xt = _load_k(x_cols + k[:, None], k, k_end, EVEN_K, 0)
    acc = _dot(w, xt, acc, UPCAST, DOT_PRECISION)
    if GATE_UP:
        u = _load_k(w_rows + N * stride_wn + k[None, :], k, k_end, EVEN_K, 1)
        acc_u = _dot(u, xt, acc_u, UPCAST, DOT_PRECISION)
    if NORM:
        xf = xt.to(tl.float32)
        sq += tl.sum(xf * xf, axis=0)
    return acc, acc_u, sq, xt


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
