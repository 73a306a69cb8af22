"""Triton kernels of the ``fp8`` weight format: per-token quantization and the skinny GEMM.

The ``fp8`` format's product (:mod:`~pitstop.plugins.weight_formats.fp8`) is

    out[m, n] = x_scale[m] * w_scale[n] * sum_k xq[m, k] * wq[n, k]

with ``xq = round_e4m3(clamp(x / x_scale, ±448))`` and ``x_scale = amax(|x[m]|) / 448``.
Run as torch operations, the quantization of ``x`` alone is eight launches
(widen, abs, amax, clamp, divide twice, clamp, cast) before ``torch._scaled_mm``.
Two kernels here:

* ``_quantize_rows_kernel``: one program per row of ``x``; its amax, scale and
  e4m3 values, for ``torch._scaled_mm`` (steps above ``fp8.skinny_rows``), bit
  for bit the reference's.
* ``_skinny_kernel``: the whole linear for up to :data:`SKINNY_MAX_ROWS` rows in
  one launch, **weight-only**: ``x`` stays in its dtype and each e4m3 weight
  tile is widened in registers, ``out = (x @ wq.T) * w_scale``
  (``fp8.weight_only_reference``). At decode's batch sizes the time is the
  weight bytes; quantizing ``x`` would need every row's amax before the first
  product (a pass over ``x`` in every program, measured 2026-12-03 on the H200
  at 3-10x bf16's time with the tensor-core fp8 product of 4 and 16 rows) and
  adds rounding the weight-only product does not have. Each program owns
  ``BLOCK_N`` output channels and streams their ``[BLOCK_N, K]`` slice once;
  one row takes the CUDA cores (products summed once, at the end), several rows
  the tensor cores in the activation dtype (every e4m3 value is exact in bf16).

Products are exact in float32 in both kernels, so the outputs differ from the
float32 references only by the order of the sums. Without a GPU the kernels run
in Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is
imported), which is how the CPU tests check them.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops.launch_math import cdiv, next_power_of_2
from pitstop.plugins.kernels.triton_ops.rope_store import _quantize

# The skinny kernel's tile of rows (BLOCK_M): the most rows one launch multiplies.
# fp8.py repeats the number for its settings without importing Triton; a test keeps them equal.
SKINNY_MAX_ROWS = 16

# The kernels write e4m3's constants as literals (a jitted function reads no Python globals):
# 448 its largest finite value (fp8.FP8_MAX), 3 mantissa bits, 2^-6 = 0.015625 its smallest
# normal, and 1e-12 the reference's floor on a row's amax (fp8.MIN_AMAX); tests/plugins/weight_formats/test_fp8_gemm.py
# checks them against the reference, an all-zero row included.


@attrs.frozen
class SkinnyTiles:
    """The skinny kernel's tile: output channels a program owns, the K step, warps, stages."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


def skinny_tiles(rows: int, out_features: int, in_features: int) -> SkinnyTiles:
    """The tile for a ``[rows, in_features] x [out_features, in_features]^T`` product.

    One row: enough programs to cover the H200's 132 SMs a few times over
    (``BLOCK_N`` 8 for a narrow output, else 16), ``BLOCK_K`` as wide as the row
    allows. Several rows: the tile the H200 sweep measured best.
    """
    if rows == 1:
        block_n = 8 if out_features <= 8192 else 16
        block_k = 1024 if block_n == 8 and in_features % 1024 == 0 else 512
        return SkinnyTiles(block_n=block_n, block_k=block_k, num_warps=4, num_stages=3)
    # several rows: the H200 sweep's best summed over llama3-8b's four linears at 16 rows
    # (2026-12-03, benchmarks/fp8_gemm_bench.py --sweep): 1.5x faster than (16, 256, 4, 3)
    block_k = 256 if in_features % 256 == 0 else 128
    return SkinnyTiles(block_n=32, block_k=block_k, num_warps=4, num_stages=4)


@triton.jit
def _row_amax(x_ptr, rows, row_ok, stride_x, K, BLOCK_K: tl.constexpr):
    """``max_k |x[rows, k]|`` in float32, one value per row (0 for rows past the end)."""
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros((rows.shape[0],), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        ok = row_ok[:, None] & (k < K)[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :], mask=ok, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    return amax


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr):
    """Row ``program_id`` of ``x`` as e4m3 ``q`` and its float32 scale (``amax / 448``)."""
    row = tl.program_id(0)
    rows = row + tl.arange(0, 1)
    amax = _row_amax(x_ptr, rows, rows >= 0, stride_x, K, BLOCK_K)
    scale = tl.div_rn(tl.maximum(amax, 1e-12), 448.0)  # (1,)
    tl.store(scale_ptr + rows, scale)
    cols = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        ok = k < K
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + k, mask=ok, other=0.0)
        xq = _quantize(x, scale, 448.0, 3, 0.015625)
        tl.store(q_ptr + row.to(tl.int64) * stride_q + k, xq.to(q_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_y,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``y[:, cols] = x @ widen(W[cols]).T * w_scale[cols] (+ bias)`` for all ``M <= BLOCK_M`` rows.

    Weight-only: ``x`` stays in its dtype; each e4m3 weight tile is widened in
    registers (exactly: every e4m3 value is a bf16 and a float32).
    """
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    if BLOCK_M == 1:  # one row: CUDA cores, products summed once at the end
        part = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
            part += w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc = tl.sum(part, axis=1)[None, :]
    else:  # several rows: tensor cores on the activation dtype (x and widened W)
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    w_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
    out = (acc * w_scale[None, :]).to(y_ptr.dtype.element_ty)
    if HAS_BIAS:  # added after the rounding, as the reference adds it to the rounded product
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + bias[None, :]).to(y_ptr.dtype.element_ty)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], out, mask=mask)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` as e4m3 with one float32 scale per row, in one launch: ``(q, scale [M, 1])``."""
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block_k = min(2048, next_power_of_2(cols))
        _quantize_rows_kernel[(rows,)](
            x, q, scale, cols, x.stride(0), q.stride(0), BLOCK_K=block_k, num_warps=4
        )
    return q, scale


def skinny_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    out_dtype: torch.dtype,
    tiles: SkinnyTiles | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]`` (``M <= SKINNY_MAX_ROWS``) times the e4m3 ``qweight`` ``[N, K]``, one launch.

    ``w_scale`` holds one float32 per output channel. Weight-only: ``x`` is not
    quantized (``fp8.weight_only_reference`` is the product it computes).
    """
    rows, in_features = x.shape
    out_features = qweight.shape[0]
    if rows > SKINNY_MAX_ROWS:
        raise ValueError(f"skinny_linear takes up to {SKINNY_MAX_ROWS} rows; got {rows}")
    if x.stride(1) != 1 or qweight.stride(1) != 1:
        raise ValueError("skinny_linear needs rows with a contiguous last dimension")
    y = torch.empty((rows, out_features), dtype=out_dtype, device=x.device)
    if rows == 0:
        return y
    tiles = tiles or skinny_tiles(rows, out_features, in_features)
    block_m = 1 if rows == 1 else SKINNY_MAX_ROWS
    grid = (cdiv(out_features, tiles.block_n),)
    _skinny_kernel[grid](
        x,
        qweight,
        w_scale,
        bias if bias is not None else w_scale,
        y,
        rows,
        out_features,
        in_features,
        x.stride(0),
        qweight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return y
