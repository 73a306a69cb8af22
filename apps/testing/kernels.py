"""The kernel-set check: every op of a kernel set against the ``reference`` set's.

A kernel set is correct when its ops give what the reference's give, within
a bound per dtype, on the shapes a model runs: :func:`check_kernel_set`
draws them with Hypothesis (batches mixing whole prompts, chunks over a
cached prefix and decodes, over pages scattered in the cache; GQA ratios;
page and head sizes) and compares

- ``attention`` (and, with ``fp8=True``, the same over an fp8 cache read
  with ``kv_scale``);
- ``rope_and_store``: the rotated q and k, the cache slots it writes, and
  that no other slot changes; for a set that declares ``fuses_qk_norm``, the
  same with Qwen3's per-head q/k norms passed in (``qk_norm=``);
- ``rms_norm`` with and without the residual add, ``silu_and_mul`` and
  ``linear``.

An output must have the reference's shape, be finite everywhere, and lie
within ``TOLERANCE[dtype]`` of it (largest absolute difference over the
reference's largest magnitude). How a third party runs it::

    import torch
    from pitstop.testing.kernels import check_kernel_set

    def test_my_kernels_match_the_reference():
        check_kernel_set(lambda device, dtype: MyKernels(device, dtype), max_examples=20)

:func:`paged_batch` builds one random batch (metadata, caches, queries) and
:func:`paged_metadata` the metadata alone, for checks of your own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch
from hypothesis import given
from hypothesis import strategies as st

from pitstop.ground.attention import AttentionMetadata
from pitstop.plugin_system.protocols import KernelSet, KernelSetBase, RotaryCache
from pitstop.plugins.kernels import reference
from pitstop.testing._hypothesis import suite_settings

__all__ = [
    "TOLERANCE",
    "PagedBatch",
    "assert_close",
    "check_kernel_set",
    "paged_batch",
    "paged_metadata",
]

KernelFactory = Callable[[torch.device, torch.dtype], KernelSet]

# Largest |actual - expected| over the largest |expected|, per activation dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same shape, finite, and within :data:`TOLERANCE` of ``expected`` (by its dtype)."""
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    bound = TOLERANCE[expected.dtype]
    scale = expected.float().abs().max().clamp_min(1e-6)
    err = ((actual.float() - expected.float()).abs().max() / scale).item()
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound} ({expected.dtype})"


@attrs.frozen
class PagedBatch:
    """One step's queries over a paged cache: what ``attention`` and ``rope_and_store`` take."""

    meta: AttentionMetadata
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor


