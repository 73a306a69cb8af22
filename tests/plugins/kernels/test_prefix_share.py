"""Decode over shared prefix pages (``PagedAttention(prefix_share_tokens=N)``): the groups
found on the device equal a plain-Python model of the rule, and the attention equals the
plain split-K decode's (and float64 attention), through Triton's interpreter on CPU.

Batches are drawn so that decodes share leading physical pages as the prefix cache makes
them share (a system prompt, the n samples of a prompt), with prompts before them in the
batch (their rows and sequences offset the decodes'), members whose shared count is short of
the minimum, and contexts that end inside or just past the shared pages; a fixed case has a
group larger than a tile holds.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

import pytest  # noqa: E402
from helpers.poison import poisoned_outputs  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pitstop.ground.attention import AttentionMetadata  # noqa: E402
from pitstop.testing.kernels import metadata_from_tables  # noqa: E402

pytest.importorskip("triton")

from pitstop.plugins.kernels.triton_ops import prefix_share  # noqa: E402
from pitstop.plugins.kernels.triton_ops.paged_attention import PagedAttention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
FEW = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def shared_batch(
    groups: list[tuple[int, list[int]]], prompts: list[int], page_size: int, seed: int
) -> tuple[AttentionMetadata, int]:
    """Prompts (whole, no cached prefix) first, then decodes: each group ``(shared pages,
    contexts of its decodes)`` puts the same ``shared pages`` physical pages first in every
    member's table (capped at the pages strictly before each member's last token), then
    pages of its own. Returns the metadata and the cache's page count."""
    gen = torch.Generator().manual_seed(seed)
    seqs: list[tuple[int, int, list[int]]] = []  # (query_len, context, table)
    next_page = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_page
        pages = list(range(next_page, next_page + n))
        next_page += n
        return pages

    for ctx in prompts:
        seqs.append((ctx, ctx, fresh(-(-ctx // page_size))))
    for shared_pages, ctxs in groups:
        common = fresh(shared_pages)
        for ctx in ctxs:
            pages = -(-ctx // page_size)
            mine = min(shared_pages, (ctx - 1) // page_size)  # the last token's page is its own
            seqs.append((1, ctx, common[:mine] + fresh(pages - mine)))
    # scatter the physical pages (a permutation keeps shared pages shared)
    perm = torch.randperm(next_page, generator=gen).tolist()
    tables = [[perm[p] for p in t] for _, _, t in seqs]
    qlens = [q for q, _, _ in seqs]
    ctxs = [c for _, c, _ in seqs]
    return metadata_from_tables(qlens, ctxs, tables, page_size, DEVICE), next_page


def expected_groups(
    meta: AttentionMetadata, min_tokens: int, members: int, align: int
) -> tuple[list[int], list[list[int]]]:
    """The grouping rule of :mod:`.prefix_share` in plain Python: ``(start, members)``."""
    seq0, nd, ps = meta.num_prefills, meta.num_decodes, meta.page_size
    tables = meta.block_tables.tolist()[seq0:]
    ctxs = meta.context_lens.tolist()[seq0:]
    leader = [min(c for c in range(nd) if tables[c][0] == tables[b][0]) for b in range(nd)]
    share = []
    for b in range(nd):
        lead = leader[b]
        below_last = min(ctxs[b], ctxs[lead]) - 1
        common = 0
        while common < len(tables[b]) and tables[b][common] >= 0:
            if tables[b][common] != tables[lead][common]:
                break
            common += 1
        tokens = below_last if lead == b else min(common * ps, below_last)
        tokens = tokens // align * align
        share.append(tokens if tokens >= min_tokens else 0)
    start = [0] * nd
    rows = [[-1] * members for _ in range(nd)]
    for lead in set(leader):
        sharing = [c for c in range(nd) if leader[c] == lead and share[c] > 0]
        if len(sharing) < 2:
            continue
        least = min(share[c] for c in sharing)
        for rank, c in enumerate(sharing[:members]):
            start[c] = least
            rows[lead][rank] = c
    return start, rows


def attention64(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:  # fmt: skip
    """Float64 attention of the decode rows (each over its whole context)."""
    seq0, ps = meta.num_prefills, meta.page_size
    hq, hkv = q.shape[1], k_cache.shape[2]
    out = torch.zeros(meta.num_decodes, hq, q.shape[2], dtype=torch.float64)
    for b in range(meta.num_decodes):
        ctx = int(meta.context_lens[seq0 + b])
        table = meta.block_tables[seq0 + b].tolist()
        idx = torch.tensor([table[n // ps] * ps + n % ps for n in range(ctx)])
        k = k_cache.reshape(-1, hkv, q.shape[2])[idx].double().cpu()
        v = v_cache.reshape(-1, hkv, q.shape[2])[idx].double().cpu()
        qb = q[meta.num_prefill_tokens + b].double().cpu()
        for h in range(hq):
            s = (k[:, h // (hq // hkv)] @ qb[h]) * scale
            out[b, h] = torch.softmax(s, 0) @ v[:, h // (hq // hkv)]
    return out


@st.composite
def groups_strategy(draw: st.DrawFn) -> tuple[list[tuple[int, list[int]]], int]:
    """Groups of decodes (shared pages, contexts) and the page size."""
    page_size = draw(st.sampled_from([4, 8, 16]))
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        shared = draw(st.integers(0, 6))
        size = draw(st.integers(1, 6))
        ctxs = [draw(st.integers(1, (shared + 3) * page_size + 1)) for _ in range(size)]
        groups.append((shared, ctxs))
    return groups, page_size


@FEW
@given(
    drawn=groups_strategy(),
    prompts=st.lists(st.integers(2, 20), max_size=2),
    heads=st.sampled_from([(2, 2), (4, 2), (8, 2), (4, 1)]),
    min_tokens=st.sampled_from([1, 16, 24]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_shared_decode_equals_plain_decode(
    drawn: tuple[list[tuple[int, list[int]]], int],
    prompts: list[int],
    heads: tuple[int, int],
    min_tokens: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    """Groups as the rule says; outputs equal the plain decode's and float64 attention."""
    groups, page_size = drawn
    meta, num_pages = shared_batch(groups, prompts, page_size, seed)
    hq, hkv = heads
    d = 64
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(meta.num_tokens, hq, d, generator=gen).to(DEVICE, dtype)
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen).to(DEVICE, dtype)
    scale = d**-0.5
    shared = PagedAttention(DEVICE, dtype, 512, prefix_share_tokens=min_tokens)
    plain = PagedAttention(DEVICE, dtype, 512)
    with poisoned_outputs():
        got = shared(q, k_cache, v_cache, meta, scale)
    want = plain(q, k_cache, v_cache, meta, scale)
    rows = slice(meta.num_prefill_tokens, None)
    err = (got[rows].float() - want[rows].float()).abs().max() / want[rows].float().abs().max()
    assert err <= TOL[dtype], f"against the plain decode: {err:.3g}"
    truth = attention64(q, k_cache, v_cache, meta, scale)
    err64 = (got[rows].double().cpu() - truth).abs().max() / truth.abs().max()
    assert err64 <= TOL[dtype], f"against float64: {err64:.3g}"
    assert torch.equal(got[: meta.num_prefill_tokens], want[: meta.num_prefill_tokens])
    if meta.num_decodes >= 2:
        members = prefix_share.max_members(hq // hkv)
        layout = shared._share_layout(
            q, None, k_cache, meta, hq // hkv, shared.decode_tiles(d, hq // hkv)
        )
        align = max(page_size, shared.decode_tiles(d, hq // hkv).block_n)
        start, rows_want = expected_groups(meta, min_tokens, members, align)
        assert layout.start.tolist() == start
        assert layout.members.tolist() == rows_want


def test_a_system_prompt_read_once_by_eight_decodes() -> None:
    """Eight decodes over one 96-token prefix (page 16) plus their own tokens: one group of
    eight sharing 96 tokens (the rule's 16-token alignment), and the plain decode's output."""
    ctxs = [97, 100, 110, 128, 129, 140, 150, 200]
    meta, num_pages = shared_batch([(6, ctxs)], [5], 16, 0)
    attn = PagedAttention(DEVICE, torch.float32, 512, prefix_share_tokens=32)
    q = torch.randn(meta.num_tokens, 4, 64, device=DEVICE)
    k_cache = torch.randn(num_pages, 16, 2, 64, device=DEVICE)
    v_cache = torch.randn(num_pages, 16, 2, 64, device=DEVICE)
    out = attn(q, k_cache, v_cache, meta, 0.125)
    layout = attn._share_step[2]
    assert layout.start.tolist() == [96] * 8
    assert layout.members[0].tolist()[:8] == list(range(8))
    assert (layout.members[1:] == -1).all()
    plain = PagedAttention(DEVICE, torch.float32, 512)(q, k_cache, v_cache, meta, 0.125)
    assert torch.allclose(out, plain, rtol=1e-5, atol=1e-5)
    # a second layer of the same step reuses the groups; a new step makes its own
    attn(q, k_cache, v_cache, meta, 0.125)
    assert attn._share_step[2] is layout
    meta2, _ = shared_batch([(6, ctxs)], [5], 16, 1)
    attn(q, k_cache, v_cache, meta2, 0.125)
    assert attn._share_step[2] is not layout


def test_a_group_larger_than_a_tile_holds() -> None:
    """16 query heads a KV head: a tile holds 4 members, so of a group of six the first four
    share the pass and the last two decode alone, and every output is the plain decode's."""
    meta, num_pages = shared_batch([(4, [70, 75, 80, 85, 90, 95])], [], 16, 5)
    q = torch.randn(meta.num_tokens, 16, 64, device=DEVICE)
    k = torch.randn(num_pages, 16, 1, 64, device=DEVICE)
    v = torch.randn(num_pages, 16, 1, 64, device=DEVICE)
    attn = PagedAttention(DEVICE, torch.float32, 512, prefix_share_tokens=16)
    with poisoned_outputs():
        out = attn(q, k, v, meta, 0.125)
    layout = attn._share_step[2]
    assert prefix_share.max_members(16) == 4
    assert layout.start.tolist() == [64, 64, 64, 64, 0, 0]
    assert layout.members[0].tolist() == [0, 1, 2, 3] and (layout.members[1:] == -1).all()
    want = PagedAttention(DEVICE, torch.float32, 512)(q, k, v, meta, 0.125)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)


def test_no_shared_pass_where_it_cannot_apply() -> None:
    """Off (0 tokens), one decode, or the one-launch merge: no groups are made."""
    meta, num_pages = shared_batch([(4, [70, 80])], [], 16, 0)
    q = torch.randn(meta.num_tokens, 2, 64, device=DEVICE)
    k_cache = torch.randn(num_pages, 16, 2, 64, device=DEVICE)
    tiles = PagedAttention(DEVICE, torch.float32, 512).decode_tiles(64, 1)
    for attn in (
        PagedAttention(DEVICE, torch.float32, 512),
        PagedAttention(DEVICE, torch.float32, 512, prefix_share_tokens=16,
                       decode_merge="last-program"),
    ):  # fmt: skip
        assert attn._share_layout(q, None, k_cache, meta, 1, tiles) is None
    one, _ = shared_batch([(4, [70])], [], 16, 0)
    attn = PagedAttention(DEVICE, torch.float32, 512, prefix_share_tokens=16)
    assert attn._share_layout(q[:1], None, k_cache, one, 1, tiles) is None
    assert prefix_share.max_members(4) == 16 and prefix_share.max_members(64) == 1
    assert prefix_share.max_members(6) == 8  # 10 fit; a power of two
    assert prefix_share.share_splits(4096, 256) == 8 and prefix_share.share_splits(512, 256) == 2


@pytest.mark.gpu
def test_shared_decode_regroups_in_every_cuda_graph_replay() -> None:
    """Captured once, replayed over three batches of the same shape whose groups differ (two
    groups of four, one of eight, none): each replay equals the plain decode of its batch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the H200)")
    specs = [[(6, [100] * 4), (6, [100] * 4)], [(6, [100] * 8)], [(0, [100] * 8)]]
    metas = [shared_batch(spec, [], 16, i)[0] for i, spec in enumerate(specs)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(64, 16, 8, 128, device="cuda", generator=gen).bfloat16()
    v = torch.randn(64, 16, 8, 128, device="cuda", generator=gen).bfloat16()
    q = torch.randn(8, 32, 128, device="cuda", generator=gen).bfloat16()
    static = metas[0]
    attn = PagedAttention(DEVICE, torch.bfloat16, 4096, prefix_share_tokens=32)
    attn(q, k, v, static, 0.088)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn(q, k, v, static, 0.088)
    plain = PagedAttention(DEVICE, torch.bfloat16, 4096)
    for meta in metas:
        static.block_tables.copy_(meta.block_tables)
        static.context_lens.copy_(meta.context_lens)
        graph.replay()
        want = plain(q, k, v, meta, 0.088)
        err = (out.float() - want.float()).abs().max() / want.float().abs().max()
        assert err <= TOL[torch.bfloat16], f"replay against the plain decode: {err:.3g}"


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_shared_decode_over_an_fp8_cache(cache_dtype: torch.dtype) -> None:
    """An fp8 cache with its scales (K's folded into the softmax scale, V's into the output,
    K/V widened to fp16 for bf16 queries): the shared pass equals the plain decode."""
    from pitstop.plugins.kernels import reference

    meta, num_pages = shared_batch([(5, [90, 95, 120]), (3, [60, 61])], [7], 16, 3)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(meta.num_tokens, 8, 64, generator=gen).to(DEVICE, torch.bfloat16)
    scales = torch.tensor([0.05, 0.02], dtype=torch.float32, device=DEVICE)
    shape = (num_pages, 16, 2, 64)
    k = reference.quantize_kv(
        torch.randn(shape, generator=gen).to(DEVICE) * 0.15, scales[0], cache_dtype
    )
    v = reference.quantize_kv(
        torch.randn(shape, generator=gen).to(DEVICE) * 0.02, scales[1], cache_dtype
    )
    shared = PagedAttention(DEVICE, torch.bfloat16, 512, prefix_share_tokens=16)
    with poisoned_outputs():
        got = shared(q, k, v, meta, 0.125, kv_scale=scales)
    assert int((shared._share_step[2].start > 0).sum()) == 5  # both groups share
    want = PagedAttention(DEVICE, torch.bfloat16, 512)(q, k, v, meta, 0.125, kv_scale=scales)
    rows = slice(meta.num_prefill_tokens, None)
    err = (got[rows].float() - want[rows].float()).abs().max() / want[rows].float().abs().max()
    assert err <= TOL[torch.bfloat16], f"fp8 cache, against the plain decode: {err:.3g}"
