"""Decode over shared prefix pages, each shared page read once a group (cascade decode).

Sequences that continue one cached prefix -- a system prompt found in the prefix cache, the
``n`` samples of one prompt, a rollout group -- hold the same physical pages at the start of
their block tables. The split-K decode reads every sequence's whole context, so a page that
eight sequences share is read eight times a step. With
``PagedAttention(prefix_share_tokens=N)`` (``fused.decode_prefix_share``) a decode step's
attention runs as three launches a layer and one a step:

1. :func:`group_decodes`, once a step (the first layer's call; captured with the step):
   one program finds each decode's group, the first decode whose block table starts with
   the same page, and the tokens it shares with that one: the leading pages both tables
   hold, capped below both last tokens (a sequence's last page is its own) and rounded down
   to ``align`` tokens. A decode sharing at least ``N`` tokens belongs to the group; a group
   of two or more shares the least of its members' counts (``start[b]``), and the first
   member's row of ``members`` lists the group (at most ``max_members``: the rest decode
   alone).
2. :func:`_shared_kernel`, grid ``(decodes, Hkv, share_splits)``: the program of a group's
   first member, for one KV head and one split of the shared range, holds the query heads
   of every member (``members x group`` rows of one tile), reads the shared pages once and
   writes each row's partial softmax state into the slots after the decode splits.
3. The decode kernel starts each member at ``start[b]``, over its own pages only, and the
   reduce merges all the slots (``_decode_reduce_kernel``, as for any split count).

The arithmetic is split-K decode's: softmax states over disjoint key ranges merged by their
maxima and sums, so the output equals the unshared decode's up to float32 rounding of the
merge. Nothing is read on the host and every buffer is sized by the batch, so a decode step
stays capturable in a CUDA graph. A sequence outside any group pays the merge of its empty
shared slots (a reduce launch where one split wrote the output directly before).

Measured on an H100 (docs/benchmarks.md, 2026-12-05): a layer of qwen3-8b's attention 1.5-1.9x
faster where groups share 4,096-8,192 tokens, 0.74-0.96x at 1,024, where L2 already serves
the members' repeated reads of the same few pages.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.triton_ops import attend
from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops.launch_math import cdiv, next_power_of_2

MAX_ROWS = 64  # query rows (members x group heads) of one shared-pass tile
_BIG = tl.constexpr(1 << 30)  # larger than any decode index or token count


class ShareLayout(NamedTuple):
    """One step's groups (:func:`group_decodes`), kept for every layer of the step."""

    start: torch.Tensor  # [nd] int32: tokens of the context the group's shared pass covers
    members: torch.Tensor  # [nd, max_members] int32: a group's decodes in its first's row
    max_members: int
    splits: int  # splits of the shared range: its slots follow the decode splits


