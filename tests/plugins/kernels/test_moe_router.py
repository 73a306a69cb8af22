"""The one-launch router (:mod:`pitstop.plugins.kernels.triton_ops.moe_router`): the router's
projection, routing and grouping of a decode step of few tokens, in Triton's interpreter
on the CPU (compiled on a GPU).

Truth: its routing is ``route_and_align`` of the logits it computed, bit for bit (float32
weights within a few ulp), and those
logits are ``x @ router.T`` in float64 within one rounding to the activation dtype; the
fused op given the router's weight is the op given those logits, bit for bit."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

import pytest  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from helpers.poison import poisoned_outputs  # noqa: E402

from pitstop.plugins.kernels.triton_ops import (  # noqa: E402
    fused_linear,
    moe,
    moe_router,
    moe_routing,
    moe_tiles,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# one rounding of the logits to the activation dtype, relative to the largest logit
ROUNDING = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _grouping_equal(a: moe_routing.Grouping, b: moe_routing.Grouping) -> bool:
    """The used rows, every block's expert and the used count (the buffers past the used
    rows are never written)."""
    n = int(a.num_padded)
    return (
        torch.equal(a.num_padded, b.num_padded)
        and torch.equal(a.sorted_rows[:n], b.sorted_rows[:n])
        and torch.equal(a.expert_ids, b.expert_ids)
    )


def _assert_one_row_blocks(
    grouping: moe_routing.Grouping, ids: torch.Tensor, sorted_by_expert: moe_routing.Grouping
) -> None:
    """One token's grouping: block ``j`` holds flat row ``j`` (expert ``ids[0, j]``) and the
    sentinel ``k`` in its other rows; the (row, expert) pairs of the grouping sorted by
    expert, in another block order."""
    k, bm = ids.shape[1], grouping.block_m
    assert int(grouping.num_padded) == k * bm == int(sorted_by_expert.num_padded)
    blocks = grouping.sorted_rows[: k * bm].view(k, bm).cpu()
    assert torch.equal(blocks[:, 0], torch.arange(k, dtype=blocks.dtype))
    assert (blocks[:, 1:] == k).all()
    assert torch.equal(grouping.expert_ids.cpu(), ids[0].cpu())
    want = sorted_by_expert.sorted_rows[: k * bm].view(k, bm).cpu()
    pairs = {(int(want[b, 0]), int(sorted_by_expert.expert_ids[b])) for b in range(k)}
    assert pairs == {(j, int(ids[0, j])) for j in range(k)}


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    t=st.integers(1, moe_router.FUSED_ROUTER_TOKENS),
    e=st.integers(1, 40),
    k_frac=st.floats(0, 1),
    h=st.sampled_from([16, 200, 600]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    renormalize=st.booleans(),
    norm=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(t=2, e=40, k_frac=0.2, h=600, dtype=torch.bfloat16, renormalize=True, norm=True, seed=1)
@example(t=1, e=1, k_frac=0.0, h=16, dtype=torch.float32, renormalize=False, norm=False, seed=2)
def test_router_route_align_is_route_and_align_of_its_logits(
    t: int,
    e: int,
    k_frac: float,
    h: int,
    dtype: torch.dtype,
    renormalize: bool,
    norm: bool,
    seed: int,
) -> None:
    """Bit for bit the ids and grouping of ``route_and_align`` of the logits it returns, and
    its 16-bit weights (float32 weights within a few ulp: on a GPU the two kernels' softmax
    sums may reduce in different orders); the logits within one rounding of float64 ``x @ router.T`` (H 600: three
    hidden splits, the last a part one; E 40: three expert programs, the last a part one),
    with ``norm_eps`` of ``(x / rms(x)) @ router.T``, and the row scale it returns within
    float32 rounding of ``1 / rms(x)``; the arrival counter zero again after the launch."""
    top_k = 1 + round(k_frac * (min(e, 16) - 1))
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(t, h, generator=gen)).to(dtype).to(DEVICE)
    router = (torch.randn(e, h, generator=gen) / h**0.5).to(dtype).to(DEVICE)
    wdt = None if dtype == torch.float32 else dtype
    eps = 1e-6 if norm else None
    with poisoned_outputs():
        weights, ids, grouping, logits, row_scale = moe_router.router_route_align(
            x, router, top_k, renormalize, wdt, 16, eps
        )
        want = moe_routing.route_and_align(logits, top_k, renormalize, wdt, 16)
    assert torch.equal(ids, want[1])
    if t == 1:  # one row a block, in slot order; the same rows and experts as want's
        _assert_one_row_blocks(grouping, ids, want[2])
    else:
        assert _grouping_equal(grouping, want[2])
    if wdt is None:  # float32 weights: the softmax's sum may reduce in another order (GPU)
        torch.testing.assert_close(weights, want[0], rtol=4e-7, atol=0)
    else:
        assert torch.equal(weights, want[0])
    truth = x.double() @ router.double().T
    if norm:
        rstd = (x.double().pow(2).mean(-1, keepdim=True) + eps).rsqrt()
        truth = truth * rstd
        assert row_scale is not None and row_scale.dtype == torch.float32
        assert torch.allclose(row_scale.double(), rstd[:, 0], rtol=1e-5, atol=0)
    else:
        assert row_scale is None
    err = ((logits.double() - truth).abs().max() / truth.abs().max().clamp_min(1e-6)).item()
    assert err <= ROUNDING[dtype], f"logits off by {err:.3g}"
    assert not fused_linear.workspace(x.device).counters.any(), "a counter left non-zero"


@pytest.mark.parametrize("t", [1, 2, 3])
def test_fused_moe_with_the_router_is_fused_moe_of_its_logits(t: int) -> None:
    """``fused_moe(x, None, router=W)``: up to two tokens the one-launch router, bit for bit
    the op over the logits it computed; three tokens take ``x @ W.T`` by torch first."""
    e, h, f, top_k = 12, 80, 24, 3
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=gen).bfloat16().to(DEVICE)
    router = (torch.randn(e, h, generator=gen) / h**0.5).bfloat16().to(DEVICE)
    gate_up = (torch.randn(e, 2 * f, h, generator=gen) / h**0.5).bfloat16().to(DEVICE)
    down = (torch.randn(e, h, f, generator=gen) / f**0.5).bfloat16().to(DEVICE)
    config = moe_tiles.INTERPRETER_CONFIG if DEVICE.type == "cpu" else None
    kw = dict(renormalize=True, weights_dtype=torch.bfloat16, config=config)
    with poisoned_outputs():
        out = moe.fused_moe(x, None, gate_up, down, top_k, router=router, **kw)
    if moe_router.fuses_router(t, top_k):
        logits = moe_router.router_route_align(x, router, top_k, True, torch.bfloat16, 16)[3]
    else:
        logits = torch.nn.functional.linear(x, router)
    assert torch.equal(out, moe.fused_moe(x, logits, gate_up, down, top_k, **kw))


def test_fuses_router_thresholds() -> None:
    """One and two tokens, while one program groups their rows (top-8: 16 rows; 128 at most)."""
    assert moe_router.FUSED_ROUTER_TOKENS == 2
    assert [moe_router.fuses_router(t, 8) for t in (0, 1, 2, 3)] == [False, True, True, False]
    assert not moe_router.fuses_router(1, 129) and moe_router.fuses_router(2, 64)


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("plan", ["grouped", "token-major"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_residual_add_inside_the_op_is_adding_the_tensors(
    plan: str, dtype: torch.dtype, t: int
) -> None:
    """``experts(..., residual=r)`` is ``r + experts(...)`` bit for bit (the slot sum adds it,
    for one token inside the grouped down's last program; the token-major down, which has
    no slot sum, adds it after), and ``fused_moe`` passes it on, the one-launch router's
    path included."""
    e, h, f, top_k = 6, 40, 24, 2
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(t, h, generator=gen).to(dtype).to(DEVICE)
    router = (torch.randn(e, h, generator=gen) / h**0.5).to(dtype).to(DEVICE)
    gate_up = (torch.randn(e, 2 * f, h, generator=gen) / h**0.5).to(dtype).to(DEVICE)
    down = (torch.randn(e, h, f, generator=gen) / f**0.5).to(dtype).to(DEVICE)
    residual = (10 * torch.randn(t, h, generator=gen)).to(dtype).to(DEVICE)
    weights, ids = moe_routing.route(torch.nn.functional.linear(x, router), top_k, True, dtype)
    config = moe_tiles.INTERPRETER_CONFIG if DEVICE.type == "cpu" else None
    chosen = moe_tiles.GROUPED if plan == "grouped" else moe_tiles.fewest_launches(t, top_k)
    args = (x, weights, ids, gate_up, down)
    before = residual.clone()
    with poisoned_outputs():
        plain = moe.experts(*args, config=config, plan=chosen)
        added = moe.experts(*args, config=config, plan=chosen, residual=residual)
    assert torch.equal(added, residual + plain)
    assert torch.equal(residual, before)  # read, not written
    kw = dict(renormalize=True, weights_dtype=dtype, config=config, router=router)
    for n in sorted({1, t}):  # the one-launch router's step, and the logits' path
        # on a GPU the first call of a batch size tunes on torch's logits and later ones route
        # in the one-launch router (float32 logits of its own sums): compare two tuned calls
        moe.fused_moe(x[:n], None, gate_up, down, top_k, **kw)
        out = moe.fused_moe(x[:n], None, gate_up, down, top_k, **kw)
        got = moe.fused_moe(x[:n], None, gate_up, down, top_k, residual=residual[:n], **kw)
        assert torch.equal(got, residual[:n] + out)


@pytest.mark.parametrize("t", [1, 2, 3])
def test_the_norm_folded_into_the_op_is_the_norm_before_it(t: int) -> None:
    """``fused_moe(x, None, router=W * g, gate_up=G * g, norm_eps=eps)`` (the un-normalized
    stream, the norm's gain folded into the weights) within float32 summation order of the
    reference loop over ``rms_norm(x) * g`` with the unfolded weights (fp32): up to two
    tokens the one-launch router takes each token's 1/rms and the gate-up GEMM applies it,
    three tokens normalize first; the residual add inside the op as well."""
    from pitstop.plugins.kernels import reference

    e, h, f, top_k, eps = 6, 40, 24, 2, 1e-6
    dtype = torch.float32
    gen = torch.Generator().manual_seed(5)
    x = (4 * torch.randn(t, h, generator=gen)).to(DEVICE)
    gain = (0.5 + torch.rand(h, generator=gen)).to(DEVICE)
    router = (torch.randn(e, h, generator=gen) / h**0.5).to(DEVICE)
    gate_up = (torch.randn(e, 2 * f, h, generator=gen) / h**0.5).to(DEVICE)
    down = (torch.randn(e, h, f, generator=gen) / f**0.5).to(DEVICE)
    residual = torch.randn(t, h, generator=gen).to(DEVICE)
    normed = x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * gain
    logits = torch.nn.functional.linear(normed, router)
    want = reference.moe(
        normed, logits, gate_up, down, top_k, renormalize=True, weights_dtype=dtype
    )
    config = moe_tiles.INTERPRETER_CONFIG if DEVICE.type == "cpu" else None
    kw = dict(renormalize=True, weights_dtype=dtype, config=config, router=router * gain)
    folded = (x, None, gate_up * gain[None, None, :], down, top_k)
    moe.fused_moe(*folded, norm_eps=eps, **kw)  # a GPU's first call of a batch size tunes
    with poisoned_outputs():
        got = moe.fused_moe(*folded, norm_eps=eps, **kw)
        added = moe.fused_moe(*folded, norm_eps=eps, residual=residual, **kw)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    assert torch.equal(added, residual + got)
