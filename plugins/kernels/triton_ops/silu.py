"""SiLU-and-mul: ``silu(gate) * up`` of a merged ``[gate | up]`` projection output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops import pdl as _pdl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl.wait(PDL)  # every read depends on the previous kernel
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # rounded to the input dtype between the two steps, as the reference's silu(gate) * up is
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    _pdl.launch_dependents(PDL)
    tl.store(out_ptr + row * d + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, *, pdl: bool | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dimension ``2d``; returns ``[..., d]``.

    ``pdl``: programmatic dependent launch (default: where it works, :mod:`.pdl`).
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
    block = min(2048, triton.next_power_of_2(d))
    grid = (rows, triton.cdiv(d, block))
    use_pdl = _pdl.enabled(x.device, pdl)
    _silu_and_mul_kernel[grid](
        x2,
        out,
        x2.stride(0),
        d,
        BLOCK=block,
        PDL=use_pdl,
        num_warps=4 if block <= 1024 else 8,
        **_pdl.launch_kwargs(use_pdl),
    )
    return out