def paged_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    page_size: int,
    num_pages: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    padding: int = 1,
) -> AttentionMetadata:
    """The metadata of a batch laid out as the runner lays it out (prompts and chunks first).

    Sequence ``i`` computes its last ``query_lens[i]`` of ``context_lens[i]``
    tokens; its pages are drawn at random (seeded) from the ``num_pages`` of
    the cache. The block table has ``padding`` ``-1`` columns beyond the
    longest sequence's pages (1, as the runner pads; 0 leaves a kernel that
    reads past a sequence's pages nothing to read there).
    """
    order = sorted(range(len(query_lens)), key=lambda i: query_lens[i] == 1)
    qlens = [query_lens[i] for i in order]
    ctxs = [context_lens[i] for i in order]
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_pages, generator=gen).tolist()
    tables = []
    for c in ctxs:
        n = -(-c // page_size)
        table, free = free[:n], free[n:]
        tables.append(table)
    return metadata_from_tables(qlens, ctxs, tables, page_size, device, padding)


def metadata_from_tables(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    tables: Sequence[Sequence[int]],
    page_size: int,
    device: torch.device | str = "cpu",
    padding: int = 1,
) -> AttentionMetadata:
    """The metadata of a batch whose sequences (prompts and chunks first, then decodes) hold
    the given pages: sequence ``i`` computes its last ``query_lens[i]`` of
    ``context_lens[i]`` tokens, over ``tables[i]`` (a page may appear in several tables,
    as the prefix cache shares them); the block table is padded with ``-1`` to ``padding``
    columns beyond the longest."""
    positions, slots, cu = [], [], [0]
    for q, c, table in zip(query_lens, context_lens, tables, strict=True):
        for p in range(c - q, c):
            positions.append(p)
            slots.append(table[p // page_size] * page_size + p % page_size)
        cu.append(cu[-1] + q)
    width = max(len(t) for t in tables) + padding
    padded = [list(t) + [-1] * (width - len(t)) for t in tables]
    qlens, ctxs = list(query_lens), list(context_lens)
    num_prefills = sum(q > 1 for q in qlens)

    def dev(data: list, kind: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=kind, device=device)

    return AttentionMetadata(
        positions=dev(positions, torch.int64),
        slot_mapping=dev(slots, torch.int64),
        block_tables=dev(padded, torch.int32),
        context_lens=dev(ctxs, torch.int32),
        cu_query_lens=dev(cu, torch.int32),
        num_prefills=num_prefills,
        num_prefill_tokens=sum(q for q in qlens if q > 1),
        num_decodes=len(qlens) - num_prefills,
        max_query_len=max(qlens),
        max_context_len=max(ctxs),
        page_size=page_size,
        context_lens_list=ctxs,
        query_lens_list=qlens,
    )


def paged_batch(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """A batch (:func:`paged_metadata`) over a cache two pages larger than it needs, filled
    with random K and V, and its random queries."""
    num_pages = sum(-(-c // page_size) for c in context_lens) + 2
    meta = paged_metadata(query_lens, context_lens, page_size, num_pages, seed, device)
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (num_pages, page_size, num_kv_heads, head_size)
    return PagedBatch(
        meta=meta,
        q=torch.randn(meta.num_tokens, num_heads, head_size, generator=gen).to(device, dtype),
        k_cache=torch.randn(shape, generator=gen).to(device, dtype),
        v_cache=torch.randn(shape, generator=gen).to(device, dtype),
    )


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    """(query lengths, context lengths, page size): decodes, whole prompts and chunks."""
    page_size = draw(st.sampled_from([1, 4, 16]))
    qlens, ctxs = [], []
    for _ in range(draw(st.integers(1, 5))):
        ctx = draw(st.integers(1, 70))
        kind = draw(st.sampled_from(["decode", "prompt", "chunk"]))
        qlens.append(
            1 if kind == "decode" else ctx if kind == "prompt" else draw(st.integers(1, ctx))
        )
        ctxs.append(ctx)
    return qlens, ctxs, page_size


def _check_attention(
    ks: KernelSet, batch: PagedBatch, fp8: torch.dtype | None, kv_scale: tuple[float, float]
) -> None:
    k_cache, v_cache, extra = batch.k_cache, batch.v_cache, {}
    if fp8 is not None:
        scales = torch.tensor(kv_scale, dtype=torch.float32, device=k_cache.device)
        k_cache = reference.quantize_kv(k_cache * 3 * kv_scale[0], scales[0], fp8)
        v_cache = reference.quantize_kv(v_cache * kv_scale[1], scales[1], fp8)
        extra = {"kv_scale": scales}
    scale = batch.q.shape[-1] ** -0.5
    got = ks.attention(batch.q, k_cache, v_cache, batch.meta, scale, **extra)
    expected = reference.paged_attention(batch.q, k_cache, v_cache, batch.meta, scale, **extra)
    meta = batch.meta
    assert_close(got, expected, f"attention q={meta.query_lens_list} ctx={meta.context_lens_list}")


def _check_rope_and_store(
    ks: KernelSet, batch: PagedBatch, gen: torch.Generator, qk_norm: bool = False
) -> None:
    meta, q = batch.meta, batch.q
    t, hkv, d = q.shape[0], batch.k_cache.shape[2], q.shape[2]
    k = torch.randn(t, hkv, d, generator=gen).to(q.device, q.dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(q.device, q.dtype)
    angles = torch.outer(torch.arange(128).float(), torch.rand(d // 2, generator=gen))
    rotary = RotaryCache(angles.cos().to(q.device), angles.sin().to(q.device))
    caches = [c.clone() for c in (batch.k_cache, batch.v_cache)]
    expected_caches = [c.clone() for c in caches]
    norms = {}
    if qk_norm:  # Qwen3's per-head weights, for a set that declares it normalizes inside
        weights = tuple((torch.rand(d, generator=gen) + 0.5).to(q.device, q.dtype) for _ in "qk")
        norms = {"qk_norm": weights, "qk_norm_eps": 1e-6}
    q_out, k_out = ks.rope_and_store(q, k, v, rotary, caches[0], caches[1], meta, **norms)
    q_exp, k_exp = reference.rope_and_store(q, k, v, rotary, *expected_caches, meta, **norms)
    what = "rope_and_store" + (" with qk_norm" if qk_norm else "")
    assert_close(q_out, q_exp, f"{what}: q")
    assert_close(k_out, k_exp, f"{what}: k")
    flat = (-1, hkv, d)
    written = torch.zeros(caches[0].view(flat).shape[0], dtype=torch.bool, device=q.device)
    written[meta.slot_mapping] = True
    for name, got, exp, before in zip(
        "kv", caches, expected_caches, (batch.k_cache, batch.v_cache), strict=True
    ):
        got, exp, before = got.view(flat), exp.view(flat), before.view(flat)
        assert torch.equal(got[~written], before[~written]), (
            f"{name} cache: an unwritten slot changed"
        )
        assert_close(got[written], exp[written], f"{what}: {name} cache slots")


def _check_dense_ops(
    ks: KernelSet, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> None:
    rows, width = 7, 96

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    x, residual, weight = rand(rows, width), rand(rows, width), rand(width)
    got, got_res = ks.rms_norm(x, weight, 1e-6, residual.clone())
    exp, exp_res = reference.rms_norm(x, weight, 1e-6, residual.clone())
    assert_close(got, exp, "rms_norm with residual")
    assert got_res is not None and exp_res is not None
    assert_close(got_res, exp_res, "rms_norm: the new residual")
    assert_close(
        ks.rms_norm(x, weight, 1e-6)[0], reference.rms_norm(x, weight, 1e-6)[0], "rms_norm"
    )
    assert_close(ks.silu_and_mul(x), reference.silu_and_mul(x), "silu_and_mul")
    w, b = rand(40, width), rand(40)
    assert_close(ks.linear(x, w, b), torch.nn.functional.linear(x, w, b), "linear")


def check_kernel_set(
    make: KernelFactory,
    *,
    device: torch.device | str = "cpu",
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    fp8: bool = False,
    max_examples: int = 20,
) -> None:
    """Compare every op of ``make(device, dtype)`` with the reference's on drawn inputs; raise on a mismatch.

    ``fp8=True`` also checks attention over fp8 caches (e4m3 and e5m2) read
    with ``kv_scale``. Raises ``AssertionError`` naming the op, the batch
    and the error.
    """
    device = torch.device(device)
    kernel_sets: dict[torch.dtype, KernelSet] = {}
    caches = [None] + ([torch.float8_e4m3fn, torch.float8_e5m2] if fp8 else [])

    @suite_settings(max_examples)
    @given(
        batch=_batches(),
        heads=st.tuples(st.integers(1, 2), st.sampled_from([1, 2, 4])),
        head_size=st.sampled_from([16, 64]),
        dtype=st.sampled_from(list(dtypes)),
        cache=st.sampled_from(caches),
        kv_scale=st.tuples(st.sampled_from([1.0, 0.02]), st.sampled_from([1.0, 4.0])),
        seed=st.integers(0, 2**16),
    )
    def run(
        batch: tuple[list[int], list[int], int],
        heads: tuple[int, int],
        head_size: int,
        dtype: torch.dtype,
        cache: torch.dtype | None,
        kv_scale: tuple[float, float],
        seed: int,
    ) -> None:
        qlens, ctxs, page_size = batch
        kv_heads, group = heads
        if dtype not in kernel_sets:
            kernel_sets[dtype] = make(device, dtype)
        ks = kernel_sets[dtype]
        paged = paged_batch(
            qlens, ctxs, page_size, kv_heads * group, kv_heads, head_size, dtype, device, seed
        )
        gen = torch.Generator().manual_seed(seed)
        _check_attention(ks, paged, cache, kv_scale)
        _check_rope_and_store(ks, paged, gen)
        if KernelSetBase.of(ks, "fuses_qk_norm"):
            _check_rope_and_store(ks, paged, gen, qk_norm=True)
        _check_dense_ops(ks, dtype, device, gen)

    run()
