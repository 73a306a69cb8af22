"""float64 references of fused_linear's three ops, their inputs and their error bound.

Shared by tests/plugins/kernels/test_fused_linear.py (the split and unsplit GEMMs) and
test_fused_linear_stream_k.py: the same formula in float64 over the very inputs the kernel
reads, so the only error allowed is the kernel's float32 accumulation and its one rounding.
Nothing here imports Triton at import time (the tests set ``TRITON_INTERPRET`` first).
"""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# max |kernel - float64| / max |float64|: float32 accumulation, one rounding to the dtype
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    """Finite, same shape, dtype kept, relative max error under the dtype's bound."""
    assert actual.shape == expected.shape, f"{what}: {tuple(actual.shape)} != {expected.shape}"
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite output (unwritten or NaN)"
    scale = expected.abs().max().clamp_min(1e-6)
    err = ((actual.double() - expected).abs().max() / scale).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]}"


def counters_are_zero() -> bool:
    """Whether every split-K (and stream-K) arrival counter of the device is back at zero."""
    from pitstop.plugins.kernels.triton_ops import fused_linear as fl

    return bool((fl.workspace(DEVICE).counters == 0).all())


def rows_scale(x: torch.Tensor, eps: float | None) -> torch.Tensor:
    """float64 ``rstd(x)[:, None]`` (1 without a norm)."""
    xd = x.double()
    if eps is None:
        return torch.ones(x.shape[0], 1, dtype=torch.float64, device=x.device)
    return 1.0 / torch.sqrt((xd * xd).mean(dim=1, keepdim=True) + eps)


def ref_norm_linear(x, weight, eps, bias):
    """``rstd(x) * x @ weight.T (+ bias)`` in float64."""
    y = rows_scale(x, eps) * (x.double() @ weight.double().T)
    return y if bias is None else y + bias.double()


def ref_norm_gate_up(x, weight, eps, bias):
    """``silu(gate) * up`` of :func:`ref_norm_linear` over the merged weight, in float64."""
    f = weight.shape[0] // 2
    h = ref_norm_linear(x, weight, eps, bias)
    g, u = h[:, :f], h[:, f:]
    return g / (1.0 + torch.exp(-g)) * u


def ref_linear_residual(x, weight, residual, bias):
    """``residual + x @ weight.T (+ bias)`` in float64."""
    y = residual.double() + x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int, scale: float = 3.0):
    """x (a row scale far from 1, so the norm matters), weight ~ 1/sqrt(K), bias."""
    gen = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(m, k, generator=gen)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    b = (0.5 * torch.randn(n, generator=gen)).to(DEVICE, dtype)
    return x, w, b
