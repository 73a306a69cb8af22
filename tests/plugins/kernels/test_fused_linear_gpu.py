"""fused_linear on the GPU at the real layer shapes (qwen3-0.6b, llama3-8b), eager and in CUDA graphs.

Marked ``gpu``: skipped where torch sees no CUDA device (tests/conftest.py). Run on
the H200 with ``pytest -q -m gpu tests/plugins/kernels/test_fused_linear_gpu.py``.

The reference is the same formula in float64 (torch on the GPU) over the kernel's
own bf16 inputs; the kernels run with their default config and PDL on (where the
GPU has it: compute capability 9.0). The graph tests capture a layer's four GEMMs
(and the unfused norm/SiLU kernels, PDL on) and replay them many times over new
inputs: every replay must match float64 and give the same bits, and the split-K
counters must be zero after each.
"""

from __future__ import annotations

import pytest
import torch
from helpers.poison import poisoned_outputs

from pitstop.plugins.kernels.triton_ops import fused_linear as fl
from pitstop.plugins.kernels.triton_ops import pdl, rmsnorm, silu

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
# name -> (hidden, qkv N, o_proj K, intermediate F)
SHAPES = {
    "qwen3-0.6b": (1024, 4096, 2048, 3072),
    "llama3-8b": (4096, 6144, 4096, 14336),
}
EPS = 1e-6


@pytest.fixture(autouse=True)
def _poisoned():
    """Fresh outputs are NaN-filled so that an unwritten element fails."""
    with poisoned_outputs():
        yield


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: {tuple(actual.shape)} != {expected.shape}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite output"
    err = ((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]}"


