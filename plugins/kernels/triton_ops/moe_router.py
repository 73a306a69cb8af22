"""The router's projection, routing and grouping in one launch, for a decode step of few tokens.

At batch 1 the front half of a sparse block was three launches before the experts' GEMMs:
the router's ``linear`` (cuBLAS: 4.9 us a layer on an H100 for Qwen3-30B-A3B's ``[128,
2048]`` router, two programs streaming its 512 KB), :func:`.moe_routing.route` (2.2 us)
and :func:`.moe_routing.align` (4.3 us) -- 11.4 of the 88.8 us a layer of a profiled
decode step (2026-12-06). :func:`router_route_align` does all three in one:

1. **Projection**, split over ``cdiv(E, BLOCK_E) x H_SPLITS`` programs: program ``(p, s)``
   takes experts ``[p * BLOCK_E, ...)`` and hidden columns ``[s * H_PER_SPLIT, ...)``,
   multiplies the ``[BLOCK_E, BLOCK_H]`` router tiles by the few token rows (products of
   the activation dtype are exact in float32; float32 sums) and stores its float32 partial
   ``[T, BLOCK_E]`` to its own slice of ``partials [H_SPLITS, T, E]``; then it counts itself
   in an arrival counter (the fused linear ops' counters and memory ordering:
   :func:`.fused_linear.workspace`, one ``acq_rel`` add a program, nothing waits).
2. **Routing and grouping**, by the program that arrives last: it sums every split's
   partials in split order (so the bits do not depend on which program that is), rounds
   the logits once to the activations' dtype, as the router's ``linear`` returns them,
   stores them to ``logits [T, E]`` and routes them from its registers, then groups the
   rows. One token's ``k`` experts are distinct, so its grouping needs no sort: block ``j``
   holds flat row ``j`` alone, in slot order rather than by expert id (the expert GEMMs
   give every row the same bits in either order; no barrier, no reload of the ids). Two
   tokens: :func:`.moe_routing.route_and_align`'s grouping, the same blocks bit for bit.
   The routing is ``route_and_align``'s code with the same warps, so its ids are those of
   ``route_and_align(logits)`` bit for bit, and so are its weights in a 16-bit dtype
   (float32 weights, Mixtral's, may differ in their last bits: on an H100 the two
   kernels' softmax sums reduced in different orders). Then it zeroes the counter.

The logits differ from cuBLAS's only by the order of each float32 dot's sum (then both
round to the activation dtype): within one rounding of it, so a token whose k-th and
k+1-th experts are that close may pick the other one, as two GEMM libraries would.

With ``norm_eps`` (a fused layer's post-attention RMSNorm inside the MoE op, its gain
folded into the router's and the experts' gate-up weights at load): ``x`` is the norm's
input; the programs of the first expert block also store their split's float32 sums of
squares, and the last program takes each token's ``1/rms`` from them (in split order),
multiplies the logits by it before their one rounding and stores it for the gate-up GEMM,
which applies it in its epilogue -- the norm costs no launch.

Used by :func:`.moe.fused_moe` when given the router's weight instead of logits and the
step has at most :data:`FUSED_ROUTER_TOKENS` tokens (one program routes and groups all of
them: :func:`.moe_routing.route_and_align` took 4.9 us for one token against 7.0 for
route and align apart, and 34.6 against 19.2 for eight, on an H100 on 2026-12-06).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops.fused_linear import workspace
from pitstop.plugins.kernels.triton_ops.launch_math import cdiv, next_power_of_2
from pitstop.plugins.kernels.triton_ops.moe_routing import (
    Grouping,
    _group_routed,
    _route_logits,
    counts_needed,
    route_and_group_constants,
    routed_buffers,
)
from pitstop.plugins.kernels.triton_ops.rope_store import _rounded

# Steps of at most this many tokens take the one-launch router (module doc)
FUSED_ROUTER_TOKENS = 2
BLOCK_E = 16  # experts a projection program takes
BLOCK_H = 128  # hidden columns a K step
H_PER_SPLIT = 256  # hidden columns a projection program takes (two K steps)
COUNTER = 0  # the arrival counter (of the device's fused-linear counters) this launch uses


@triton.jit
def _router_route_align_kernel(
    x_ptr,
    w_ptr,
    partials_ptr,
    squares_ptr,
    row_scale_ptr,
    logits_ptr,
    counters_ptr,
    weights_ptr,
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    T,
    E,
    H,
    stride_x,
    stride_w,
    num_blocks,
    eps,
    T_PAD: tl.constexpr,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCKS_CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    H_PER_SPLIT: tl.constexpr,
    H_SPLITS: tl.constexpr,
    NORM: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(p, s)``: the float32 partial logits of experts ``p`` over hidden split
    ``s``; the last to arrive sums them, rounds, routes and groups (module doc). ``NORM``:
    ``x`` is un-normalized (its RMSNorm's gain folded into ``w``): the programs ``(0, s)``
    also store their split's float32 sums of squares, from which the last one takes each
    token's ``1/rms``, multiplies the logits by it before rounding and stores it to
    ``row_scale [T]`` for the gate-up GEMM."""
    tl.static_assert(H_PER_SPLIT == 2 * BLOCK_H, "a projection program takes two K steps")
    pid_e = tl.program_id(0)
    pid_h = tl.program_id(1)
    ee = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    tt = tl.arange(0, T_PAD)
    hh = tl.arange(0, BLOCK_H)
    w_rows = w_ptr + tl.minimum(ee, E - 1).to(tl.int64)[:, None] * stride_w  # [BLOCK_E, 1]
    x_rows = x_ptr + tl.minimum(tt, T - 1).to(tl.int64)[:, None] * stride_x  # [T_PAD, 1]
    h_a = pid_h * H_PER_SPLIT + hh
    h_b = h_a + BLOCK_H
    # the router's weights before the wait: they do not depend on the kernel before
    w_a = tl.load(w_rows + h_a[None, :], mask=(h_a < H)[None, :], other=0.0)
    w_b = tl.load(w_rows + h_b[None, :], mask=(h_b < H)[None, :], other=0.0)
    _pdl.wait(PDL)  # x comes from the kernel before
    x_a = tl.load(x_rows + h_a[None, :], mask=(h_a < H)[None, :], other=0.0).to(tl.float32)
    x_b = tl.load(x_rows + h_b[None, :], mask=(h_b < H)[None, :], other=0.0).to(tl.float32)
    # exact products, float32 sums, the K steps in order
    acc = tl.zeros([BLOCK_E, T_PAD], tl.float32)
    acc += tl.sum(w_a.to(tl.float32)[:, None, :] * x_a[None, :, :], axis=2)
    acc += tl.sum(w_b.to(tl.float32)[:, None, :] * x_b[None, :, :], axis=2)
    squares = tl.zeros([T_PAD], tl.float32)
    if NORM:
        squares += tl.sum(x_a * x_a, axis=1)
        squares += tl.sum(x_b * x_b, axis=1)
    _pdl.launch_dependents(PDL)  # the gate-up GEMM's programs may queue (they wait first)
    # this split's partial [T, BLOCK_E] into its own slice of partials [H_SPLITS, T, E]
    part = partials_ptr + (pid_h * T + tt)[None, :].to(tl.int64) * E + ee[:, None]
    tl.store(part, acc, mask=(ee < E)[:, None] & (tt < T)[None, :])
    if NORM:  # one program a split stores its sums of squares [T] to squares [H_SPLITS, T]
        if pid_e == 0:
            tl.store(squares_ptr + pid_h * T + tt, squares, mask=tt < T)
    tl.debug_barrier()  # every thread's stores before the one thread's release
    counter = counters_ptr
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:  # the last: all are visible
        tl.debug_barrier()  # the acquire (one thread) before every thread's loads
        e = tl.arange(0, E_PAD)
        t2 = tl.arange(0, BLOCK_T)
        for t0 in range(0, T, BLOCK_T):
            rows = t0 + t2
            mask = (rows < T)[:, None] & (e < E)[None, :]
            logits = tl.zeros([BLOCK_T, E_PAD], tl.float32)
            ss = tl.zeros([BLOCK_T], tl.float32)
            p = partials_ptr + rows.to(tl.int64)[:, None] * E + e[None, :]
            # split order (bits independent of arrival), unrolled: the splits' loads are
            # independent, so they go out together instead of one L2 round trip each
            for s in tl.static_range(H_SPLITS):
                logits += tl.load(p + s * T * E, mask=mask, other=0.0, cache_modifier=".cg")
                if NORM:  # 1/rms of each token from the splits' sums of squares
                    q = squares_ptr + s * T + rows
                    ss += tl.load(q, mask=rows < T, other=0.0, cache_modifier=".cg")
            if NORM:
                rstd = 1.0 / tl.sqrt(ss / H + eps)
                tl.store(row_scale_ptr + rows, rstd, mask=rows < T)
                logits = logits * rstd[:, None]
            dt: tl.constexpr = logits_ptr.dtype.element_ty
            rounded = _rounded(logits, dt).to(dt)
            tl.store(logits_ptr + rows.to(tl.int64)[:, None] * E + e[None, :], rounded, mask=mask)
            # routed from the registers: route_and_align's routing of the stored logits
            ids, routed = _route_logits(
                rounded, weights_ptr, ids_ptr, rows, T, E, TOPK, K_PAD, RENORMALIZE, BLOCK_T, E_PAD
            )
            if ONE_TOKEN:  # its k experts are distinct: one row a block, in slot order
                _one_row_blocks(
                    ids, routed, sorted_ptr, expert_ids_ptr, total_ptr, TOPK, K_PAD, BLOCK_M
                )
        if not ONE_TOKEN:
            tl.debug_barrier()  # the ids stored above by some threads are read below by others
            _group_routed(
                ids_ptr, sorted_ptr, expert_ids_ptr, total_ptr, T, E, num_blocks,
                TOPK, E_PAD, BLOCK_M, CHUNK, BLOCKS_CHUNK,
            )  # fmt: skip
        tl.store(counter, 0)  # zero again for the next launch (or graph replay)


