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
earlier ones, so :func:`route` counts nothing and no buffer needs zeroing first, and each
expert's rows keep their order.

:func:`route_and_align`: there, that one program routes too: one launch for the whole
routing half, writing what :func:`route` then :func:`align` write, bit for bit (it routes
with :func:`route`'s tiles and warps, :func:`route_tiles`, then reads the ids back).
Launches of the routing half: one up to ``ONE_PROGRAM_ROWS`` rows (:mod:`.moe` runs
:func:`route_and_align` there), two above (:func:`route` counting, :func:`align`) plus two
memsets (the counts and the align's slot counters).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops.launch_math import cdiv, next_power_of_2
from pitstop.plugins.kernels.triton_ops.rope_store import _rounded

ROUTE_TILE = 4096  # elements of the [BLOCK_T, E] tile a routing program holds
ALIGN_CHUNK = 8192  # elements of the [rows, E] one-hot tile an align program gathers through
# At most this many rows (T * k: decode up to 16 tokens at top-8) are grouped by one align
# program that counts and ranks them itself ([rows, E] and [rows, rows] tiles), so routing
# needs no counts and neither needs a zeroed buffer: two launches instead of four
ONE_PROGRAM_ROWS = 128


@triton.jit
def _route_rows(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    t,
    T,
    E,
    stride_t,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """Route the tokens ``t`` (a ``[BLOCK_T]`` vector; those past ``T`` are not stored):
    their top-k weights and ids stored at ``[t, j]``; returns the ids ``[BLOCK_T, K_PAD]``
    and the mask of the stored ones."""
    e = tl.arange(0, E_PAD)
    rows = tl.minimum(t, T - 1).to(tl.int64)  # past T: the last row again, never stored
    x = tl.load(
        logits_ptr + rows[:, None] * stride_t + e[None, :], mask=(e < E)[None, :], other=0.0
    )
    return _route_logits(x, weights_ptr, ids_ptr, t, T, E, TOPK, K_PAD, RENORMALIZE, BLOCK_T, E_PAD)


@triton.jit
def _route_logits(
    x,
    weights_ptr,
    ids_ptr,
    t,
    T,
    E,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """:func:`_route_rows` of the logits tile ``x [BLOCK_T, E_PAD]`` already in registers
    (their dtype's values; lanes past ``E`` ignored)."""
    e = tl.arange(0, E_PAD)
    kk = tl.arange(0, K_PAD)
    t_mask = t < T
    e_mask = e < E
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
    return ids, mask


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
    PDL: tl.constexpr,
):
    _pdl.wait(PDL)  # the router's logits
    _pdl.launch_dependents(PDL)  # the next kernel's programs may queue (they wait first)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ids, mask = _route_rows(
        logits_ptr,
        weights_ptr,
        ids_ptr,
        t,
        T,
        E,
        stride_t,
        TOPK,
        K_PAD,
        RENORMALIZE,
        BLOCK_T,
        E_PAD,
    )
    if COUNT:
        tl.atomic_add(counts_ptr + ids, 1, mask=mask)


def route_tiles(num_tokens: int, num_experts: int) -> tuple[int, int, int]:
    """``(BLOCK_T, E_PAD, num_warps)`` of a routing program: a ``[BLOCK_T, E_PAD]`` tile of at
    most :data:`ROUTE_TILE` elements (at least one row), 4 warps from 2048 elements, else 1.
    :func:`route_and_align` routes with the same tiles and warps, so that its float32
    softmax and renormalisation sums reduce in :func:`route`'s order on a GPU too."""
    e_pad = next_power_of_2(num_experts)
    block_t = max(1, min(next_power_of_2(max(num_tokens, 1)), ROUTE_TILE // e_pad))
    return block_t, e_pad, 4 if block_t * e_pad >= 2048 else 1


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
    block_t, e_pad, warps = route_tiles(t, e)
    use_pdl = _pdl.enabled(router_logits.device)
    _route_kernel[(cdiv(t, block_t),)](
        router_logits,
        weights,
        ids,
        counts if counts is not None else ids,
        t,
        e,
        router_logits.stride(0),
        TOPK=top_k,
        K_PAD=next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        COUNT=counts is not None,
        BLOCK_T=block_t,
        E_PAD=e_pad,
        PDL=use_pdl,
        num_warps=warps,
        **_pdl.launch_kwargs(use_pdl),
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
    return cdiv(worst, block_m) * block_m


@triton.jit
def _rank_rows(ids_ptr, r, r_mask, e):
    """Few rows, all in this program: each expert's count (``[E_PAD]``) and each row's rank
    among its expert's rows (``[CHUNK]``, by comparing it with the earlier rows); returns
    ``(experts of the rows, counts, ranks)``."""
    ex = tl.load(ids_ptr + r, mask=r_mask, other=-1)
    count = tl.sum(((ex[:, None] == e[None, :]) & r_mask[:, None]).to(tl.int32), axis=0)
    earlier = (ex[:, None] == ex[None, :]) & (r[None, :] < r[:, None]) & r_mask[None, :]
    slot = tl.sum(earlier.to(tl.int32), axis=1)
    return ex, count, slot


@triton.jit
def _place_rows(ex, count, slot, r, r_mask, e, sorted_ptr, BLOCK_M: tl.constexpr):
    """Store the rows ``r`` at their expert's padded start plus their rank ``slot``; returns
    each expert's padded row count and its groups' starts and ends (``[E_PAD]``)."""
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    start = tl.sum(tl.where(ex[:, None] == e[None, :], starts[None, :], 0), axis=1)
    tl.store(sorted_ptr + start + slot, r, mask=r_mask)
    return padded, starts, ends


@triton.jit
def _write_padding_and_blocks(
    count,
    padded,
    starts,
    ends,
    e_mask,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    N,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCKS_CHUNK: tl.constexpr,
):
    """The sentinel ``N`` in every expert's padding, the used row count, and each row
    block's expert (``-1`` past the used blocks)."""
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
    PDL: tl.constexpr,
):
    _pdl.wait(PDL)  # the ids (and counts) of the routing
    _pdl.launch_dependents(PDL)
    e = tl.arange(0, E_PAD)
    e_mask = e < E
    r = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    r_mask = r < N
    if ONE_PROGRAM:  # every row here: count them, and rank each among its expert's rows
        ex, count, slot = _rank_rows(ids_ptr, r, r_mask, e)
    else:
        count = tl.load(counts_ptr + e, mask=e_mask, other=0)
        ex = tl.load(ids_ptr + r, mask=r_mask, other=0)
        # this program's rows: each takes the next slot of its expert
        slot = tl.atomic_add(fill_ptr + ex, 1, mask=r_mask)
    padded, starts, ends = _place_rows(ex, count, slot, r, r_mask, e, sorted_ptr, BLOCK_M)
    if tl.program_id(0) == 0:
        _write_padding_and_blocks(
            count,
            padded,
            starts,
            ends,
            e_mask,
            sorted_ptr,
            expert_ids_ptr,
            total_ptr,
            N,
            num_blocks,
            BLOCK_M,
            BLOCKS_CHUNK,
        )


@triton.jit
def _group_routed(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    T,
    E,
    num_blocks,
    TOPK: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCKS_CHUNK: tl.constexpr,
):
    """The grouping half of :func:`_route_align_kernel`: the ``T * TOPK`` ids stored (and a
    barrier passed) read back and grouped as ``_align_kernel`` with ``ONE_PROGRAM`` does."""
    e = tl.arange(0, E_PAD)
    r = tl.arange(0, CHUNK)
    n = T * TOPK
    r_mask = r < n
    ex, count, slot = _rank_rows(ids_ptr, r, r_mask, e)
    padded, starts, ends = _place_rows(ex, count, slot, r, r_mask, e, sorted_ptr, BLOCK_M)
    _write_padding_and_blocks(
        count,
        padded,
        starts,
        ends,
        e < E,
        sorted_ptr,
        expert_ids_ptr,
        total_ptr,
        n,
        num_blocks,
        BLOCK_M,
        BLOCKS_CHUNK,
    )


@triton.jit
def _route_align_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    T,
    E,
    stride_t,
    num_blocks,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCKS_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """:func:`route` then :func:`align`'s one program, in one program: every token routed
    (``BLOCK_T`` at a time, as ``_route_kernel``'s programs do), then the ``T * TOPK`` ids
    just stored read back and grouped as ``_align_kernel`` with ``ONE_PROGRAM`` does."""
    _pdl.wait(PDL)  # the router's logits
    _pdl.launch_dependents(PDL)  # the gate-up GEMM's programs may queue (they wait first)
    for t0 in range(0, T, BLOCK_T):
        _route_rows(
            logits_ptr, weights_ptr, ids_ptr, t0 + tl.arange(0, BLOCK_T), T, E, stride_t,
            TOPK, K_PAD, RENORMALIZE, BLOCK_T, E_PAD,
        )  # fmt: skip
    tl.debug_barrier()  # the ids stored above by some threads are read below by others
    _group_routed(
        ids_ptr, sorted_ptr, expert_ids_ptr, total_ptr, T, E, num_blocks,
        TOPK, E_PAD, BLOCK_M, CHUNK, BLOCKS_CHUNK,
    )  # fmt: skip


def empty_grouping(num_rows: int, num_experts: int, block_m: int, device: torch.device) -> Grouping:
    """Unwritten buffers of a :class:`Grouping` of ``num_rows`` flat rows, of the worst-case
    size (:func:`max_padded_rows`), known on the host: no sync, CUDA-graph capturable."""
    rows = max_padded_rows(num_rows, num_experts, block_m)
    return Grouping(
        torch.empty(rows, dtype=torch.int32, device=device),
        torch.empty(rows // block_m, dtype=torch.int32, device=device),
        torch.empty(1, dtype=torch.int32, device=device),
        block_m,
    )


def _one_program_chunk(num_rows: int) -> int:
    """The row tile of the one program that groups ``num_rows`` rows itself (at least 16)."""
    return max(16, next_power_of_2(max(num_rows, 1)))


def _blocks_chunk(e_pad: int, num_blocks: int) -> int:
    """Row blocks whose expert program 0 finds at once (a ``[blocks, E_PAD]`` tile): at most
    :data:`ALIGN_CHUNK` elements, and no more blocks than the grouping has (decode of
    Qwen3-30B-A3B at batch 1: 8 blocks of 16 rows, a ``[16, 128]`` tile, where the element
    bound alone gave ``[64, 128]``: four times the compares for one warp)."""
    return max(16, min(128, ALIGN_CHUNK // e_pad, next_power_of_2(max(num_blocks, 1))))


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
    grouping = empty_grouping(n, num_experts, block_m, dev)
    e_pad = next_power_of_2(num_experts)
    if one_program:  # no counts, no slot counters: nothing to zero first
        chunk = _one_program_chunk(n)
        counts = fill = flat  # unread
    else:
        chunk = max(16, min(next_power_of_2(max(n, 1)), ALIGN_CHUNK // e_pad))
        fill = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    use_pdl = _pdl.enabled(ids.device)
    _align_kernel[(max(1, cdiv(n, chunk)),)](
        flat,
        counts,
        fill,
        grouping.sorted_rows,
        grouping.expert_ids,
        grouping.num_padded,
        n,
        num_experts,
        grouping.expert_ids.numel(),
        BLOCK_M=block_m,
        E_PAD=e_pad,
        CHUNK=chunk,
        BLOCKS_CHUNK=_blocks_chunk(e_pad, grouping.expert_ids.numel()),
        ONE_PROGRAM=one_program,
        PDL=use_pdl,
        num_warps=4,
        **_pdl.launch_kwargs(use_pdl),
    )
    return grouping


def route_and_align(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype | None,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, Grouping]:
    """:func:`route` then :func:`align` (``block_m``) in one launch, for at most
    :data:`ONE_PROGRAM_ROWS` flat rows (``not counts_needed(T * top_k)``): the same weights,
    ids and grouping, bit for bit (the routing's tiles and warps are :func:`route`'s, the
    grouping is the one-program align's). One program: it routes every token, then groups
    the rows. Fixed-size outputs, no host sync: CUDA-graph capturable. With programmatic
    dependent launch the gate-up GEMM's programs queue while it runs (they wait for it).
    """
    assert router_logits.dim() == 2, "router logits [T, E]"
    t, e = router_logits.shape
    assert 1 <= top_k <= min(e, 16), f"top_k={top_k} with {e} experts"
    assert not counts_needed(t * top_k), f"{t} x {top_k} rows: more than one align program"
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights, ids, grouping = routed_buffers(
        t, e, top_k, weights_dtype, block_m, router_logits.device
    )
    constants, warps = route_and_group_constants(t, e, top_k, renormalize, block_m)
    use_pdl = _pdl.enabled(router_logits.device)
    _route_align_kernel[(1,)](
        router_logits,
        weights,
        ids,
        grouping.sorted_rows,
        grouping.expert_ids,
        grouping.num_padded,
        t,
        e,
        router_logits.stride(0),
        grouping.expert_ids.numel(),
        **constants,
        PDL=use_pdl,
        num_warps=warps,
        **_pdl.launch_kwargs(use_pdl),
    )
    return weights, ids, grouping


def routed_buffers(
    t: int,
    e: int,
    top_k: int,
    weights_dtype: torch.dtype | None,
    block_m: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, Grouping]:
    """Unwritten ``weights [T, k]`` (``weights_dtype``, float32 for None), ``ids [T, k]``
    (int32) and :func:`empty_grouping` of the ``T * k`` rows, for one routing launch."""
    weights = torch.empty((t, top_k), dtype=weights_dtype or torch.float32, device=device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=device)
    return weights, ids, empty_grouping(t * top_k, e, block_m, device)


def route_and_group_constants(
    t: int, e: int, top_k: int, renormalize: bool, block_m: int
) -> tuple[dict[str, object], int]:
    """The constexprs of :func:`_route_align_kernel` (but ``PDL``) for ``t`` tokens of ``e``
    experts (the routing tiles :func:`route` takes, so the same reduction order), and its
    warps."""
    block_t, e_pad, warps = route_tiles(t, e)
    constants = dict(
        TOPK=top_k,
        K_PAD=next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        BLOCK_T=block_t,
        E_PAD=e_pad,
        BLOCK_M=block_m,
        CHUNK=_one_program_chunk(t * top_k),
        BLOCKS_CHUNK=_blocks_chunk(e_pad, max_padded_rows(t * top_k, e, block_m) // block_m),
    )
    return constants, warps