def _rstd(x: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return 1.0 / torch.sqrt((xd * xd).mean(dim=1, keepdim=True) + EPS)


def ref_norm_linear(x, w, bias=None):
    y = _rstd(x) * (x.double() @ w.double().T)
    return y if bias is None else y + bias.double()


def ref_norm_gate_up(x, w):
    h = ref_norm_linear(x, w)
    f = w.shape[0] // 2
    g, u = h[:, :f], h[:, f:]
    return g / (1.0 + torch.exp(-g)) * u


def ref_linear_residual(x, w, residual):
    return residual.double() + x.double() @ w.double().T


class Layer:
    """One layer's four GEMM weights (gains folded: random, so any W' will do)."""

    def __init__(self, name: str, dtype: torch.dtype, seed: int = 0) -> None:
        hidden, qkv, o_k, f = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(seed)

        def w(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(dtype)

        self.hidden, self.qkv_n, self.o_k, self.f = hidden, qkv, o_k, f
        self.w_qkv, self.w_o = w(qkv, hidden), w(hidden, o_k)
        self.w_gu, self.w_down = w(2 * f, hidden), w(hidden, f)


def test_pdl_is_on_for_an_h200() -> None:
    """Hopper and Triton with gdc_wait: PDL on by default; pdl=False turns it off."""
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    assert pdl.HAS_GDC and pdl.enabled(dev) and not pdl.enabled(dev, False)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("m", [1, 4, 16, 64, 128, 256])
def test_real_shapes_match_float64(name: str, m: int) -> None:
    """The four GEMMs of a layer, bf16, default configs (split-K where chosen), PDL default."""
    if name == "llama3-8b" and m in (4, 64, 128):
        pytest.skip("llama3-8b at 1, 16 and 256 rows only (the float64 reference is slow)")
    dt = torch.bfloat16
    lay = Layer(name, dt)
    gen = torch.Generator(device="cuda").manual_seed(m)
    h = (3 * torch.randn(m, lay.hidden, generator=gen, device="cuda")).to(dt)
    attn = torch.randn(m, lay.o_k, generator=gen, device="cuda").to(dt)
    act = torch.randn(m, lay.f, generator=gen, device="cuda").to(dt)
    bias = torch.randn(lay.qkv_n, generator=gen, device="cuda").to(dt)
    _close(fl.norm_linear(h, lay.w_qkv, EPS), ref_norm_linear(h, lay.w_qkv), dt, "qkv")
    _close(fl.norm_linear(h, lay.w_qkv, EPS, bias), ref_norm_linear(h, lay.w_qkv, bias), dt, "bias")
    _close(
        fl.linear_residual(attn, lay.w_o, h), ref_linear_residual(attn, lay.w_o, h), dt, "o_proj"
    )
    _close(fl.norm_gate_up(h, lay.w_gu, EPS), ref_norm_gate_up(h, lay.w_gu), dt, "gate_up")
    _close(
        fl.linear_residual(act, lay.w_down, h),
        ref_linear_residual(act, lay.w_down, h),
        dt,
        "down",
    )
    torch.cuda.synchronize()
    assert (fl.workspace(h.device).counters == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype: torch.dtype) -> None:
    """fp16 and fp32 (IEEE products) at the qwen3-0.6b shapes, 7 rows."""
    lay = Layer("qwen3-0.6b", dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = (3 * torch.randn(7, lay.hidden, generator=gen, device="cuda")).to(dtype)
    act = torch.randn(7, lay.f, generator=gen, device="cuda").to(dtype)
    _close(fl.norm_linear(h, lay.w_qkv, EPS), ref_norm_linear(h, lay.w_qkv), dtype, "qkv")
    _close(fl.norm_gate_up(h, lay.w_gu, EPS), ref_norm_gate_up(h, lay.w_gu), dtype, "gate_up")
    _close(
        fl.linear_residual(act, lay.w_down, h),
        ref_linear_residual(act, lay.w_down, h),
        dtype,
        "down",
    )


@pytest.mark.parametrize("split", [1, 2, 4, 8, 16])
def test_forced_splits_match(split: int) -> None:
    """Every split count at the o_proj shape (K=2048) gives the float64 answer."""
    lay = Layer("qwen3-0.6b", torch.bfloat16)
    x = torch.randn(3, lay.o_k, device="cuda").to(torch.bfloat16)
    res = torch.randn(3, lay.hidden, device="cuda").to(torch.bfloat16)
    cfg = fl.LinearConfig(16, 64, 128, split, 4, 4)
    out = fl.linear_residual(x, lay.w_o, res, config=cfg)
    _close(out, ref_linear_residual(x, lay.w_o, res), torch.bfloat16, f"split {split}")


@pytest.mark.parametrize("tile", fl.WIDE_TILES)
@pytest.mark.parametrize("m", [128, 200, 256])
def test_wide_tiles_match_float64_every_time(tile: tuple, m: int) -> None:
    """The launch shapes the fused layer may time for 65..256 rows (128-token tiles, one
    warpgroup): the four GEMMs of a qwen3-0.6b layer match float64, twenty times each (an
    intermittently wrong tile, as 8-warp ones were under Triton 3.6, must fail here)."""
    dt = torch.bfloat16
    lay = Layer("qwen3-0.6b", dt)
    gen = torch.Generator(device="cuda").manual_seed(m)
    h = (3 * torch.randn(m, lay.hidden, generator=gen, device="cuda")).to(dt)
    attn = torch.randn(m, lay.o_k, generator=gen, device="cuda").to(dt)
    act = torch.randn(m, lay.f, generator=gen, device="cuda").to(dt)
    sms = fl.num_sms(h.device)
    cfg = {
        op: fl.with_split(tile, m, n, k, op == "gate_up", True, sms)
        for op, n, k in (
            ("qkv", lay.qkv_n, lay.hidden),
            ("o", lay.hidden, lay.o_k),
            ("gate_up", lay.f, lay.hidden),
            ("down", lay.hidden, lay.f),
        )
    }
    want = {
        "qkv": ref_norm_linear(h, lay.w_qkv),
        "o": ref_linear_residual(attn, lay.w_o, h),
        "gate_up": ref_norm_gate_up(h, lay.w_gu),
        "down": ref_linear_residual(act, lay.w_down, h),
    }
    for i in range(20):
        got = {
            "qkv": fl.norm_linear(h, lay.w_qkv, EPS, config=cfg["qkv"]),
            "o": fl.linear_residual(attn, lay.w_o, h, config=cfg["o"]),
            "gate_up": fl.norm_gate_up(h, lay.w_gu, EPS, config=cfg["gate_up"]),
            "down": fl.linear_residual(act, lay.w_down, h, config=cfg["down"]),
        }
        for op, out in got.items():
            _close(out, want[op], dt, f"{op} {cfg[op]} call {i}")
    torch.cuda.synchronize()
    assert (fl.workspace(h.device).counters == 0).all()


def _layer_chain(lay: Layer, h: torch.Tensor, attn: torch.Tensor, use_pdl: bool):
    """QKV, o_proj (+ residual), gate-up, down (+ residual): one layer's GEMMs without attention."""
    qkv = fl.norm_linear(h, lay.w_qkv, EPS, pdl=use_pdl)
    h1 = fl.linear_residual(attn, lay.w_o, h, pdl=use_pdl)
    act = fl.norm_gate_up(h1, lay.w_gu, EPS, pdl=use_pdl)
    h2 = fl.linear_residual(act, lay.w_down, h1, pdl=use_pdl)
    return qkv, h1, act, h2


@pytest.mark.parametrize("m", [1, 16, 64])
def test_graph_replay_with_pdl(m: int) -> None:
    """The chain captured in a CUDA graph (PDL on) and replayed over new inputs: float64-right
    each time, the same bits for the same inputs over 200 replays, counters zero."""
    lay = Layer("qwen3-0.6b", torch.bfloat16)
    dt = torch.bfloat16
    h = torch.zeros(m, lay.hidden, device="cuda", dtype=dt)
    attn = torch.zeros(m, lay.o_k, device="cuda", dtype=dt)
    fl.workspace(h.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside the capture
            _layer_chain(lay, h, attn, True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _layer_chain(lay, h, attn, True)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        h.copy_(3 * torch.randn(m, lay.hidden, generator=gen, device="cuda"))
        attn.copy_(torch.randn(m, lay.o_k, generator=gen, device="cuda"))
        graph.replay()
        qkv, h1, act, h2 = (t.clone() for t in outs)
        _close(qkv, ref_norm_linear(h, lay.w_qkv), dt, "graph qkv")
        _close(h1, ref_linear_residual(attn, lay.w_o, h), dt, "graph o_proj")
        _close(act, ref_norm_gate_up(h1, lay.w_gu), dt, "graph gate_up")
        _close(h2, ref_linear_residual(act, lay.w_down, h1), dt, "graph down")
        for _ in range(200):
            graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, (qkv, h1, act, h2), strict=True):
            assert torch.equal(got, want), "a replay changed the bits"
        assert (fl.workspace(h.device).counters == 0).all()


def test_unfused_kernels_with_pdl_in_a_graph() -> None:
    """rms_norm and silu_and_mul with PDL on, chained in a graph: the bits of PDL off."""
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(16, 6144, device="cuda", dtype=torch.bfloat16)

    def chain(on: bool):
        a, r = rmsnorm.rms_norm(x, w, EPS, res, pdl=on)
        b, _ = rmsnorm.rms_norm(a, w, EPS, r, pdl=on)
        return b, silu.silu_and_mul(gu, pdl=on)

    want = chain(False)
    chain(True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(True)
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    for got, ref in zip(outs, want, strict=True):
        assert torch.equal(got, ref)
