"""SiLU-and-mul: ``silu(gate) * up`` of a merged ``[gate | up]`` projection output.

With ``row_scale`` ``(x, eps)`` (a fused layer's gate-up projection of the rows of ``x``
before their RMSNorm, the gain folded into the weight) each program first computes its
row's ``1 / sqrt(mean(x[r] ** 2) + eps)`` in float32 and multiplies gate and up by it,
each rounded to the activation dtype (as
:func:`pitstop.plugins.kernels.reference.apply_row_scale`), so the GEMM before needs no
row-scale launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops.launch_math import cdiv, next_power_of_2
from pitstop.plugins.kernels.triton_ops.rope_store import _rounded, _row_rstd


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    rows_ptr,
    stride_x,
    stride_rows,
    d,
    eps,
    BLOCK: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    ROW_K: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl.wait(PDL)  # every read depends on the previous kernel
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    dt: tl.constexpr = gate.dtype
    g = gate.to(tl.float32)
    u = up.to(tl.float32)
    if ROW_SCALE:
        rstd = _row_rstd(rows_ptr + row * stride_rows, eps, ROW_K, ROW_BLOCK)
        g = _rounded(g * rstd, dt)
        u = _rounded(u * rstd, dt)
    # rounded to the input dtype between the two steps, as the reference's silu(gate) * up is
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    _pdl.launch_dependents(PDL)
    tl.store(out_ptr + row * d + cols, (silu * u).to(dt), mask=mask)


def silu_and_mul(
    x: torch.Tensor,
    row_scale: tuple[torch.Tensor, float] | None = None,
    *,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dimension ``2d``; returns ``[..., d]``.

    ``row_scale`` ``(rows [R, K], eps)``, one row per row of ``x``: gate and up are first
    multiplied by their row's ``1 / rms`` (module docstring). ``pdl``: programmatic
    dependent launch (default: where it works, :mod:`.pdl`).
    """
    two_d = x.shape[-1]
    assert two_d % 2 == 0, "the merged gate-up width must be even"
    d = two_d // 2
    x2 = x.reshape(-1, two_d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows == 0 or d == 0:
        return out
    scale_rows, eps = row_scale if row_scale is not None else (x2, 0.0)
    row_k = 1  # no row scale: one compiled variant whatever the width
    if row_scale is not None:
        assert scale_rows.dim() == 2 and scale_rows.shape[0] == rows, "row_scale's rows: [R, K]"
        scale_rows = scale_rows if scale_rows.stride(-1) == 1 else scale_rows.contiguous()
        row_k = scale_rows.shape[-1]
    block = min(2048, next_power_of_2(d))
    grid = (rows, cdiv(d, block))
    use_pdl = _pdl.enabled(x.device, pdl)
    _silu_and_mul_kernel[grid](
        x2,
        out,
        scale_rows,
        x2.stride(0),
        scale_rows.stride(0),
        d,
        eps,
        BLOCK=block,
        ROW_SCALE=row_scale is not None,
        ROW_K=row_k,
        ROW_BLOCK=min(1024, next_power_of_2(row_k)),
        PDL=use_pdl,
        num_warps=4 if block <= 1024 else 8,
        **_pdl.launch_kwargs(use_pdl),
    )
    return out