@triton.jit
def _one_row_blocks(
    ids,
    routed,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """One token's grouping from its ids in registers (``[BLOCK_T, K_PAD]``, row 0 the
    token's; ``routed`` their mask): block ``j`` holds flat row ``j`` alone (expert
    ``ids[0, j]``), the sentinel ``TOPK`` in its other rows; ``TOPK`` blocks in all."""
    slot = tl.arange(0, K_PAD)
    expert = tl.sum(tl.where(routed, ids, 0), axis=0)  # [K_PAD]: the one token's experts
    j = tl.arange(0, BLOCK_M)
    rows = tl.where(j[None, :] == 0, slot[:, None], TOPK)
    used = slot < TOPK
    tl.store(sorted_ptr + slot[:, None] * BLOCK_M + j[None, :], rows, mask=used[:, None])
    tl.store(expert_ids_ptr + slot, expert, mask=used)
    tl.store(total_ptr, TOPK * BLOCK_M)


def fuses_router(num_tokens: int, top_k: int) -> bool:
    """Whether a step of ``num_tokens`` tokens takes :func:`router_route_align`: at most
    :data:`FUSED_ROUTER_TOKENS`, and few enough rows for one grouping program."""
    return 1 <= num_tokens <= FUSED_ROUTER_TOKENS and not counts_needed(num_tokens * top_k)


def router_route_align(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype | None,
    block_m: int,
    norm_eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Grouping, torch.Tensor, torch.Tensor | None]:
    """``x @ router.T`` rounded to ``x``'s dtype, then :func:`.moe_routing.route_and_align`
    of it (``block_m``), in one launch (module doc), for :func:`fuses_router` steps.

    ``x [T, H]``, ``router [E, H]`` in ``x``'s dtype (both contiguous along ``H``).
    ``norm_eps``: ``x`` is an RMSNorm's input and the norm's gain is folded into
    ``router``: the logits are ``(x @ router.T) / rms(x)`` (``rms = sqrt(mean(x**2) +
    eps)``, float32) before their rounding. Returns ``(weights [T, k], ids [T, k],
    grouping, logits [T, E], row_scale)`` (one token's grouping one row a block in slot
    order, module doc), ``row_scale`` each token's float32 ``1/rms``
    ``[T]`` with ``norm_eps``, else None. Fixed-size buffers, no host sync: CUDA-graph
    capturable (after one call outside a capture: the counters).
    """
    t, h = x.shape
    e = router.shape[0]
    assert router.shape == (e, h) and router.dtype == x.dtype, "router [E, H] in x's dtype"
    assert x.stride(1) == 1 and router.stride(1) == 1, "x and router contiguous along H"
    assert 1 <= top_k <= min(e, 16), f"top_k={top_k} with {e} experts"
    assert fuses_router(t, top_k), f"{t} tokens x {top_k}: not a one-launch router step"
    dev = x.device
    splits = cdiv(h, H_PER_SPLIT)
    partials = torch.empty((splits, t, e), dtype=torch.float32, device=dev)
    norm = norm_eps is not None
    squares = torch.empty((splits, t) if norm else (1,), dtype=torch.float32, device=dev)
    row_scale = torch.empty(t, dtype=torch.float32, device=dev) if norm else None
    logits = torch.empty((t, e), dtype=x.dtype, device=dev)
    weights, ids, grouping = routed_buffers(t, e, top_k, weights_dtype, block_m, dev)
    constants, warps = route_and_group_constants(t, e, top_k, renormalize, block_m)
    counters = workspace(dev).counters[COUNTER:]
    use_pdl = _pdl.enabled(dev)
    _router_route_align_kernel[(cdiv(e, BLOCK_E), splits)](
        x,
        router,
        partials,
        squares,
        row_scale if row_scale is not None else squares,  # never written without the norm
        logits,
        counters,
        weights,
        ids,
        grouping.sorted_rows,
        grouping.expert_ids,
        grouping.num_padded,
        t,
        e,
        h,
        x.stride(0),
        router.stride(0),
        grouping.expert_ids.numel(),
        float(norm_eps or 0.0),
        T_PAD=next_power_of_2(t),
        **constants,
        BLOCK_E=BLOCK_E,
        BLOCK_H=BLOCK_H,
        H_PER_SPLIT=H_PER_SPLIT,
        H_SPLITS=splits,
        NORM=norm,
        ONE_TOKEN=t == 1,
        PDL=use_pdl,
        num_warps=warps,
        **_pdl.launch_kwargs(use_pdl),
    )
    return weights, ids, grouping, logits, row_scale
