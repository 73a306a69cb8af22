"""Stream-K for :mod:`.fused_linear`'s GEMMs of few rows: every program the same K steps.

A decode GEMM of one row tile (``M <= BLOCK_M``) is bound by how evenly its weight bytes are
spread over the SMs. With whole tiles (or ``split_k`` equal parts of each) that spread is
coarse: llama3-8b's q|k|v at one row has 96 column tiles of 64, and with split 2 the busiest
of 132 SMs streams two half-tiles, 1.38 times the mean, which bounds it near 72% of the
copy rate (it read at 76% on an H100, 2026-12-07: 22.08 µs for 50.3 MB, and o at 72%), where
gate-up's 448 tiles read at 98%. Stream-K (Osama et al., PPoPP 2023) lays the ``TILES x
STEPS`` K steps of the whole GEMM end to end and gives each of ``P`` programs (about one an
SM) an equal run of ``per = cdiv(TILES x STEPS, P)`` of them: a program walks its run tile
by tile (a *segment* is its part of one tile), so no SM streams more than ``per`` steps.

A segment that covers its whole tile runs the epilogue itself (:func:`.skinny_steps._epilogue`:
row scale, bias, SiLU·mul, residual, one rounding). A tile cut between programs is summed
as split-K sums its splits: each of its segments writes its float32 partial accumulator(s)
and its rows' partial sum of squares to a workspace slot ``(tile, part)`` (``part``: the
program's place among the tile's programs, ``p - first``), then one ``acq_rel`` add on the
tile's arrival counter; the one that arrives last (the tile's ``last - first + 1``-th) sums
the parts in part order (the bits do not depend on arrival), runs the epilogue and zeroes
the counter. Nothing waits on another program (no spin: residency does not matter), and
every completed launch leaves the counters zero, so it is CUDA-graph safe; the workspace
and counters are :func:`.fused_linear.workspace`'s, shared by every launch on the device's
one stream, as split-K's.

PDL: the first weight tile(s) of the program's first segment load before ``gdc_wait()``;
``gdc_launch_dependents()`` follows the program's last segment.

Only the plain GEMMs (no LoRA inside) of one row tile take it: ``LinearConfig.stream_k``
(the programs, ``P``), which :func:`.fused_linear.tile_candidates` offers up to
``UNSPLIT_ROWS`` rows for the fused layer to time beside the split and unsplit shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops.launch_math import cdiv
from pitstop.plugins.kernels.triton_ops.skinny_steps import (
    _add_part,
    _epilogue,
    _k_product,
    _k_step,
    _load_k,
    _store_part,
)


class StreamKPlan(NamedTuple):
    """A stream-K launch: the column tiles, the K steps of each, the steps a program takes,
    the programs, and the most programs (parts) any one tile is cut into."""

    tiles: int
    steps: int
    per: int
    programs: int
    parts: int


def plan(n: int, k: int, block_n: int, block_k: int, programs: int) -> StreamKPlan:
    """The stream-K plan of an ``n``-column, ``k``-deep GEMM over at most ``programs``
    programs (fewer where each would take under one step; none is left without steps)."""
    tiles, steps = cdiv(n, block_n), cdiv(k, block_k)
    per = cdiv(tiles * steps, max(1, programs))
    used = cdiv(tiles * steps, per)
    return StreamKPlan(tiles, steps, per, used, cdiv(steps, per) + 1)


def workspace_floats(p: StreamKPlan, block_n: int, block_m: int, gate_up: bool) -> int:
    """The float32 partials a plan needs: each (tile, part) its accumulator(s) and sums of squares."""
    accs = 2 if gate_up else 1
    return p.tiles * p.parts * (accs * block_n * block_m + block_m)


@triton.jit(do_not_specialize=["M"])
def _stream_k_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    ws_ptr,
    sq_ptr,
    counters_ptr,
    M,
    N,
    K,
    eps,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_om,
    TILES,
    STEPS,
    PER,
    NORM: tl.constexpr,
    GATE_UP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    PARTS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    p = tl.program_id(0)
    start = p * PER
    end = tl.minimum(start + PER, TILES * STEPS)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    x_cols = x_ptr + tl.minimum(m, M - 1).to(tl.int64)[None, :] * stride_xm
    # the first segment's first weight tile(s) before the wait: they do not depend on the
    # previous kernel
    tile = start // STEPS
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn
    k = (start - tile * STEPS) * BLOCK_K + kk
    w = _load_k(w_rows + k[None, :], k, K, EVEN_K, 1)
    u = w
    if GATE_UP:
        u = _load_k(w_rows + N * stride_wn + k[None, :], k, K, EVEN_K, 1)
    _pdl.wait(PDL)
    it = start
    while it < end:
        tile = it // STEPS
        k0 = it - tile * STEPS
        k1 = tl.minimum(STEPS, k0 + (end - it))
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn
        k = k0 * BLOCK_K + kk
        if it != start:  # a later segment: its first weight tile(s) now
            w = _load_k(w_rows + k[None, :], k, K, EVEN_K, 1)
            if GATE_UP:
                u = _load_k(w_rows + N * stride_wn + k[None, :], k, K, EVEN_K, 1)
        xt = _load_k(x_cols + k[:, None], k, K, EVEN_K, 0)  # [BLOCK_K, BLOCK_M]
        zero = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc, acc_u, sq = _k_product(
            w, u, xt, zero, zero, tl.zeros([BLOCK_M], tl.float32), GATE_UP, NORM, UPCAST,
            DOT_PRECISION,
        )  # fmt: skip
        for step in range(k0 + 1, k1):
            acc, acc_u, sq, xt = _k_step(
                w_rows, x_cols, step * BLOCK_K + kk, K, acc, acc_u, sq, N, stride_wn, GATE_UP,
                NORM, EVEN_K, UPCAST, DOT_PRECISION,
            )  # fmt: skip
        if tile * STEPS + k1 >= end:  # the program's last segment: its loads are issued
            _pdl.launch_dependents(PDL)
        if (k0 == 0) & (k1 == STEPS):  # the whole tile here
            _epilogue(
                acc, acc_u, sq, n, m, M, N, K, eps, bias_ptr, res_ptr, out_ptr, stride_rm,
                stride_om, NORM, GATE_UP, HAS_BIAS, RESIDUAL,
            )  # fmt: skip
        else:  # a part of a cut tile: into its slot; the last part to arrive sums them
            first = (tile * STEPS) // PER
            last = ((tile + 1) * STEPS - 1) // PER
            slot = tile * PARTS + (p - first)
            _store_part(ws_ptr, sq_ptr, slot, acc, acc_u, sq, GATE_UP, NORM, BLOCK_N, BLOCK_M)
            # every thread's partial stores before the one thread's release
            tl.debug_barrier()
            counter = counters_ptr + tile
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == last - first:  # every other part is visible
                tl.debug_barrier()  # the acquire (one thread) before every thread's loads
                acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                sq = tl.zeros([BLOCK_M], tl.float32)
                # part order: the bits do not depend on arrival
                for part in range(0, last - first + 1):
                    acc, acc_u, sq = _add_part(
                        ws_ptr, sq_ptr, tile * PARTS + part, acc, acc_u, sq, GATE_UP, NORM,
                        BLOCK_N, BLOCK_M,
                    )  # fmt: skip
                _epilogue(
                    acc, acc_u, sq, n, m, M, N, K, eps, bias_ptr, res_ptr, out_ptr, stride_rm,
                    stride_om, NORM, GATE_UP, HAS_BIAS, RESIDUAL,
                )  # fmt: skip
                tl.store(counter, 0)  # zero again for the next launch (or graph replay)
        it = tile * STEPS + k1


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    eps: float | None,
    gate_up: bool,
    config: tuple,
    partials: torch.Tensor,
    counters: torch.Tensor,
    use_pdl: bool,
) -> bool:
    """Launch ``config`` (a :class:`.fused_linear.LinearConfig` with ``stream_k`` programs)
    over ``x`` into ``out``; False (nothing launched) where it does not apply: more rows than
    one row tile, or partials or tiles past the workspace."""
    m, k = x.shape
    n_out = out.shape[1]
    bm, bn, bk, _, warps, stages = config[:6]
    if m > bm:
        return False
    p = plan(n_out, k, bn, bk, config.stream_k)
    need = workspace_floats(p, bn, bm, gate_up)
    if need > partials.numel() or p.tiles > counters.numel():
        return False
    accs = 2 if gate_up else 1
    sq = partials[p.tiles * p.parts * accs * bn * bm :]
    on_gpu = x.device.type == "cuda"
    _stream_k_kernel[(p.programs,)](
        x,
        weight,
        bias if bias is not None else out,
        residual if residual is not None else out,
        out,
        partials,
        sq,
        counters,
        m,
        n_out,
        k,
        eps if eps is not None else 0.0,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        p.tiles,
        p.steps,
        p.per,
        NORM=eps is not None,
        GATE_UP=gate_up,
        HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None,
        PARTS=p.parts,
        EVEN_K=k % bk == 0,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        UPCAST=not on_gpu and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=use_pdl,
        num_warps=warps,
        num_stages=stages,
        **_pdl.launch_kwargs(use_pdl),
    )
    return True
