"""Residual add + RMSNorm in one pass over each row.

Rounding follows the reference step by step (the add rounded to the input
dtype, the norm in float32, rounded back before the weight multiply), so the
result differs from :func:`pitstop.plugins.kernels.reference.rms_norm` only by
the order of the float32 sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops.launch_math import cdiv, next_power_of_2


@triton.jit(do_not_specialize=["num_rows"])
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    num_rows,
    heads,
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < N
    # the weight does not depend on the previous kernel: loaded before the wait
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    _pdl.wait(PDL)
    mask = row_mask[:, None] & col_mask[None, :]
    # row r of the [T, H, N] view is token r // H, head r % H
    t = (rows // heads).to(tl.int64)
    h = (rows % heads).to(tl.int64)
    x = tl.load(
        x_ptr + (t * stride_x0 + h * stride_x1)[:, None] + cols[None, :], mask=mask, other=0.0
    )
    if HAS_RESIDUAL:
        r = tl.load(
            res_ptr + (t * stride_r0 + h * stride_r1)[:, None] + cols[None, :], mask=mask, other=0.0
        )
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        out_offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(res_out_ptr + out_offs, x, mask=mask)
    h32 = x.to(tl.float32)
    var = tl.sum(h32 * h32, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (h32 * rstd[:, None]).to(x.dtype).to(tl.float32)
    _pdl.launch_dependents(PDL)
    y = normed * w[None, :]
    out_offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dimension of ``x`` (2-D ``[T, N]`` or 3-D ``[T, H, N]``, rows may be strided).

    With ``residual`` (same shape as ``x``) the sum ``x + residual`` is normalized
    and also returned as the new residual; both outputs are fresh contiguous tensors.
    ``pdl``: programmatic dependent launch (default: where it works, :mod:`.pdl`).
    """
    n = x.shape[-1]
    assert weight.shape == (n,), "weight must have the size of x's last dimension"
    if x.stride(-1) != 1:
        x = x.contiguous()
    x3 = x.unsqueeze(1) if x.dim() == 2 else x.reshape(-1, *x.shape[-2:]) if x.dim() != 3 else x
    assert x3.dim() == 3, "rms_norm takes [T, N] or [T, H, N]"
    heads = x3.shape[1]
    num_rows = x3.shape[0] * heads
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = None
    r3 = x3
    if residual is not None:
        assert residual.shape == x.shape, "residual must have x's shape"
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        r3 = residual.unsqueeze(1) if residual.dim() == 2 else residual.reshape(x3.shape)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out, res_out
    block_n = next_power_of_2(n)
    rows = max(1, min(16, 2048 // block_n))
    num_warps = 4 if block_n <= 1024 else 8 if block_n <= 4096 else 16
    grid = (cdiv(num_rows, rows),)
    use_pdl = _pdl.enabled(x.device, pdl)
    _rmsnorm_kernel[grid](
        x3,
        r3,
        weight,
        out,
        res_out if res_out is not None else out,
        num_rows,
        heads,
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        eps,
        N=n,
        BLOCK_N=block_n,
        ROWS=rows,
        HAS_RESIDUAL=residual is not None,
        PDL=use_pdl,
        num_warps=num_warps,
        **_pdl.launch_kwargs(use_pdl),
    )
    return out, res_out


_UNIT_GAINS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def unit_gain(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Ones ``[width]``: the weight of an RMSNorm whose gain is folded elsewhere (into the
    projection after it), made once per width, dtype and device."""
    key = (width, dtype, torch.device(device))
    ones = _UNIT_GAINS.get(key)
    if ones is None:
        ones = _UNIT_GAINS[key] = torch.ones(width, dtype=dtype, device=device)
    return ones
