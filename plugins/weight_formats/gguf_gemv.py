"""Triton kernels for ``y = x @ W.T`` reading ``W``'s GGUF blocks directly (fp32 accumulation).

Layouts in :mod:`~pitstop.plugins.weight_formats.gguf_blocks`. Each program computes
``BLOCK_N`` outputs of one input row; the grid is ``(cdiv(N, BLOCK_N), batch)``, which
suits decoding (a batch of up to :data:`MAX_BATCH` rows); larger batches are better
served by dequantize-then-matmul on tensor cores. The weight is never materialized.

* ``_dequant_gemv_kernel``, the 32-element types Q8_0, Q4_0 and Q4_1: it walks the rows'
  bytes ``GROUP`` blocks at a time, loads a ``(BLOCK_N, GROUP)`` tile of scales (two bytes
  each, put together and bitcast to f16) and the matching ``(BLOCK_N, GROUP, 16 or 32)``
  quant bytes, dequantizes them in registers (Q4: the low nibbles are elements 0-15 of a
  block, the high nibbles 16-31, so each half meets its own slice of ``x``) and
  accumulates the products in float32.
* ``_kquant_gemv_kernel``, the 256-element super-blocks of Q4_K and Q6_K, one per step:
  Q4_K as ``(BLOCK_N, 8, 32)`` (its eight sub-blocks, each with a 6-bit scale and min
  unpacked from the 12 scale bytes in registers), Q6_K as ``(BLOCK_N, 16, 16)`` (its
  sixteen int8-scaled groups; each element's low four and high two bits gathered from
  ``ql`` and ``qh`` by index arithmetic).

The results match the dequantize-then-matmul reference to float32 rounding (the sum is
taken in another order, and the compiler may fuse ``d * q + m``), not bit for bit.
Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` set before
this module is imported), which is how the tests check them on small shapes.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops.launch_math import cdiv
from pitstop.plugins.weight_formats.gguf_blocks import QuantType, UnsupportedQuantType, layout_of

MAX_BATCH = 16  # input rows above which GGUFLinear prefers dequantize + matmul
_KINDS = {QuantType.Q8_0: 0, QuantType.Q4_0: 1, QuantType.Q4_1: 2}
_K_KINDS = {QuantType.Q4_K: 0, QuantType.Q6_K: 1}
BLOCK_N = 32
GROUP = 8  # 32-element blocks per step: 256 weights of each row


@triton.jit
def _f16_at(ptr, offsets, mask):
    """The little-endian f16 at byte ``offsets`` of ``ptr`` (a uint8 pointer), as float32."""
    lo = tl.load(ptr + offsets, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + offsets + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    N,
    n_blocks,
    row_bytes,
    stride_x,
    stride_y,
    KIND: tl.constexpr,
    QS_AT: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
):
    """``y[b, rows] = x[b] @ W[rows].T`` for one input row ``b`` and ``BLOCK_N`` weight rows."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_base = rows.to(tl.int64) * row_bytes  # (BLOCK_N,)
    x_row = x_ptr + b.to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j0 in range(0, n_blocks, GROUP):
        j = j0 + tl.arange(0, GROUP)  # (GROUP,) block index within the row
        j_ok = j < n_blocks
        base = row_base[:, None] + (j * BLOCK_BYTES)[None, :]  # (BLOCK_N, GROUP)
        ok = row_ok[:, None] & j_ok[None, :]
        d = _f16_at(w_ptr, base, ok)[:, :, None]  # (BLOCK_N, GROUP, 1)
        ok3 = ok[:, :, None]  # (BLOCK_N, GROUP, 1), broadcast over a block's bytes
        if KIND == 0:  # Q8_0: d, then 32 int8
            i = tl.arange(0, 32)
            x_ok = j_ok[:, None] & (i[None, :] < 32)
            q = tl.load(w_ptr + base[:, :, None] + 2 + i[None, None, :], mask=ok3, other=0)
            w = q.to(tl.int8, bitcast=True).to(tl.float32) * d
            xv = tl.load(x_row + (j[:, None] * 32 + i[None, :]), mask=x_ok, other=0.0)
            acc += tl.sum(tl.sum(w * xv.to(tl.float32)[None, :, :], axis=2), axis=1)
        else:  # Q4_0: d, 16 bytes of nibbles; Q4_1: d, m, 16 bytes of nibbles
            i = tl.arange(0, 16)
            qs = tl.load(w_ptr + base[:, :, None] + QS_AT + i[None, None, :], mask=ok3, other=0)
            lo = (qs & 0x0F).to(tl.float32)
            hi = (qs >> 4).to(tl.float32)
            if KIND == 1:
                w_lo = d * (lo - 8.0)
                w_hi = d * (hi - 8.0)
            else:
                m = _f16_at(w_ptr, base + 2, ok)[:, :, None]
                w_lo = d * lo + m
                w_hi = d * hi + m
            x_at = j[:, None] * 32 + i[None, :]
            x_ok = j_ok[:, None] & (i[None, :] < 16)
            x_lo = tl.load(x_row + x_at, mask=x_ok, other=0.0).to(tl.float32)
            x_hi = tl.load(x_row + x_at + 16, mask=x_ok, other=0.0).to(tl.float32)
            part = w_lo * x_lo[None, :, :] + w_hi * x_hi[None, :, :]
            acc += tl.sum(tl.sum(part, axis=2), axis=1)
    tl.store(y_ptr + b.to(tl.int64) * stride_y + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _kquant_gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    N,
    n_blocks,
    row_bytes,
    stride_x,
    stride_y,
    KIND: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``y[b, rows] = x[b] @ W[rows].T`` for Q4_K (``KIND`` 0) or Q6_K (1) super-blocks."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_base = rows.to(tl.int64) * row_bytes
    x_row = x_ptr + b.to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(0, n_blocks):
        if KIND == 0:  # Q4_K: d, dmin, 12 scale bytes, 128 bytes of nibbles (144)
            base = row_base + j * 144
            ok2 = row_ok[:, None]
            d = _f16_at(w_ptr, base, row_ok)[:, None]
            dmin = _f16_at(w_ptr, base + 2, row_ok)[:, None]
            s = tl.arange(0, 8)  # sub-block
            sb = base[:, None] + 4  # the scale bytes
            low = s < 4
            p = tl.load(w_ptr + sb + (s + 4)[None, :], mask=ok2, other=0)  # bytes 4-11
            q = tl.load(w_ptr + sb + s[None, :], mask=ok2, other=0)  # bytes 0-7
            r = tl.load(w_ptr + sb + tl.where(low, s, s - 4)[None, :], mask=ok2, other=0)
            sc = tl.where(low[None, :], q & 0x3F, (p & 0x0F) | ((r >> 6) << 4))
            mn = tl.where(low[None, :], p & 0x3F, (p >> 4) | ((q >> 6) << 4))
            dl = (d * sc.to(tl.float32))[:, :, None]  # (BLOCK_N, 8, 1)
            ml = (dmin * mn.to(tl.float32))[:, :, None]
            i = tl.arange(0, 32)
            at = 16 + (s // 2 * 32)[:, None] + i[None, :]  # (8, 32): byte of each element
            shift = ((s % 2) * 4)[:, None]
            qs = tl.load(
                w_ptr + base[:, None, None] + at[None, :, :], mask=ok2[:, :, None], other=0
            )
            w = dl * ((qs >> shift[None, :, :]) & 0x0F).to(tl.float32) - ml
            e = s[:, None] * 32 + i[None, :]
        else:  # Q6_K: 128 bytes ql, 64 bytes qh, 16 int8 scales, d (210)
            base = row_base + j * 210
            ok2 = row_ok[:, None]
            d = _f16_at(w_ptr, base + 208, row_ok)[:, None]
            g = tl.arange(0, 16)  # 16-element group, one int8 scale each
            sc = tl.load(w_ptr + base[:, None] + 192 + g[None, :], mask=ok2, other=0)
            dl = (d * sc.to(tl.int8, bitcast=True).to(tl.float32))[:, :, None]  # (BLOCK_N, 16, 1)
            t = tl.arange(0, 16)
            e = g[:, None] * 16 + t[None, :]  # (16, 16): element index in the super-block
            h = e // 128
            r = e % 128
            ql_at = h * 64 + r % 64
            qh_at = 128 + h * 32 + r % 32
            ql = tl.load(
                w_ptr + base[:, None, None] + ql_at[None, :, :], mask=ok2[:, :, None], other=0
            )
            qh = tl.load(
                w_ptr + base[:, None, None] + qh_at[None, :, :], mask=ok2[:, :, None], other=0
            )
            lo = (ql >> ((r // 64) * 4)[None, :, :]) & 0x0F
            hi = (qh >> ((r // 32) * 2)[None, :, :]) & 0x03
            q6 = (lo | (hi << 4)).to(tl.float32) - 32.0
            w = dl * q6
        xv = tl.load(x_row + j * 256 + e).to(tl.float32)
        acc += tl.sum(tl.sum(w * xv[None, :, :], axis=2), axis=1)
    tl.store(y_ptr + b.to(tl.int64) * stride_y + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)


def supports(qtype: int | str | enum.Enum) -> bool:
    """Whether :func:`dequant_gemv` reads this ggml type's blocks directly."""
    try:
        found = layout_of(qtype).qtype
    except UnsupportedQuantType:
        return False
    return found in _KINDS or found in _K_KINDS


def dequant_gemv(
    x: torch.Tensor, raw: torch.Tensor, qtype: int | str | enum.Enum, out_features: int
) -> torch.Tensor:
    """``x @ W.T`` for ``x`` of shape ``(batch, in_features)`` and ``W`` given as its GGUF
    bytes ``raw`` (uint8, ``out_features`` rows of blocks, on ``x``'s device); the result
    has ``x``'s dtype, accumulated in float32."""
    layout = layout_of(qtype)
    if not supports(layout.qtype):
        names = ", ".join(t.name for t in (*_KINDS, *_K_KINDS))
        raise UnsupportedQuantType(f"dequant_gemv reads {names} blocks, not {layout.qtype.name}")
    if x.dim() != 2:
        raise ValueError(f"x must be (batch, in_features), not {tuple(x.shape)}")
    batch, k = x.shape
    row_bytes = layout.row_bytes(k)
    if raw.dtype != torch.uint8 or raw.numel() != out_features * row_bytes:
        raise ValueError(
            f"raw must be {out_features * row_bytes} uint8 bytes for ({out_features}, {k})"
        )
    x = x.contiguous()
    raw = raw.contiguous()
    y = torch.empty((batch, out_features), dtype=x.dtype, device=x.device)
    grid = (cdiv(out_features, BLOCK_N), batch)
    args = (x, raw, y, out_features, k // layout.block_elems, row_bytes, x.stride(0), y.stride(0))
    if layout.qtype in _K_KINDS:
        _kquant_gemv_kernel[grid](*args, KIND=_K_KINDS[layout.qtype], BLOCK_N=BLOCK_N)
        return y
    _dequant_gemv_kernel[grid](
        *args,
        KIND=_KINDS[layout.qtype],
        QS_AT=2 if layout.qtype == QuantType.Q4_0 else 4,
        BLOCK_BYTES=layout.block_bytes,
        BLOCK_N=BLOCK_N,
        GROUP=GROUP,
    )
    return y
