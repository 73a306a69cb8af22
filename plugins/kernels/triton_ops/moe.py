"""Fused mixture-of-experts: routing, grouping, two grouped GEMMs, a k-slot sum; no tuning tables.

:func:`fused_moe` runs a sparse-MoE block's expert half in five launches (:func:`launch_plan`,
the one place that decides: the grouped path, measured fastest), or in the fewest a batch
allows with ``plan=`` :func:`.moe_tiles.fewest_launches` (:attr:`LaunchPlan.launches`):

- ``T <= TOKEN_MAJOR_TOKENS`` (4): **three** -- route+align (1+2 below), gate-up (3), down
  with the slot sum (4+5 below, token-major);
- ``T * k <= ONE_PROGRAM_ROWS`` (128 flat rows; top-8: ``T <= 16``): **four** -- route+align,
  gate-up, grouped down (4), slot sum (5);
- above: **five** -- route (1), align (2), gate-up, grouped down, slot sum -- and two
  memsets of the routing counters.

One token (any plan with the grouped down, unsplit): the down GEMM's programs count
themselves in their column tile's arrival counter (the fused linear ops' counters, as a
split gate-up does) and the last of the token's ``k`` row blocks adds the ``k`` slots (and
the residual) as the slot-sum kernel would, with its bits: one launch fewer. With the
one-launch router (:mod:`.moe_router`) a decode step of one token is then three launches:
router, gate-up, down.

Every one of these kernels is chained by programmatic dependent launch (:mod:`.pdl`, on
Hopper): each waits for the kernel before it first thing, and lets the next one's programs
queue once its own inputs are read (the routing kernels at once, the GEMMs and the slot
sum after their K loops), so a launch's start overlaps the previous kernel's tail. The
one-launch router loads its weights before its wait. (Reading the down GEMM's grouping and
first weight tile before its wait was tried on an H100 on 2026-12-06 and removed: batch 1's
down GEMM took 14.6 µs against 12.7 in the same call.)

1. :func:`.moe_routing.route`: softmax + top-k + renormalisation, counting each expert's rows
   (above ``ONE_PROGRAM_ROWS``; at most, :func:`.moe_routing.route_and_align` does this
   step and the next in one program, the same bits, and counts nothing);
2. :func:`.moe_routing.align`: the flat rows ``t * k + j`` grouped by expert, each expert
   padded to ``BLOCK_M`` rows (fixed worst-case buffers: CUDA-graph capturable);
3. gate-up grouped GEMM: program ``(b, n)`` takes row block ``b`` (one expert ``e``, or
   nothing: a block past the used ones returns at once, so an expert with no row costs
   nothing) and columns ``n`` of both halves of ``gate_up[e] [2F, H]``: two float32
   accumulators (gate rows ``n``, up rows ``F + n``) over the gathered ``x`` rows, then
   ``silu(g) * u`` in the epilogue, rounded once to ``x``'s dtype into ``h [T*k, F]``;
4. down grouped GEMM over ``down[e] [H, F]``: the float32 accumulator times the row's
   routing weight (in float32) stored, unrounded, to ``y [T*k, H]`` (float32);
5. the k-slot sum: ``out[t] = sum_j y[t * k + j]`` in slot order, one rounding.

Token-major down (``T <= 4`` under :func:`.moe_tiles.fewest_launches`, not the default;
:func:`_down_slot_sum_kernel`, steps 4 and 5 in one launch):
program ``(t, c)`` owns token ``t``'s columns ``c`` and all its k slots (slot ``j``: row
``h[t*k + j]``, expert ``ids[t, j]``, weight ``rw[t, j]``), each slot's float32 dot times its
row scales (fp8) and then its weight, as step 4's epilogue; the slots added in order from
zero, as step 5, and rounded once into ``out``: no ``y``. Its tiles are a fixed rule
(:func:`token_major_tiles`), not the config's. Bits: the same as steps 4 + 5 wherever each
slot's float32 dot is exact (small integers, power-of-two scales and weights: a test);
otherwise they differ only by the order of each dot's float32 sum over ``F`` (products of
16-bit or e4m3 operands are exact in float32; float32 activations' are rounded), so they
agree within rounding, not bit for bit.

Split-K (``MoEConfig.split_k``, issue 48): at decode the grids are too small to stream the
experts at HBM rate (batch 1 of Qwen3-30B-A3B: 8 row blocks x 12 column tiles = 96
gate-up programs on 132 SMs, each walking K = 2048 alone), so each GEMM can split its K
into runs of whole ``BLOCK_K`` chunks (:func:`effective_split`: at most ``split_k``, none
empty; a grid dimension ``s``), with no float atomics:

- gate-up, ``S`` splits > 1 (:func:`gate_up_split`): split ``s`` stores its float32 gate and
  up sums, unscaled, to its own slice of ``g [S, T*k, 2F]`` (``[s, row, n]`` and ``[s,
  row, F + n]``) and counts itself in its tile's arrival counter; the program that arrives
  last sums the ``S`` slices in split order (so the bits do not depend on which one that
  is), runs the unsplit epilogue (scales, ``silu(g) * u``, one rounding into ``h``) and
  zeroes the counter, so every finished launch leaves the counters zero (no memset: CUDA-
  graph safe). The counters and the memory ordering are the fused linear ops' split-K
  (:func:`.fused_linear.workspace`, one atomic ``acq_rel`` add a program; nothing waits on
  another program). Before 2026-12-06 the down GEMM summed the slices instead, at each of
  its K steps and in each of its column tiles: every split lost on the H200.
- down, ``S'`` splits (of ``F``): split ``s`` stores ``rw * (its partial)`` to
  ``y [S', T*k, H]``; the k-slot sum adds, per slot in order, its splits in order:
  ``out[t] = sum_j sum_s y[s, t*k + j]``, one rounding.

Bits: a given config and path gives the same bits on every run and replay and whatever
the batch's other rows (fixed-order sums; the path, like the autotuned config, follows the
batch size, so a token's bits may change where ``T`` crosses a threshold). Split and
unsplit differ only by the float32 re-association of the K sums (``(d0 + d1) + (d2 + d3)``
for ``((d0 + d1) + d2) + d3``), the routing weight applied per partial, and the order of
the final sum over splits: where every float32 sum is exact (small integers, power-of-two
scales and weights: a test) every split gives the unsplit bits; in general they agree
within rounding, not bit for bit.

fp8 experts (``scales`` given): ``gate_up`` and ``down`` are e4m3 with one float32 scale
per output row; the GEMMs are weight-only, as the ``fp8`` format's skinny GEMM: each
weight tile is widened to the activations' dtype in registers (exact) and the float32
accumulators are multiplied by their columns' scales before the epilogue (a split
gate-up's: after the sum over splits), so a step
reads half the expert bytes of bf16 and the activations are not rounded to fp8.

Reduction: the deterministic sum over the k slots (and splits) (5) rather than float32
atomics into ``[T, H]``: atomics add a token's k rows in whatever order the programs run,
so the bits change from run to run (and with the batch's composition), and they need a
zeroed buffer (a memset per call). The cost (none under the token-major down, which has
no ``y``) is ``y``'s float32 round trip, ``T*k*H*8``
bytes (decode: tens of KB; 2048 tokens of Qwen3-30B-A3B: 268 MB, ~60 us at HBM speed,
beside ~0.4 ms of GEMMs), times the down's splits (decode only: hundreds of KB at most),
plus ``g``'s ``S * T*k * 2F * 8`` with a split gate-up (decode only). Rounding: products of
the activation dtype accumulated in float32; SiLU·mul and the weight product in float32;
``h`` and ``out`` are the only roundings (transformers rounds every intermediate to the
activation dtype).

Tiles (:func:`choose_config`; the configs, plan and cache live in :mod:`.moe_tiles`): a
short autotune at the first call of a shape bucket
(``T`` rounded up to a power of two, with ``E``, ``k``, ``H``, ``F``), timing a handful of
:class:`MoEConfig` on the call's activations and experts with spread routing
(:func:`.moe_tiles.spread_routing`: the runner's warm-up rows are all one token) (replays
of a CUDA graph: :func:`.tuning.time_replays`;
no split: splits lost at every measured batch; the timed calls run the default plan: a
first round with the same tiles in both grouped GEMMs, a second with the winner's gate-up
and the down GEMM's own tiles, those of the candidates of its height and
:data:`.moe_tiles.DOWN_TILES`, :func:`.moe_tiles.autotune`); the winner is cached in
memory and on disk (:class:`ConfigCache`, JSON in ``$PITSTOP_CACHE_DIR`` or ``~/.cache/pitstop/moe``, keyed by
the bucket, dtype, device name, Triton version and :data:`.moe_tiles.KERNEL_REVISION`).
Where timing is impossible (Triton's interpreter, or a CUDA graph being captured) and the
bucket is not cached, :func:`heuristic_config` decides, and that is logged once per
reason. Entries cached before split-K (5 fields) read as ``split_k`` 1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops import tuning
from pitstop.plugins.kernels.triton_ops.fused_linear import NUM_COUNTERS, workspace
from pitstop.plugins.kernels.triton_ops.launch_math import cdiv, next_power_of_2
from pitstop.plugins.kernels.triton_ops.moe_router import fuses_router, router_route_align
from pitstop.plugins.kernels.triton_ops.moe_routing import (
    Grouping,
    align,
    counts_needed,
    route,
    route_and_align,
)
from pitstop.plugins.kernels.triton_ops.moe_tiles import (
    DOWN_TILES,
    ConfigCache,
    LaunchPlan,
    MoEConfig,
    autotune,
    candidates,
    config_key,
    default_cache,
    early_down_columns,
    effective_split,
    known_config,
    launch_plan,
    spread_routing,
    token_major_tiles,
)
from pitstop.plugins.kernels.triton_ops.rmsnorm import rms_norm, unit_gain
from pitstop.plugins.kernels.triton_ops.rope_store import _rounded
from pitstop.plugins.kernels.triton_ops.skinny_steps import _load_k


def choose_config(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    cache: ConfigCache | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> MoEConfig:
    """The tiles for this call: cached, else autotuned, else heuristic.

    The heuristic (:func:`heuristic_config`) is used, and logged once per reason, in
    Triton's interpreter and while a CUDA graph is being captured (a capture cannot time;
    run each batch size once before capturing so the bucket is tuned and cached). The
    timed calls run :func:`experts` on this call's ``x`` and experts but on
    :func:`.moe_tiles.spread_routing` of its shape, not its own ``weights``/``ids`` (the
    runner's warm-up routes every row to the same experts), as :func:`launch_plan` has it
    for the batch (the grouped path: the config's tiles time both GEMMs; under a ``plan=``
    with the token-major down, which has fixed tiles, they matter to the gate-up alone).
    """
    t, top_k = ids.shape
    known = known_config(x, t, top_k, gate_up, cache)
    if known is not None:
        return known
    cache = cache or default_cache()
    key = config_key(x, t, top_k, gate_up)
    weights, ids = spread_routing(t, gate_up.shape[0], top_k, weights.dtype, x.device)

    def measure(cfg: MoEConfig) -> float:
        return tuning.time_replays(
            lambda: experts(x, weights, ids, gate_up, down, config=cfg, scales=scales)
        )

    configs = candidates(t, gate_up.shape[0], top_k, x.dtype)
    down_tiles = DOWN_TILES if x.dtype != torch.float32 else ()
    return autotune(key, configs, measure, cache, down_tiles)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b`` in float32 (``UPCAST``: on float32 copies, for the interpreter, whose
    16-bit products are wrong; the same exact products, float32 sums)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _k_loop(
    a_ptr,
    a_rows,
    stride_am,
    w_base,
    u_offset,
    k_lo,
    k_hi,
    K,
    GATE_UP: tl.constexpr,
    W_SCALED: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The K loop: ``acc[BLOCK_M, BLOCK_N] += a[rows, k] @ w[n, k].T`` (and ``acc_u`` over
    the up rows ``u_offset`` further on); ``w_base`` the ``[1, BLOCK_N]`` pointers of the
    tile's weight rows. (Blocks of 16 rows compile to ``mma.sync`` on sm_90; "swap AB", the
    weight rows on the M side of the warpgroup MMA, compiled to ``wgmma`` and measured no
    faster on an H100 on 2026-12-06: batch 1 the same, batch 8 6% slower.)"""
    kk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        a = _load_k(a_base + k[None, :], k, K, EVEN_K, 1)
        w = _load_k(w_base + k[:, None], k, K, EVEN_K, 0)
        if W_SCALED:
            w = w.to(a.dtype)
        acc = _dot(a, w, acc, UPCAST, DOT_PRECISION)
        if GATE_UP:
            u = _load_k(w_base + u_offset + k[:, None], k, K, EVEN_K, 0)
            if W_SCALED:
                u = u.to(a.dtype)
            acc_u = _dot(a, u, acc_u, UPCAST, DOT_PRECISION)
    return acc, acc_u


@triton.jit
def _silu_mul_store(
    acc, acc_u, s_base, NOUT, out, mask, rs, W_SCALED: tl.constexpr, ROW_SCALED: tl.constexpr
):
    """The gate-up epilogue: both sums times their columns' scales (``W_SCALED``: ``s_base``
    the gate columns' scale pointers) and, ``ROW_SCALED``, their rows' factors ``rs
    [BLOCK_M]`` (a folded RMSNorm's ``1/rms``), ``silu(g) * u`` in float32, one rounding
    into ``out``."""
    if W_SCALED:
        acc = acc * tl.load(s_base)[None, :]
        acc_u = acc_u * tl.load(s_base + NOUT)[None, :]
    if ROW_SCALED:
        acc = acc * rs[:, None]
        acc_u = acc_u * rs[:, None]
    acc = acc / (1.0 + tl.exp(-acc)) * acc_u
    dt: tl.constexpr = out.dtype.element_ty
    tl.store(out, _rounded(acc, dt).to(dt), mask=mask)


@triton.jit(do_not_specialize=["N"])
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    counters_ptr,
    rw_ptr,
    ws_ptr,
    rs_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    res_ptr,
    final_ptr,
    N,
    NOUT,
    K,
    K_PER_SPLIT,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_os,
    stride_ps,
    stride_se,
    TOPK: tl.constexpr,
    GATE_UP: tl.constexpr,
    SPLIT_K: tl.constexpr,
    W_SCALED: tl.constexpr,
    ROW_SCALED: tl.constexpr,
    SLOT_SUM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_DEPENDENTS: tl.constexpr = False,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of a row block's expert GEMM over one K split.

    Program ``(b, n, s)``: row block ``b``, columns ``n``, ``K`` range ``[s * K_PER_SPLIT,
    (s + 1) * K_PER_SPLIT)`` (``K_PER_SPLIT`` a multiple of ``BLOCK_K``; no split is empty).

    ``GATE_UP``: ``a`` is ``x [T, H]`` read at token ``row // TOPK``; ``w [E, 2F, H]``; the
    output ``silu(a @ w[e, n].T) * (a @ w[e, F + n].T)`` rounded into ``h [T*k, F]``. With
    ``SPLIT_K > 1`` each split stores its float32 gate and up sums to its own slice of
    ``part [SPLIT_K, T*k, 2F]`` (``stride_ps`` a split), then counts itself in the tile's
    arrival counter; the last to arrive sums the slices in split order and runs the epilogue
    (module doc), then zeroes the counter. Else ``a`` is ``h [T*k, F]`` read at ``row``,
    ``w [E, H, F]``, and this split's float32 ``rw[row] * (a @ w[e, n].T)`` goes to
    ``y [SPLIT_K, T*k, H]`` (``stride_os`` a split), which the slot sum adds up.
    ``N = T * k`` (also the sentinel). ``W_SCALED``: ``w`` is e4m3, widened to the
    activations' dtype per tile; the accumulators are multiplied by the row scales
    ``ws [E, NOUT or 2F]`` of their columns. ``ROW_SCALED`` (gate-up only): both sums
    times ``rs[token]`` (float32 ``[T]``) before SiLU·mul: an RMSNorm folded into the op,
    ``x`` un-normalized and its gain in ``w``. ``SLOT_SUM`` (down, one token, unsplit):
    each program then counts itself in its column tile's arrival counter, and the last of
    the ``TOPK`` row blocks sums the ``TOPK`` rows of ``y`` in slot order into ``final [1,
    H]`` as :func:`_slot_sum_kernel` does (``RESIDUAL``: ``res +`` that), so no slot-sum
    launch follows. ``EARLY_DEPENDENTS``: the next kernel's programs may launch once this
    one's have waited (:attr:`.moe_tiles.LaunchPlan.early_down`), not after their K loops.
    """
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    _pdl.wait(PDL)  # the grouping and the activations come from the kernels before
    if EARLY_DEPENDENTS:  # the early down GEMM: its programs read their weights meanwhile
        _pdl.launch_dependents(PDL)
    # the used blocks' count and this block's expert in one round trip (the grid is the
    # grouping's worst case, so block b's entry exists). A used block's expert is never
    # negative (-1 marks an unused block where the grouping writes one; past the used blocks
    # it may be unwritten, and the count decides): testing it keeps its load above the
    # branch, where the compiler would otherwise sink it (sm_90 SASS), so the weights' first
    # loads need not wait for a second round trip
    total = tl.load(total_ptr)
    e = tl.load(expert_ids_ptr + b).to(tl.int64)
    if (b * BLOCK_M >= total) | (e < 0):
        return  # past the used blocks: no expert, no work
    rows = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < N
    if GATE_UP:
        a_rows = tl.where(valid, rows // TOPK, 0)
    else:
        a_rows = tl.where(valid, rows, 0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + e * stride_we + tl.minimum(n, NOUT - 1).to(tl.int64) * stride_wn
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc, acc_u = _k_loop(
        a_ptr, a_rows, stride_am, w_rows[None, :], NOUT * stride_wn, k_lo, k_hi, K,
        GATE_UP, W_SCALED, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    if not EARLY_DEPENDENTS:
        _pdl.launch_dependents(PDL)
    mask = valid[:, None] & (n < NOUT)[None, :]
    row_offsets = rows.to(tl.int64)[:, None] * stride_om + n[None, :]
    s_base = ws_ptr + e * stride_se + tl.minimum(n, NOUT - 1)
    if GATE_UP:
        rs = tl.zeros([BLOCK_M], tl.float32)
        if ROW_SCALED:
            rs = tl.load(rs_ptr + a_rows, mask=valid, other=0.0)
        if SPLIT_K == 1:
            _silu_mul_store(
                acc, acc_u, s_base, NOUT, out_ptr + row_offsets, mask, rs, W_SCALED, ROW_SCALED
            )
        else:
            # the partials' row layout is h's over 2F columns: gate at n, up at F + n
            part = part_ptr + rows.to(tl.int64)[:, None] * (2 * NOUT) + n[None, :]
            tl.store(part + pid_k.to(tl.int64) * stride_ps, acc, mask=mask)
            tl.store(part + pid_k.to(tl.int64) * stride_ps + NOUT, acc_u, mask=mask)
            # every thread's stores before the one thread's release (fused_linear's ordering)
            tl.debug_barrier()
            counter = counters_ptr + b * tl.num_programs(1) + pid_n
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the last split of this tile: every partial is visible
                tl.debug_barrier()  # the acquire (one thread) before every thread's loads
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                p = part
                for _ in tl.static_range(SPLIT_K):  # split order: bits independent of arrival
                    acc += tl.load(p, mask=mask, other=0.0, cache_modifier=".cg")
                    acc_u += tl.load(p + NOUT, mask=mask, other=0.0, cache_modifier=".cg")
                    p += stride_ps
                _silu_mul_store(
                    acc, acc_u, s_base, NOUT, out_ptr + row_offsets, mask, rs, W_SCALED, ROW_SCALED
                )
                tl.store(counter, 0)  # zero again for the next launch (or graph replay)
    else:
        if W_SCALED:
            acc = acc * tl.load(s_base)[None, :]
        rw = tl.load(rw_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        out = out_ptr + pid_k.to(tl.int64) * stride_os + row_offsets
        tl.store(out, acc * rw[:, None], mask=mask)
        if SLOT_SUM:  # one token: the last of its TOPK row blocks sums the slots (module doc)
            _last_block_sums_slots(
                counters_ptr + pid_n, out_ptr, stride_om, n, n < NOUT, res_ptr, final_ptr,
                TOPK, RESIDUAL,
            )  # fmt: skip


@triton.jit
def _slot_sum_kernel(
    y_ptr,
    res_ptr,
    out_ptr,
    H,
    stride_ys,
    TOPK: tl.constexpr,
    SPLITS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[t, h] = sum_j sum_s y[s, t * TOPK + j, h]``: slots in order, each slot's splits
    in order, one rounding; ``RESIDUAL``: then ``res[t, h] +`` that, rounded again (the bits
    of adding the two tensors in their dtype)."""
    _pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = h < H
    acc = _slot_sums(y_ptr + t * TOPK * H, stride_ys, H, h, mask, TOPK, SPLITS)
    _pdl.launch_dependents(PDL)
    _store_slot_sum(acc, res_ptr + t * H, out_ptr + t * H, h, mask, RESIDUAL)


@triton.jit
def _slot_sums(y_ptr, stride_ys, row_stride, h, mask, TOPK: tl.constexpr, SPLITS: tl.constexpr):
    """``sum_j sum_s y[s, j, h]`` over one token's ``TOPK`` rows (``y_ptr`` its first),
    slots in order, each slot's splits in order, in float32 (loads past L1: in the down
    GEMM's last program other programs wrote them)."""
    acc = tl.zeros(h.shape, tl.float32)
    for j in tl.static_range(TOPK):
        p = y_ptr + j * row_stride + h
        for _ in tl.static_range(SPLITS):  # 64-bit pointer steps: no int32 product to overflow
            acc += tl.load(p, mask=mask, other=0.0, cache_modifier=".cg")
            p += stride_ys
    return acc


@triton.jit
def _last_block_sums_slots(
    counter,
    y_ptr,
    row_stride,
    h,
    mask,
    res_ptr,
    out_ptr,
    TOPK: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    """One token's down GEMM, after a program stored its slot's float32 row of columns ``h``
    to ``y``: it counts itself in its column tile's arrival ``counter``, and the last of the
    ``TOPK`` programs sums the slots in order into ``out`` (``RESIDUAL``: ``res +`` that) as
    :func:`_slot_sum_kernel` does, then zeroes the counter (memory ordering: the fused linear
    ops' split-K, :func:`.fused_linear.workspace`)."""
    tl.debug_barrier()  # every thread's stores before the one thread's release
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == TOPK - 1:  # every slot's row of these columns is visible
        tl.debug_barrier()  # the acquire (one thread) before every thread's loads
        acc = _slot_sums(y_ptr, 0, row_stride, h, mask, TOPK, 1)
        _store_slot_sum(acc, res_ptr, out_ptr, h, mask, RESIDUAL)
        tl.store(counter, 0)  # zero again for the next launch (or graph replay)


@triton.jit
def _store_slot_sum(acc, res_ptr, out_ptr, h, mask, RESIDUAL: tl.constexpr):
    """A token's slot sum rounded once into ``out_ptr[h]``; ``RESIDUAL``: then ``res[h] +``
    that, rounded again (the bits of adding the two tensors in their dtype)."""
    dt: tl.constexpr = out_ptr.dtype.element_ty
    o = _rounded(acc, dt).to(dt)
    if RESIDUAL:
        r = tl.load(res_ptr + h, mask=mask, other=0.0).to(tl.float32)
        o = _rounded(r + o.to(tl.float32), dt).to(dt)
    tl.store(out_ptr + h, o, mask=mask)


@triton.jit
def _down_early_kernel(
    h_ptr,
    w_ptr,
    ws_ptr,
    rw_ptr,
    sorted_ptr,
    expert_ids_ptr,
    y_ptr,
    counters_ptr,
    res_ptr,
    out_ptr,
    NOUT,
    F,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    F_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    W_SCALED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token's down GEMM and slot sum with its weights read before its wait
    (:attr:`.moe_tiles.LaunchPlan.early_down`).

    Program ``(b, n)``: row block ``b`` (one token's: one flat row, one expert) and columns
    ``n`` of ``H``. Before its wait it reads the block's expert and row (the grouping, whose
    kernel the gate-up GEMM waited for before it let this grid launch; past L1) and the whole
    ``[F, BLOCK_N]`` weight tile ``w[e, n, :]`` into registers; then it waits for the gate-up
    GEMM, reads the row of ``h`` and stores ``rw[row] * (w @ h[row])`` (float32; times the
    columns' row scales where ``W_SCALED``) to ``y [T*k, H]``, and counts itself in its
    column tile's arrival counter: the last of the ``TOPK`` blocks sums the slots in order
    into ``out`` (``RESIDUAL``: ``res +`` that), as the grouped down GEMM's one-token
    epilogue does. Bits: each slot's float32 sum over ``F`` in another order than the
    grouped GEMM's, so within rounding of it."""
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ids_ptr + b, cache_modifier=".cg").to(tl.int64)
    row = tl.load(sorted_ptr + b * BLOCK_M, cache_modifier=".cg")
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    f = tl.arange(0, F_PAD)
    cols = n < NOUT
    f_in = f < F
    w_cols = w_ptr + e * stride_we + tl.minimum(n, NOUT - 1).to(tl.int64)[None, :] * stride_wn
    w = tl.load(w_cols + f[:, None], mask=f_in[:, None], other=0.0)  # [F_PAD, BLOCK_N]
    _pdl.wait(PDL)  # h comes from the gate-up GEMM
    a = tl.load(h_ptr + row.to(tl.int64) * stride_h + f, mask=f_in, other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * a[:, None], axis=0)  # [BLOCK_N]
    _pdl.launch_dependents(PDL)
    if W_SCALED:
        acc = acc * tl.load(ws_ptr + e * stride_se + tl.minimum(n, NOUT - 1))
    rw = tl.load(rw_ptr + row).to(tl.float32)
    tl.store(y_ptr + row.to(tl.int64) * NOUT + n, acc * rw, mask=cols)
    _last_block_sums_slots(
        counters_ptr + pid_n, y_ptr, NOUT, n, cols, res_ptr, out_ptr, TOPK, RESIDUAL
    )


@triton.jit
def _down_slot_sum_kernel(
    h_ptr,
    w_ptr,
    ws_ptr,
    ids_ptr,
    rw_ptr,
    out_ptr,
    H,
    F,
    stride_hm,
    stride_we,
    stride_wn,
    stride_se,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    W_SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[t, n] = sum_j rw[t, j] * (h[t*k + j] . down[e_j, n])``, ``e_j = ids[t, j]``: the
    down GEMM token-major with the k-slot sum inside (few tokens: :func:`.moe_tiles.fewest_launches`).

    Program ``(t, c)``: token ``t``, columns ``n`` of tile ``c``. All ``TOPK`` slots in one
    ``[K_PAD, BLOCK_N, BLOCK_K]`` tile (each slot's row of ``h`` against its expert's
    weights: every slot's loads in flight at once), products in float32 (exact for 16-bit
    and e4m3 operands), summed over ``F``; each slot's float32 sum then times its columns'
    row scales (``W_SCALED``: e4m3 ``w``) and then its routing weight, as the grouped down
    GEMM's epilogue does; the slots added in order ``j = 0..k-1`` from zero, as the slot sum
    does, and rounded once into ``out``.
    """
    _pdl.wait(PDL)  # the ids, weights and gate-up output come from the kernels before
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_safe = tl.minimum(n, H - 1).to(tl.int64)  # columns past H: the last, never stored
    j = tl.arange(0, K_PAD)
    slot_ok = j < TOPK
    rows = t * TOPK + tl.minimum(j, TOPK - 1)  # slots past k: the last again, masked
    e = tl.load(ids_ptr + rows).to(tl.int64)
    h_base = h_ptr + rows[:, None, None] * stride_hm
    w_base = w_ptr + e[:, None, None] * stride_we + n_safe[None, :, None] * stride_wn
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([K_PAD, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, F, BLOCK_K):
        k = (k0 + kk)[None, None, :]
        mask = slot_ok[:, None, None] & (k < F)
        a = tl.load(h_base + k, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_base + k, mask=mask, other=0.0).to(tl.float32)
        acc += a * w
    _pdl.launch_dependents(PDL)
    y = tl.sum(acc, axis=2)  # [K_PAD, BLOCK_N]
    if W_SCALED:
        y = y * tl.load(ws_ptr + e[:, None] * stride_se + n_safe[None, :])
    y = y * tl.load(rw_ptr + rows).to(tl.float32)[:, None]
    total = tl.zeros([BLOCK_N], tl.float32)
    for s in tl.static_range(TOPK):  # slot order; adding the zeros of the others is exact
        total += tl.sum(tl.where(j[:, None] == s, y, 0.0), axis=0)
    dt: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + t * H + n, _rounded(total, dt).to(dt), mask=n < H)


def _check(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    assert x.dim() == 2 and gate_up.dim() == 3 and down.dim() == 3, (
        "x [T, H], [E, 2F, H], [E, H, F]"
    )
    e, two_f, h = gate_up.shape
    assert h == x.shape[1] and two_f % 2 == 0, f"gate_up {tuple(gate_up.shape)} for H={x.shape[1]}"
    assert down.shape == (e, h, two_f // 2), (
        f"down {tuple(down.shape)}: expected {(e, h, two_f // 2)}"
    )
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    if scales is None:
        assert x.dtype == gate_up.dtype == down.dtype, "x and the expert weights share a dtype"
    else:
        assert gate_up.dtype == down.dtype == torch.float8_e4m3fn, "fp8 experts are e4m3"
        assert scales[0].shape == (e, two_f) and scales[1].shape == (e, h), "row scales"
        assert all(s.dtype == torch.float32 and s.stride(1) == 1 for s in scales)
    for w in (gate_up, down):
        assert w.stride(2) == 1, "expert weights must be contiguous along their last dimension"


class _GemmSetting(NamedTuple):
    """What the two grouped GEMMs of one :func:`experts` call share (launch arguments)."""

    x: torch.Tensor
    rw: torch.Tensor
    grouping: Grouping
    num_rows: int
    top_k: int
    config: MoEConfig
    scaled: bool
    row_scale: torch.Tensor | None  # float32 [T]: the gate-up sums' row factors (or None)


def _grouped_gemm(
    setting: _GemmSetting,
    a: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    dst: torch.Tensor,
    *,
    gate_up: bool,
    splits: int,
    k_per_split: int,
    partials: torch.Tensor | None = None,
    slot_sum: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    early_dependents: bool = False,
) -> None:
    """Launch :func:`_grouped_gemm_kernel` over ``a`` and the experts ``w`` into ``dst``
    (a split gate-up: its float32 ``partials [splits, T*k, 2F]`` and the device's arrival
    counters, :func:`.fused_linear.workspace`; ``slot_sum``: the down GEMM of one token
    sums its slots into ``(out [1, H], residual or None)`` itself, with those counters;
    ``early_dependents``: the next kernel may launch once this one's programs have waited)."""
    bm, bn, bk, warps, stages = (setting.config if gate_up else setting.config.down)[:5]
    nout, k = w.shape[1] // (2 if gate_up else 1), w.shape[2]
    x = setting.x
    use_pdl = _pdl.enabled(x.device)
    uses_counters = partials is not None or slot_sum is not None
    counters = workspace(x.device).counters if uses_counters else setting.rw
    final, res = slot_sum if slot_sum is not None else (dst, None)
    part = partials if partials is not None else dst
    row_scale = setting.row_scale if gate_up else None
    _grouped_gemm_kernel[(setting.grouping.expert_ids.numel(), cdiv(nout, bn), splits)](
        a,
        w,
        dst,
        part,
        counters,
        setting.rw,
        scale,
        row_scale if row_scale is not None else setting.rw,  # never read unscaled
        setting.grouping.sorted_rows,
        setting.grouping.expert_ids,
        setting.grouping.num_padded,
        res if res is not None else final,  # never read without a residual
        final,
        setting.num_rows,
        nout,
        k,
        k_per_split,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        dst.stride(-2),
        dst.stride(0) if dst.dim() == 3 else 0,
        part.stride(0) if partials is not None else 0,
        scale.stride(0),
        TOPK=setting.top_k,
        GATE_UP=gate_up,
        SPLIT_K=splits,
        W_SCALED=setting.scaled,
        ROW_SCALED=row_scale is not None,
        SLOT_SUM=slot_sum is not None,
        RESIDUAL=res is not None,
        EVEN_K=k % bk == 0,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        UPCAST=x.device.type != "cuda" and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=use_pdl,
        EARLY_DEPENDENTS=early_dependents,
        num_warps=warps,
        num_stages=stages,
        **_pdl.launch_kwargs(use_pdl),
    )


def _down_early(
    setting: _GemmSetting,
    h: torch.Tensor,
    down: torch.Tensor,
    scale: torch.Tensor,
    y: torch.Tensor,
    out: torch.Tensor,
    residual: torch.Tensor | None,
    columns: int,
) -> None:
    """Launch :func:`_down_early_kernel` for one token: ``out [1, H]`` (plus ``residual``)
    from ``h [k, F]``, ``columns`` of ``H`` a program (:func:`.moe_tiles.early_down_columns`),
    its float32 slot rows in ``y [k, H]``."""
    _, hidden, inter = down.shape
    top_k = setting.top_k
    tiles = cdiv(hidden, columns)
    assert tiles <= NUM_COUNTERS["cuda" if out.device.type == "cuda" else "cpu"], "counters"
    use_pdl = _pdl.enabled(out.device)
    grouping = setting.grouping
    _down_early_kernel[(top_k, tiles)](
        h,
        down,
        scale,
        setting.rw,
        grouping.sorted_rows,
        grouping.expert_ids,
        y,
        workspace(out.device).counters,
        residual if residual is not None else out,  # never read without a residual
        out,
        hidden,
        inter,
        h.stride(0),
        down.stride(0),
        down.stride(1),
        scale.stride(0) if setting.scaled else 0,
        TOPK=top_k,
        BLOCK_M=grouping.block_m,
        F_PAD=next_power_of_2(inter),
        BLOCK_N=columns,
        W_SCALED=setting.scaled,
        RESIDUAL=residual is not None,
        PDL=use_pdl,
        num_warps=4,
        **_pdl.launch_kwargs(use_pdl),
    )


def _down_with_slot_sum(
    h: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor | None,
    ids: torch.Tensor,
    rw: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Launch :func:`_down_slot_sum_kernel`: ``out [T, H]`` from ``h [T*k, F]`` (tiles:
    :func:`token_major_tiles`)."""
    t, top_k = ids.shape
    _, hidden, inter = down.shape
    tiles = token_major_tiles(top_k, out.device.type == "cuda")
    flat_ids = ids.reshape(-1)
    if flat_ids.dtype != torch.int32:
        flat_ids = flat_ids.to(torch.int32)
    scale = down_scale if down_scale is not None else rw  # never read unscaled
    use_pdl = _pdl.enabled(out.device)
    _down_slot_sum_kernel[(t, cdiv(hidden, tiles.block_n))](
        h,
        down,
        scale,
        flat_ids,
        rw,
        out,
        hidden,
        inter,
        h.stride(0),
        down.stride(0),
        down.stride(1),
        scale.stride(0) if down_scale is not None else 0,
        TOPK=top_k,
        K_PAD=next_power_of_2(top_k),
        W_SCALED=down_scale is not None,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        PDL=use_pdl,
        num_warps=tiles.num_warps,
        **_pdl.launch_kwargs(use_pdl),
    )


def gate_up_split(
    hidden: int, inter: int, config: MoEConfig, blocks: int, device: torch.device
) -> tuple[int, int]:
    """``(splits, k_per_split)`` of the gate-up GEMM over ``hidden``: :func:`effective_split`
    of ``config``'s, unsplit where its ``blocks * cdiv(inter, BLOCK_N)`` tiles would not fit
    the device's arrival counters (:data:`.fused_linear.NUM_COUNTERS`; the bits of a split
    agree with the unsplit within rounding, module doc)."""
    splits, per = effective_split(hidden, config.block_k, config.split_k)
    tiles = blocks * cdiv(inter, config.block_n)
    if splits > 1 and tiles > NUM_COUNTERS["cuda" if device.type == "cuda" else "cpu"]:
        return 1, hidden
    return splits, per


def experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    config: MoEConfig | None = None,
    grouping: Grouping | None = None,
    cache: ConfigCache | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    plan: LaunchPlan | None = None,
    residual: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' weighted sum for given routing: :func:`.moe_reference.experts`, fused.

    ``x [T, H]``; ``weights [T, k]`` (any float dtype, used in float32), ``ids [T, k]``;
    ``gate_up [E, 2F, H]`` (gate rows then up rows), ``down [E, H, F]``, in ``x``'s dtype
    (or e4m3 with ``scales``, their row scales ``[E, 2F]`` and ``[E, H]``: module doc).
    ``config``: the tiles (default :func:`choose_config`); ``grouping``: an :func:`align`
    of ``ids`` with ``config.block_m`` already made (as :func:`fused_moe` does); ``plan``:
    which down GEMM (default :func:`launch_plan`; its ``route_with_align`` is ignored
    here; ``early_down``: :func:`_down_early_kernel` for one token); ``residual [T, H]``
    (``x``'s dtype): returned added, ``residual + out`` with the bits of adding the two
    tensors (inside the slot sum); ``row_scale`` (float32 ``[T]``):
    each token's gate and up sums multiplied by it before SiLU·mul (an RMSNorm folded into
    the op: ``x`` un-normalized, the norm's gain already in ``gate_up``, ``row_scale`` its
    ``1/rms``). Returns a fresh ``[T, H]``.
    """
    _check(x, gate_up, down, scales)
    t, top_k = ids.shape
    e, two_f, h = gate_up.shape
    if residual is not None:
        assert residual.shape == (t, h) and residual.dtype == x.dtype, "residual [T, H]"
        residual = residual.contiguous()
    if row_scale is not None:
        assert row_scale.shape == (t,) and row_scale.dtype == torch.float32, "row_scale [T] f32"
    f = two_f // 2
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if config is None:
        config = choose_config(x, weights, ids, gate_up, down, cache, scales)
    plan = plan or launch_plan(t, top_k, config)
    bm, split = config.block_m, config.split_k
    if grouping is None:
        grouping = align(ids, e, bm)
    assert grouping.block_m == bm, "the grouping's block is the config's BLOCK_M"
    n = t * top_k
    rw = weights.reshape(-1).contiguous()
    blocks = grouping.expert_ids.numel()
    split_gu, per_gu = gate_up_split(h, f, config, blocks, x.device)
    inter = torch.empty((n, f), dtype=x.dtype, device=x.device)  # h, rounded once
    partials = None  # a split gate-up's float32 sums [split, T*k, 2F], gate then up
    if split_gu > 1:
        partials = torch.empty((split_gu, n, two_f), dtype=torch.float32, device=x.device)
    ws = scales or (rw, rw)  # unscaled: never read (W_SCALED is off)
    setting = _GemmSetting(x, rw, grouping, n, top_k, config, scales is not None, row_scale)
    early = early_down_columns(f) if plan.early_down and t == 1 else 0
    _grouped_gemm(
        setting,
        x,
        gate_up,
        ws[0],
        inter,
        gate_up=True,
        splits=split_gu,
        k_per_split=per_gu,
        partials=partials,
        early_dependents=early > 0,
    )
    if early:
        y = torch.empty((n, h), dtype=torch.float32, device=x.device)
        _down_early(setting, inter, down, ws[1], y, out, residual, early)
        return out
    if plan.down_with_slot_sum:
        _down_with_slot_sum(inter, down, scales[1] if scales else None, ids, rw, out)
        return out if residual is None else residual + out
    split_d, per_d = effective_split(f, config.down.block_k, split)
    y = torch.empty((split_d, n, h), dtype=torch.float32, device=x.device)
    down_args = (setting, inter, down, ws[1], y)
    if t == 1 and split_d == 1:  # the slots summed by the down GEMM's last program
        _grouped_gemm(
            *down_args, gate_up=False, splits=1, k_per_split=per_d, slot_sum=(out, residual)
        )
        return out
    _grouped_gemm(*down_args, gate_up=False, splits=split_d, k_per_split=per_d)
    block_h = min(1024, next_power_of_2(h))
    use_pdl = _pdl.enabled(out.device)
    _slot_sum_kernel[(t, cdiv(h, block_h))](
        y,
        residual if residual is not None else out,
        out,
        h,
        y.stride(0),
        TOPK=top_k,
        SPLITS=split_d,
        RESIDUAL=residual is not None,
        BLOCK_H=block_h,
        PDL=use_pdl,
        num_warps=4,
        **_pdl.launch_kwargs(use_pdl),
    )
    return out


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor | None,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    weights_dtype: torch.dtype | None = None,
    config: MoEConfig | None = None,
    cache: ConfigCache | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    plan: LaunchPlan | None = None,
    router: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm_eps: float | None = None,
    early_down: bool = False,
) -> torch.Tensor:
    """A sparse-MoE block's output ``[T, H]`` from ``x [T, H]`` and ``router_logits [T, E]``,
    or from the router's weight ``router [E, H]`` (``router_logits`` None).

    Routing as transformers' (:func:`.moe_routing.route`; ``renormalize`` is
    ``norm_topk_prob``, ``weights_dtype`` the routing weights' dtype: ``x.dtype`` for
    Qwen3-MoE, ``None`` for Mixtral's float32), then :func:`experts`. ``gate_up [E, 2F, H]``,
    ``down [E, H, F]``; ``config``/``cache``/``scales`` (fp8 experts) as :func:`experts`;
    ``plan``: the kernels (default :func:`launch_plan`; a ``route_with_align`` past
    ``ONE_PROGRAM_ROWS`` rows is refused). With ``router``, a step of few tokens
    (:func:`.moe_router.fuses_router`, once its tiles are known) projects, routes and groups
    in one launch (:func:`.moe_router.router_route_align`); any other takes the logits
    ``x @ router.T`` (torch's ``linear``) first. ``residual``: as :func:`experts`.
    ``norm_eps`` (with ``router``): the block's RMSNorm folded into the op -- ``x`` is the
    norm's input and its gain is already in ``router`` and ``gate_up``; the one-launch
    router takes each token's ``1/rms`` beside the logits and the gate-up GEMM applies it
    in its epilogue (no launch for the norm), any other step normalizes ``x`` first
    (:func:`.rmsnorm.rms_norm` with a unit gain, as the unfused block's norm rounds it).
    ``early_down``: the plan's :attr:`.moe_tiles.LaunchPlan.early_down` on (one token). No
    host sync, fixed-size buffers: CUDA-graph capturable once each batch size has run
    eagerly (the autotune; module doc).
    """
    _check(x, gate_up, down, scales)
    t, e = x.shape[0], gate_up.shape[0]
    if t == 0:
        return torch.empty_like(x)
    if config is None:
        config = known_config(x, t, top_k, gate_up, cache)
    row_scale = None
    if router_logits is None:
        assert router is not None, "fused_moe needs router_logits or the router's weight"
        if x.stride(1) != 1:
            x = x.contiguous()
        if fuses_router(t, top_k):  # its counters, made outside any capture (a first call
            workspace(x.device)  # tunes on torch's logits; the captured ones take the kernel)
        if config is None or not fuses_router(t, top_k):
            if norm_eps is not None:  # normalized first, as the unfused block's norm does
                x = rms_norm(x, unit_gain(x.shape[1], x.dtype, x.device), norm_eps)[0]
                norm_eps = None
            router_logits = torch.nn.functional.linear(x, router)
    else:
        assert norm_eps is None, "norm_eps comes with the router's weight, not with logits"
    if router_logits is None:  # the router's projection, routing and grouping in one launch
        weights, ids, grouping, _, row_scale = router_route_align(
            x, router, top_k, renormalize, weights_dtype, config.block_m, norm_eps
        )
        plan = plan or launch_plan(t, top_k, config)
    else:
        assert router_logits.shape == (t, e), "router logits [T, E]"
        route_args = (router_logits, top_k, renormalize, weights_dtype)
        if config is None:  # a GPU bucket's first eager call: tune on this call's routing
            weights, ids = route(*route_args)
            config = choose_config(x, weights, ids, gate_up, down, cache, scales)
        plan = plan or launch_plan(t, top_k, config)
        if plan.route_with_align:  # one launch, no counts
            weights, ids, grouping = route_and_align(*route_args, config.block_m)
        else:
            counts = None  # few rows: align counts and ranks them in one program (no memsets)
            if counts_needed(t * top_k):
                counts = torch.zeros(e, dtype=torch.int32, device=x.device)
            weights, ids = route(*route_args, counts)
            grouping = align(ids, e, config.block_m, counts)
    if early_down:
        plan = plan._replace(early_down=True)
    return experts(
        x,
        weights,
        ids,
        gate_up,
        down,
        config=config,
        grouping=grouping,
        scales=scales,
        plan=plan,
        residual=residual,
        row_scale=row_scale,
    )
