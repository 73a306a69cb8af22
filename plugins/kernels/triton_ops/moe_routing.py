"""Top-k routing in one kernel, and the grouping of token rows by expert (:mod:`.moe`'s front half).

:func:`route`: softmax (float32) + top-k + optional renormalisation of ``[T, E]`` router
logits (E up to 1024, k up to 16), one program per ``BLOCK_T`` rows holding a
``[BLOCK_T, E]`` tile; it also counts, with integer atomics, how many rows each expert
gets (exact, so deterministic), for :func:`align`. Ties: the top-k is that of a *stable*
descending sort (among equal probabilities the lower expert id first), so the ids are
reproducible; ``torch.topk`` keeps the same values and, unless the tie straddles the
k-th place, the same set of experts, but orders (and, at the k-th place, picks among)
equal values in an implementation-defined way (on the CPU ``topk([.1, .3, .3, .3], 3)``
gives ids ``[1, 3, 2]``).

:func:`align` (vLLM's ``moe_align_block_size``): the flat rows ``r = t * k + j`` are
grouped by expert, each expert's group padded to a multiple of ``BLOCK_M`` with the
sentinel ``T * k``; ``expert_ids[b]`` is the expert of row block ``b`` (``-1`` past the
last used block) and ``num_padded`` the number of used rows. Output buffers have the
worst-case size, ``T * k + min(E, T * k) * (BLOCK_M - 1)`` rows (every expert that gets a
row wastes at most ``BLOCK_M - 1``), known on the host, so no sync and a CUDA graph can
capture it. One launch: every program recomputes the experts' padded offsets from the
counts (a cumsum over E) and scatters its chunk of rows, each taking a slot within its
expert by an atomic increment; program 0 also writes the padding sentinels, the block
experts and the total. The order of rows *within* an expert's group therefore depends
on the atomics' order on a GPU; no result does (each row's GEMM results do not depend
on its place in a tile, and :mod:`.moe` sums a token's k rows in slot order). Up to
:data:`ONE_PROGRAM_ROWS` rows (decode) one program does it all without counts: it counts
each expert's rows and ranks every row among its expert's by comparing it with the
earlier ones, so :func:`route` counts nothing and no buffer needs zeroing first (the
routing half takes two launches, not four with the two memsets), and each expert's rows
keep their order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops.rope_store import _rounded

ROUTE_TILE = 4096  # elements of the [BLOCK_T, E] tile a routing program holds
ALIGN_CHUNK = 8192  # elements of the [rows, E] one-hot tile an align program gathers through
# At most this many rows (T * k: decode up to 16 tokens at top-8) are grouped by one align
# program that counts and ranks them itself ([rows, E] and [rows, rows] tiles), so routing
# needs no counts and neither needs a zeroed buffer: two launches instead of four
ONE_PROGRAM_ROWS = 128


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    counts_ptr,
    T,
    E,
    stride_t,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    COUNT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_PAD)
    kk = tl.arange(0, K_PAD)
    t_mask = t < T
    e_mask = e < E
    rows = tl.minimum(t, T - 1).to(tl.int64)  # past T: the last row again, never stored
    x = tl.load(logits_ptr + rows[:, None] * stride_t + e[None, :], mask=e_mask[None, :], other=0.0)
    x = tl.where(e_mask[None, :], x.to(tl.float32), float("-inf"))
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where(e_mask[None, :], p, -1.0)  # padding lanes below every probability
    vals = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.max(p, axis=1)
        idx = tl.min(tl.where(p == best[:, None], e[None, :], E_PAD), axis=1)
        vals = tl.where(kk[None, :] == j, best[:, None], vals)
        ids = tl.where(kk[None, :] == j, idx[:, None], ids)
        p = tl.where(e[None, :] == idx[:, None], -2.0, p)  # taken
    k_mask = kk < TOPK
    if RENORMALIZE:
        vals = vals / tl.sum(tl.where(k_mask[None, :], vals, 0.0), axis=1)[:, None]
    mask = t_mask[:, None] & k_mask[None, :]
    out = t[:, None] * TOPK + kk[None, :]
    dt: tl.constexpr = weights_ptr.dtype.element_ty
    tl.store(weights_ptr + out, _rounded(vals, dt).to(dt), mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)
    if COUNT:
        tl.atomic_add(counts_ptr + ids, 1, mask=mask)


def route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype | None,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights ``[T, k]`` and expert ids ``[T, k]`` (int32) of ``router_logits [T, E]``.

    ``softmax`` in float32, the top ``top_k`` probabilities (stable: lower id first among
    equals), divided by their float32 sum when ``renormalize`` (``norm_topk_prob``), stored
    in ``weights_dtype`` (``None``: float32, as Mixtral keeps them) rounded to nearest.
    ``counts``: an int32 ``[E]`` tensor to which each expert's number of rows is added.
    """
    assert router_logits.dim() == 2, "router logits [T, E]"
    t, e = router_logits.shape
    assert 1 <= top_k <= min(e, 16), f"top_k={top_k} with {e} experts"
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    dev = router_logits.device
    weights = torch.empty((t, top_k), dtype=weights_dtype or torch.float32, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    if t == 0:
        return weights, ids
    e_pad = triton.next_power_of_2(e)
    block_t = max(1, min(triton.next_power_of_2(t), ROUTE_TILE // e_pad))
    _route_kernel[(triton.cdiv(t, block_t),)](
        router_logits,
        weights,
        ids,
        counts if counts is not None else ids,
        t,
        e,
        router_logits.stride(0),
        TOPK=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        COUNT=counts is not None,
        BLOCK_T=block_t,
        E_PAD=e_pad,
        num_warps=4 if block_t * e_pad >= 2048 else 1,
    )
    return weights, ids


class Grouping(NamedTuple):
    """Rows grouped by expert: ``sorted_rows [R]`` (flat row ``t * k + j``, or the sentinel
    ``T * k`` in padding), ``expert_ids [R / block_m]`` (``-1``: unused block) and
    ``num_padded [1]`` (used rows), for tiles of ``block_m`` rows."""

    sorted_rows: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def counts_needed(num_rows: int) -> bool:
    """Whether :func:`align` of ``num_rows`` flat rows reads each expert's count (counted by
    :func:`route` into a zeroed buffer); up to :data:`ONE_PROGRAM_ROWS` it counts them itself."""
    return num_rows > ONE_PROGRAM_ROWS


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """The worst-case padded row count: ``T*k + min(E, T*k) * (block_m - 1)``, rounded to blocks."""
    worst = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


@triton.jit
def _align_kernel(
    ids_ptr,
    counts_ptr,
    fill_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    N,
    E,
    num_blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCKS_CHUNK: tl.constexpr,
    ONE_PROGRAM: tl.constexpr,
):
    e = tl.arange(0, E_PAD)
    e_mask = e < E
    r = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    r_mask = r < N
    if ONE_PROGRAM:  # every row here: count them, and rank each among its expert's rows
        ex = tl.load(ids_ptr + r, mask=r_mask, other=-1)
        count = tl.sum(((ex[:, None] == e[None, :]) & r_mask[:, None]).to(tl.int32), axis=0)
        earlier = (ex[:, None] == ex[None, :]) & (r[None, :] < r[:, None]) & r_mask[None, :]
        slot = tl.sum(earlier.to(tl.int32), axis=1)
    else:
        count = tl.load(counts_ptr + e, mask=e_mask, other=0)
        ex = tl.load(ids_ptr + r, mask=r_mask, other=0)
        # this program's rows: each takes the next slot of its expert
        slot = tl.atomic_add(fill_ptr + ex, 1, mask=r_mask)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    start = tl.sum(tl.where(ex[:, None] == e[None, :], starts[None, :], 0), axis=1)
    tl.store(sorted_ptr + start + slot, r, mask=r_mask)
    if tl.program_id(0) == 0:
        total = tl.sum(padded, axis=0)
        tl.store(total_ptr, total)
        j = tl.arange(0, BLOCK_M)
        pad = starts[:, None] + count[:, None] + j[None, :]
        pad_mask = e_mask[:, None] & (j[None, :] < (padded - count)[:, None])
        tl.store(sorted_ptr + pad, N, mask=pad_mask)
        for b0 in range(0, num_blocks, BLOCKS_CHUNK):
            b = b0 + tl.arange(0, BLOCKS_CHUNK)
            owner = tl.sum((ends[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1)
            owner = tl.where(b * BLOCK_M < total, owner, -1)
            tl.store(expert_ids_ptr + b, owner, mask=b < num_blocks)


def align(
    ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    counts: torch.Tensor | None = None,
) -> Grouping:
    """Group the rows of ``ids [T, k]`` by expert, each expert padded to ``block_m`` rows.

    ``counts``: each expert's number of rows (int32 ``[E]``, as :func:`route` counts them);
    computed here when not given. Fixed-size outputs (:func:`max_padded_rows`), no host
    sync: CUDA-graph capturable.
    """
    n = ids.numel()
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int32)
    one_program = counts is None and not counts_needed(n)
    if counts is None and not one_program:
        counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
        counts.scatter_add_(0, flat.long(), torch.ones_like(flat))
    rows = max_padded_rows(n, num_experts, block_m)
    sorted_rows = torch.empty(rows, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(rows // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = triton.next_power_of_2(num_experts)
    if one_program:  # no counts, no slot counters: nothing to zero first
        chunk = max(16, triton.next_power_of_2(max(n, 1)))
        counts = fill = flat  # unread
    else:
        chunk = max(16, min(triton.next_power_of_2(max(n, 1)), ALIGN_CHUNK // e_pad))
        fill = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    _align_kernel[(max(1, triton.cdiv(n, chunk)),)](
        flat,
        counts,
        fill,
        sorted_rows,
        expert_ids,
        num_padded,
        n,
        num_experts,
        rows // block_m,
        BLOCK_M=block_m,
        E_PAD=e_pad,
        CHUNK=chunk,
        BLOCKS_CHUNK=max(16, min(128, ALIGN_CHUNK // e_pad)),
        ONE_PROGRAM=one_program,
        num_warps=4,
    )
    return Grouping(sorted_rows, expert_ids, num_padded, block_m)