def max_members(group: int) -> int:
    """Members whose query heads fit one tile of :data:`MAX_ROWS` rows (a power of two)."""
    fit = max(1, MAX_ROWS // group)
    return 1 << (fit.bit_length() - 1)


def share_splits(max_context: int, min_tokens: int) -> int:
    """Splits of a shared range: one per 512 tokens of the longest context, 2 to 16."""
    want = cdiv(max_context, max(512, min_tokens))
    return max(2, min(16, 1 << (max(want, 1).bit_length() - 1)))


def group_decodes(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    seq0: int,
    num_decodes: int,
    page_size: int,
    min_tokens: int,
    members_per_group: int,
    align: int,
    splits: int,
) -> ShareLayout:
    """The groups of the ``num_decodes`` decoding sequences from ``seq0`` (module docstring, 1).

    ``block_tables [S, W]`` (-1 padded) and ``context_lens [S]`` are the step's; a decode
    shares at least ``min_tokens`` tokens with its group's first or decodes alone.
    """
    device = block_tables.device
    start = torch.empty(num_decodes, dtype=torch.int32, device=device)
    leader = torch.empty(num_decodes, dtype=torch.int32, device=device)
    members = torch.empty((num_decodes, members_per_group), dtype=torch.int32, device=device)
    block_b = max(16, next_power_of_2(num_decodes))
    on_gpu = device.type == "cuda"
    _group_kernel[(1,)](
        block_tables,
        context_lens,
        start,
        leader,
        members,
        seq0,
        num_decodes,
        block_tables.shape[1],
        block_tables.stride(0),
        PAGE_SIZE=page_size,
        ALIGN=align,
        MIN_TOKENS=max(1, min_tokens),
        MAX_MEMBERS=members_per_group,
        BLOCK_B=block_b,
        CHUNK=32 if on_gpu else 8,
        PAGES=32 if on_gpu else 4,
        num_warps=8 if block_b > 256 else 4,
    )
    return ShareLayout(start, members, members_per_group, splits)


# seq0 and stride_bt change from step to step: one compiled variant a batch-size bucket
@triton.jit(do_not_specialize=["seq0", "nd", "max_pages", "stride_bt"])
def _group_kernel(
    block_tables_ptr,
    context_lens_ptr,
    start_ptr,
    leader_ptr,
    members_ptr,
    seq0,
    nd,
    max_pages,
    stride_bt,
    PAGE_SIZE: tl.constexpr,
    ALIGN: tl.constexpr,
    MIN_TOKENS: tl.constexpr,
    MAX_MEMBERS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    CHUNK: tl.constexpr,
    PAGES: tl.constexpr,
):
    """One program over all decodes: ``start``, ``members`` (``leader`` is scratch)."""
    b = tl.arange(0, BLOCK_B)
    valid = b < nd
    seq = (seq0 + b).to(tl.int64)
    ctx = tl.load(context_lens_ptr + seq, mask=valid, other=0)
    first = tl.load(block_tables_ptr + seq * stride_bt, mask=valid, other=-1)
    # each decode's group: the first decode whose table starts with the same page
    leader = b
    for c0 in range(0, nd, CHUNK):
        c = c0 + tl.arange(0, CHUNK)
        c_ok = c < nd
        first_c = tl.load(
            block_tables_ptr + (seq0 + c).to(tl.int64) * stride_bt, mask=c_ok, other=-2
        )
        same = (first[:, None] == first_c[None, :]) & c_ok[None, :] & (first >= 0)[:, None]
        leader = tl.minimum(leader, tl.min(tl.where(same, c[None, :], _BIG), axis=1))
    lead_seq = (seq0 + leader).to(tl.int64)
    # the leading pages each decode holds in common with its group's first (chunks of PAGES)
    common = tl.zeros([BLOCK_B], tl.int32)
    alive = valid & (leader != b)
    p0 = 0
    while (p0 < max_pages) & (tl.max(alive.to(tl.int32), axis=0) > 0):
        p = p0 + tl.arange(0, PAGES)
        pm = alive[:, None] & (p < max_pages)[None, :]
        mine = tl.load(block_tables_ptr + seq[:, None] * stride_bt + p[None, :], mask=pm, other=-1)
        theirs = tl.load(
            block_tables_ptr + lead_seq[:, None] * stride_bt + p[None, :], mask=pm, other=-2
        )
        equal = (mine == theirs) & (mine >= 0)
        run = tl.min(tl.where(equal, PAGES, tl.arange(0, PAGES)[None, :]), axis=1)
        common += tl.where(alive, run, 0)
        alive = alive & (run == PAGES)
        p0 += PAGES
    lead_ctx = tl.load(context_lens_ptr + lead_seq, mask=valid, other=0)
    below_last = tl.minimum(ctx, lead_ctx) - 1  # the pages of the last tokens are their own
    tokens = tl.where(leader == b, below_last, tl.minimum(common * PAGE_SIZE, below_last))
    share = tokens // ALIGN * ALIGN
    share = tl.where(valid & (share >= MIN_TOKENS), share, 0)
    tl.store(leader_ptr + b, leader, mask=valid)
    tl.store(start_ptr + b, share, mask=valid)
    tl.debug_barrier()  # every thread's stores before any thread's loads of them
    # per group: the least count of its sharing decodes, how many share, each one's rank
    least = tl.full([BLOCK_B], _BIG, tl.int32)
    size = tl.zeros([BLOCK_B], tl.int32)
    rank = tl.zeros([BLOCK_B], tl.int32)
    for c0 in range(0, nd, CHUNK):
        c = c0 + tl.arange(0, CHUNK)
        c_ok = c < nd
        lead_c = tl.load(leader_ptr + c, mask=c_ok, other=-1)
        share_c = tl.load(start_ptr + c, mask=c_ok, other=0)
        same = (leader[:, None] == lead_c[None, :]) & (share_c > 0)[None, :]
        least = tl.minimum(least, tl.min(tl.where(same, share_c[None, :], _BIG), axis=1))
        size += tl.sum(same.to(tl.int32), axis=1)
        rank += tl.sum((same & (c[None, :] < b[:, None])).to(tl.int32), axis=1)
    member = (share > 0) & (size >= 2) & (rank < MAX_MEMBERS)
    j = tl.arange(0, MAX_MEMBERS)
    tl.store(
        members_ptr + b[:, None] * MAX_MEMBERS + j[None, :],
        tl.full([BLOCK_B, MAX_MEMBERS], -1, tl.int32),
        mask=valid[:, None],
    )
    tl.debug_barrier()  # the loads of start above and the -1 fill before the writes below
    tl.store(members_ptr + leader * MAX_MEMBERS + rank, b, mask=valid & member)
    tl.store(start_ptr + b, tl.where(member, least, 0), mask=valid)


# q_row0, seq0 and stride_bt change every step: see the decode kernel
@triton.jit(do_not_specialize=["q_row0", "seq0", "stride_bt"])
def _shared_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scale_ptr,
    block_tables_ptr,
    start_ptr,
    members_ptr,
    part_o_ptr,
    part_ml_ptr,
    scale_log2e,
    q_row0,
    seq0,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    MAX_MEMBERS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HEAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SHARE_SPLITS: tl.constexpr,
    SLOTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
    WIDEN_F16: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(b, kvh, s)``: if decode ``b`` leads a group, its members' query heads of KV
    head ``kvh`` over split ``s`` of the shared range, into slot ``NUM_SPLITS + s``."""
    _pdl.wait(PDL)  # q, the cache and the groups: the kernels before
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    if tl.load(members_ptr + b * MAX_MEMBERS) == b:
        r = tl.arange(0, BLOCK_R)
        j = r // GROUP
        g = r % GROUP
        mem = tl.load(members_ptr + b * MAX_MEMBERS + j, mask=j < MAX_MEMBERS, other=-1)
        r_ok = (j < MAX_MEMBERS) & (mem >= 0)
        length = tl.load(start_ptr + b)
        per = tl.cdiv(tl.cdiv(length, SHARE_SPLITS), BLOCK_N) * BLOCK_N
        lo = tl.minimum(s * per, length)
        hi = tl.minimum(lo + per, length)
        full_end = lo + (hi - lo) // BLOCK_N * BLOCK_N
        d = tl.arange(0, HEAD)
        heads = kvh * GROUP + g
        tokens = (q_row0 + tl.where(r_ok, mem, 0)).to(tl.int64)
        q = tl.load(
            q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=r_ok[:, None],
            other=0.0,
        )
        # an fp8 cache under a bf16 query: fp16 operands, as the decode kernel (no qk-fp8 pass)
        q, q_up, scale_log2e, m_i, l_i, acc, table, k_ptr, v_ptr = attend._attend_begin(
            q, scale_log2e, kv_scale_ptr, block_tables_ptr, (seq0 + b).to(tl.int64), stride_bt,
            k_cache_ptr, v_cache_ptr, kvh, stride_ch, BLOCK_R, HEAD, QUANT, WIDEN_F16, False,
        )  # fmt: skip
        acc, m_i, l_i = attend._attend(
            acc, m_i, l_i, q, r, k_ptr, v_ptr, table, lo, full_end, hi, scale_log2e,
            stride_cp, stride_cs, PAGE_SIZE, BLOCK_N, HEAD, 0, DOT_PRECISION, UPCAST, q_up, False,
        )  # fmt: skip
        acc, m_i, l_i = attend._attend(
            acc, m_i, l_i, q, r, k_ptr, v_ptr, table, full_end, hi, hi, scale_log2e,
            stride_cp, stride_cs, PAGE_SIZE, BLOCK_N, HEAD, 1, DOT_PRECISION, UPCAST, q_up, False,
        )  # fmt: skip
        acc = attend._v_scaled(acc, kv_scale_ptr, QUANT)
        nkv = tl.num_programs(1)
        part = (tl.where(r_ok, mem, 0) * (GROUP * nkv) + heads).to(tl.int64) * SLOTS
        part += NUM_SPLITS + s
        tl.store(
            part_o_ptr + part[:, None] * HEAD + d[None, :], acc, mask=(r_ok & (l_i > 0))[:, None]
        )
        tl.store(part_ml_ptr + part * 2, m_i, mask=r_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=r_ok)
    _pdl.launch_dependents(PDL)


def shared_pass(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    layout: ShareLayout,
    part_o: torch.Tensor,
    part_ml: torch.Tensor,
    scale_log2e: float,
    q_row0: int,
    seq0: int,
    decode_splits: int,
    block_n: int,
    options: dict,
) -> None:
    """Launch :func:`_shared_kernel` over ``layout``'s groups (module docstring, 2).

    ``part_o [nd, Hq, slots, D]``, ``part_ml [nd, Hq, slots, 2]``; ``options``: the decode
    launch's compile-time switches (``DOT_PRECISION``, ``UPCAST``, ``QUANT``,
    ``WIDEN_F16``, ``PDL``) and launch options."""
    nd = layout.start.shape[0]
    hq, d = q.shape[1], q.shape[2]
    if q.device.type == "cuda":  # up to 64 query rows a tile: more warps than a decode tile's
        options = {**options, "num_warps": max(4, options.get("num_warps", 4))}
    hkv = k_cache.shape[2]
    group = hq // hkv
    _shared_kernel[(nd, hkv, layout.splits)](
        q,
        k_cache,
        v_cache,
        part_o if kv_scale is None else kv_scale,  # any pointer when the cache is not fp8
        block_tables,
        layout.start,
        layout.members,
        part_o,
        part_ml,
        scale_log2e,
        q_row0,
        seq0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        MAX_MEMBERS=layout.max_members,
        BLOCK_R=max(16, next_power_of_2(layout.max_members * group)),
        HEAD=d,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_N=block_n,
        NUM_SPLITS=decode_splits,
        SHARE_SPLITS=layout.splits,
        SLOTS=decode_splits + layout.splits,
        **options,
    )
