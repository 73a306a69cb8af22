"""`fused` against `reference` on the GPU at realistic sizes (head 128, page 16, bf16, contexts to 4096).

Marked ``gpu``: skipped where torch sees no CUDA device (see tests/conftest.py).
Run on the H200 with ``pytest -q -m gpu tests/plugins/kernels/test_fused_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from pitstop.config import EngineConfig
from pitstop.entrypoints.engine_args import engine_config
from pitstop.ground.attention import AttentionMetadata
from pitstop.plugin_system.plugin_manager import get_plugin_manager
from pitstop.plugin_system.protocols import RotaryCache
from pitstop.plugins.kernels import reference
from pitstop.plugins.kernels.fused import FusedKernels
from pitstop.testing.kernels import paged_metadata

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def fused_set(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> FusedKernels:
    """The ``fused`` kernel set, built as the engine builds it (its settings read from ``config``)."""
    return get_plugin_manager().create("kernels", "fused", config, device, dtype)


def _fused(dtype: torch.dtype, **flags):
    ks = fused_set(engine_config(max_model_len=4096, **flags), torch.device("cuda"), dtype)
    ops = [k for k in reference.OPS if k != "linear"]  # the fused layer's ops: their own tests
    assert all(ks.describe()[k] == "triton" for k in ops), ks.describe()
    return ks


def _assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str
) -> None:
    assert torch.isfinite(actual).all(), f"{what}: non-finite output"
    err = (
        (actual.float() - expected.float()).abs().max()
        / expected.float().abs().max().clamp_min(1e-6)
    ).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]}"


def _poison_fill() -> None:
    import torch.utils.deterministic as det

    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True


@pytest.fixture(autouse=True)
def _poisoned():
    """Fresh outputs are NaN-filled so that an unwritten element fails."""
    was = torch.are_deterministic_algorithms_enabled()
    _poison_fill()
    yield
    torch.use_deterministic_algorithms(was)


def _meta(
    query_lens: list[int], context_lens: list[int], page_size: int, seed: int
) -> tuple[AttentionMetadata, int]:
    """A batch (prefills first) over shuffled pages, its block table exactly as wide as the
    longest sequence's pages; returns the metadata and the page count."""
    num_pages = sum(-(-c // page_size) for c in context_lens) + 8
    meta = paged_metadata(
        query_lens, context_lens, page_size, num_pages, seed, device="cuda", padding=0
    )
    return meta, num_pages


def _random_qkv(
    tokens: int, heads: tuple[int, int], num_pages: int, dtype: torch.dtype, seed: int,
    page_size: int = 16, head_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """q ``[tokens, Hq, D]`` and paged K/V ``[num_pages, page_size, Hkv, D]``, drawn in that
    order from one seeded CUDA generator."""
    hq, hkv = heads
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tokens, hq, head_size, device="cuda", dtype=dtype, generator=gen)
    shape = (num_pages, page_size, hkv, head_size)
    k_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    v_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    return q, k_cache, v_cache


BATCHES = {
    "decode-1x4096": ([1], [4096]),
    "decode-64x2048": ([1] * 64, [2048] * 64),
    "decode-ragged": ([1] * 9, [1, 15, 16, 17, 100, 511, 1024, 3000, 4096]),
    "prefill-4096": ([4096], [4096]),
    "prefill-batch": ([300, 77, 1024], [300, 77, 1024]),
    "chunked-mixed": ([512, 100, 1, 1, 1], [2048, 100, 33, 4000, 1]),
    "drafts": ([5, 5, 3, 1], [100, 4100, 17, 50]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads", [(32, 8), (16, 8), (16, 16)])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_attention_full_size(batch: str, heads: tuple[int, int], dtype: torch.dtype) -> None:
    """Decode, prefill and mixed batches at full size against the reference."""
    if dtype == torch.float32 and heads != (32, 8):
        pytest.skip("fp32 once is enough")
    qlens, ctxs = BATCHES[batch]
    meta, num_pages = _meta(qlens, ctxs, 16, seed=0)
    q, k_cache, v_cache = _random_qkv(sum(qlens), heads, num_pages, dtype, seed=0)
    out = _fused(dtype).attention(q, k_cache, v_cache, meta, 128**-0.5)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 128**-0.5)
    _assert_close(out, expected, dtype, batch)


# A chunk over a cached prefix that ends mid-page, a fresh prompt, a 5-token draft, decodes on either
# side of page and tile borders, one long decode: every path of both kernels in one launch each.
MIXED = ([1000, 777, 5, 1, 1, 1, 1, 1], [3001, 777, 4100, 1, 63, 64, 65, 4095])


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (64, 8)])
@pytest.mark.parametrize("head_size", [64, 128])
def test_attention_gqa_page_sizes(page_size: int, heads: tuple[int, int], head_size: int) -> None:
    """GQA 1, 4 and 8, head sizes 64 and 128, page sizes 1, 16 and 64 (bf16) against the reference."""
    hq, hkv = heads
    qlens, ctxs = MIXED
    meta, num_pages = _meta(qlens, ctxs, page_size, seed=page_size + hq)
    q, k_cache, v_cache = _random_qkv(
        sum(qlens), heads, num_pages, torch.bfloat16, hkv, page_size, head_size
    )
    out = _fused(torch.bfloat16).attention(q, k_cache, v_cache, meta, head_size**-0.5)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, head_size**-0.5)
    _assert_close(out, expected, torch.bfloat16, f"page {page_size} heads {heads} d {head_size}")


@pytest.mark.parametrize("case", ["prefill-16384", "chunk-2048-over-2048"])
def test_long_prefill_and_chunk(case: str) -> None:
    """The benchmarked prefill shapes (32/8 x 128, page 16, bf16) against the reference."""
    qlens, ctxs = {"prefill-16384": ([16384], [16384]), "chunk-2048-over-2048": ([2048], [4096])}[
        case
    ]
    meta, num_pages = _meta(qlens, ctxs, 16, seed=3)
    q, k_cache, v_cache = _random_qkv(qlens[0], (32, 8), num_pages, torch.bfloat16, seed=3)
    ks = fused_set(EngineConfig(max_model_len=16384), torch.device("cuda"), torch.bfloat16)
    out = ks.attention(q, k_cache, v_cache, meta, 128**-0.5)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 128**-0.5)
    _assert_close(out, expected, torch.bfloat16, case)


# cuDNN's long prefills (fused.cudnn_prefill): fresh prompts (one causal call), chunks over a
# cached prefix ending mid-page (two calls merged by their log-sum-exp), several prompts, and
# decodes beside them (the Triton decode kernel); the step below the threshold stays Triton.
# (threshold 1024 here: prompts and chunks from 1,024 tokens, chunks in a context from 4,096)
CUDNN_BATCHES = {
    "fresh-4096": ([4096], [4096]),
    "two-fresh": ([1024, 3001], [1024, 3001]),
    "chunk-4096-over-4105": ([4096], [8201]),
    "chunk-and-fresh-and-decodes": ([4500, 2048, 1, 1, 1], [9000, 2048, 17, 4096, 1]),
    "below-threshold": ([1023, 4096], [1023, 4096]),
    "short-context-chunk": ([2048], [4000]),
    "chunk-1024-over-7000": ([1024], [8024]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(32, 8), (16, 16)])
@pytest.mark.parametrize("batch", sorted(CUDNN_BATCHES))
def test_cudnn_long_prefill(batch: str, heads: tuple[int, int], dtype: torch.dtype) -> None:
    """Long prefills through cuDNN match the reference as closely as the Triton kernel does,
    and cuDNN really ran (it was not switched off by an error) where the step qualifies."""
    qlens, ctxs = CUDNN_BATCHES[batch]
    meta, num_pages = _meta(qlens, ctxs, 16, seed=7)
    q, k_cache, v_cache = _random_qkv(sum(qlens), heads, num_pages, dtype, seed=7)
    ks = fused_set(
        EngineConfig(max_model_len=16384, options={"fused.cudnn_prefill": 1024}),
        torch.device("cuda"),
        dtype,
    )
    assert ks.describe()["long_prefill"].startswith("cuDNN"), ks.describe()
    cudnn = ks._attn.long_prefill
    taken = cudnn.applies(q, k_cache, meta)
    assert taken == (batch not in ("below-threshold", "short-context-chunk"))
    out = ks.attention(q, k_cache, v_cache, meta, 128**-0.5)
    assert cudnn.disabled_reason is None, cudnn.disabled_reason
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 128**-0.5)
    _assert_close(out, expected, dtype, batch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4096), (300, 4096), (64, 1024), (8, 5120)])
def test_rms_norm_full_size(shape: tuple[int, int], dtype: torch.dtype) -> None:
    """Residual add + RMSNorm at hidden sizes of the presets."""
    x = torch.randn(shape, device="cuda", dtype=dtype)
    r = torch.randn(shape, device="cuda", dtype=dtype)
    w = 1 + 0.1 * torch.randn(shape[1], device="cuda", dtype=dtype)
    out, res = _fused(dtype).rms_norm(x, w, 1e-6, r)
    ref_out, ref_res = reference.rms_norm(x, w, 1e-6, r)
    _assert_close(out, ref_out, dtype, "normed")
    assert res is not None and torch.equal(res, ref_res)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_full_size(dtype: torch.dtype) -> None:
    """SiLU-and-mul at qwen3-8b's FFN width."""
    x = torch.randn(257, 2 * 12288, device="cuda", dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    _assert_close(_fused(dtype).silu_and_mul(x), torch.nn.functional.silu(gate) * up, dtype, "silu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_and_store_full_size(dtype: torch.dtype) -> None:
    """Rotary + KV store for a mixed batch: slots equal the reference's, nothing else changes."""
    meta, num_pages = _meta([1000, 1, 1, 17], [3000, 4096, 5, 17], 16, seed=1)
    t, hq, hkv, d = meta.num_tokens, 32, 8, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=dtype)
    q, k, v = (x.reshape(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    angles = torch.outer(
        torch.arange(4096, device="cuda").float(), torch.rand(d // 2, device="cuda")
    )
    rotary = RotaryCache(angles.cos(), angles.sin())
    k_cache = torch.randn(num_pages, 16, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_out, k_out = _fused(dtype).rope_and_store(q, k, v, rotary, k_cache, v_cache, meta)
    q_exp, k_exp = reference.ReferenceKernels("cuda", dtype).rope_and_store(
        q, k, v, rotary, k_ref, v_ref, meta
    )
    _assert_close(q_out, q_exp, dtype, "q")
    _assert_close(k_out, k_exp, dtype, "k")
    _assert_close(k_cache, k_ref, dtype, "k cache")
    assert torch.equal(v_cache, v_ref)


def test_rope_and_store_with_qk_norm_full_size() -> None:
    """Qwen3's q/k norm inside rotary + store (bf16, qwen3-0.6b's 16 and 8 heads of 128) against
    the reference's ``rms_norm`` then ``rope_and_store``: q, k and the cache within the bf16 bound,
    v copied; two padding rows (slot -1) store nothing."""
    import attrs

    dtype, page_size = torch.bfloat16, 16
    meta, num_pages = _meta([1000, 1, 1, 17], [3000, 4096, 5, 17], page_size, seed=2)
    pad = torch.tensor([7, 4000], device="cuda")
    meta = attrs.evolve(
        meta,
        positions=torch.cat([meta.positions, pad]),
        slot_mapping=torch.cat([meta.slot_mapping, torch.full_like(pad, -1)]),
    )
    t, hq, hkv, d = meta.num_tokens, 16, 8, 128
    qkv = 3 * torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=dtype)
    q, k, v = (x.reshape(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    weights = tuple(1 + 0.2 * torch.randn(d, device="cuda", dtype=dtype) for _ in "qk")
    angles = torch.outer(
        torch.arange(4096, device="cuda").float(), torch.rand(d // 2, device="cuda")
    )
    rotary = RotaryCache(angles.cos(), angles.sin())
    # the reference's caches have one more page, where its padding rows are sent
    k_ref = torch.randn(num_pages + 1, page_size, hkv, d, device="cuda", dtype=dtype)
    v_ref = torch.randn_like(k_ref)
    k_cache, v_cache = k_ref[:num_pages].clone(), v_ref[:num_pages].clone()
    spare = num_pages * page_size + torch.arange(t, device="cuda") % page_size
    ref_meta = attrs.evolve(
        meta, slot_mapping=torch.where(meta.slot_mapping >= 0, meta.slot_mapping, spare)
    )
    ks = _fused(dtype)
    assert ks.fuses_qk_norm
    q_out, k_out = ks.rope_and_store(
        q, k, v, rotary, k_cache, v_cache, meta, qk_norm=weights, qk_norm_eps=1e-6
    )
    ref = reference.ReferenceKernels("cuda", dtype)
    qn, kn = (ref.rms_norm(x, w, 1e-6)[0] for x, w in zip((q, k), weights, strict=True))
    q_exp, k_exp = ref.rope_and_store(qn, kn, v, rotary, k_ref, v_ref, ref_meta)
    _assert_close(q_out, q_exp, dtype, "q")
    _assert_close(k_out, k_exp, dtype, "k")
    _assert_close(k_cache, k_ref[:num_pages], dtype, "k cache")
    assert torch.equal(v_cache, v_ref[:num_pages])


def test_decode_attention_is_graph_capturable() -> None:
    """A decode launch replays from a CUDA graph for other context lengths and gives the eager result."""
    ks = _fused(torch.bfloat16)
    meta, num_pages = _meta([1] * 8, [4000] * 8, 16, seed=2)
    q = torch.randn(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(num_pages, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    ctx = meta.context_lens
    ks.attention(q, k_cache, v_cache, meta, 0.088)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ks.attention(q, k_cache, v_cache, meta, 0.088)
    ctx.copy_(torch.tensor([1, 16, 17, 300, 1000, 2048, 3999, 4000], dtype=torch.int32))
    graph.replay()
    lens = ctx.tolist()
    eager_meta = AttentionMetadata(
        positions=meta.positions,
        slot_mapping=meta.slot_mapping,
        block_tables=meta.block_tables,
        context_lens=ctx,
        cu_query_lens=meta.cu_query_lens,
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=8,
        max_query_len=1,
        max_context_len=max(lens),
        page_size=16,
        context_lens_list=lens,
        query_lens_list=[1] * 8,
    )
    expected = reference.paged_attention(q, k_cache, v_cache, eager_meta, 0.088)
    _assert_close(out, expected, torch.bfloat16, "graph replay")


def _with_lens(meta: AttentionMetadata, lens: list[int]) -> AttentionMetadata:
    """``meta`` of decodes only, its context lengths ``lens`` (written into its device tensor)."""
    meta.context_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    return AttentionMetadata(
        positions=meta.positions,
        slot_mapping=meta.slot_mapping,
        block_tables=meta.block_tables,
        context_lens=meta.context_lens,
        cu_query_lens=meta.cu_query_lens,
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=len(lens),
        max_query_len=1,
        max_context_len=max(lens),
        page_size=meta.page_size,
        context_lens_list=lens,
        query_lens_list=[1] * len(lens),
    )


@pytest.mark.parametrize("cache", ["bf16", "e4m3"])
@pytest.mark.parametrize("shape", [(1, 4096), (8, 2048), (3, 1000)], ids=str)
def test_decode_last_program_merge_replays_from_a_cuda_graph(
    shape: tuple[int, int], cache: str
) -> None:
    """Issue 29: ``decode_merge="last-program"`` (the split arriving last merges, in one launch).

    Four launches (a model's layers: four queries, the same counters) captured in one CUDA graph
    and replayed 300 times, the contexts redrawn every 30 replays (shorter ones leave splits
    empty; scratch is NaN-filled at every replay): every replay gives the same bits as the first
    replay of its contexts (the merge sums in split order, whatever order the splits arrive in:
    a race that read a partial too early would show here), within an ulp of the ``separate``
    merge and within the bf16 bound of the reference, and leaves every counter at zero.
    """
    from pitstop.plugins.kernels.triton_ops.paged_attention import PagedAttention

    batch, ctx = shape
    hq, hkv, d = 32, 8, 128
    meta, num_pages = _meta([1] * batch, [ctx] * batch, 16, seed=5)
    shape4 = (num_pages, 16, hkv, d)
    if cache == "bf16":
        k_cache = torch.randn(shape4, device="cuda", dtype=torch.bfloat16)
        v_cache, scales = torch.randn_like(k_cache), None
    else:
        k_cache, v_cache, scales = _fp8_caches(shape4, torch.float8_e4m3fn, (0.05, 0.02), 4)
    qs = [torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    scale = d**-0.5
    sep = PagedAttention(torch.device("cuda"), torch.bfloat16, 4096)
    last = PagedAttention(torch.device("cuda"), torch.bfloat16, 4096, decode_merge="last-program")
    assert last.num_splits(batch, hkv) > 1 and last.decode_counters is not None
    for q in qs:  # compile outside the capture
        last(q, k_cache, v_cache, meta, scale, scales)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [last(q, k_cache, v_cache, meta, scale, scales) for q in qs]
    gen = torch.Generator().manual_seed(0)
    first: list[torch.Tensor] = []
    for i in range(300):
        if i % 30 == 0:
            lens = torch.randint(1, ctx + 1, (batch,), generator=gen).tolist()
            lens[0] = ctx if i == 0 else lens[0]
            eager_meta = _with_lens(meta, lens)
            separate = [sep(q, k_cache, v_cache, eager_meta, scale, scales) for q in qs]
            expected = [
                reference.paged_attention(q, k_cache, v_cache, eager_meta, scale, scales)
                for q in qs
            ]
            first = []
        graph.replay()
        torch.cuda.synchronize()
        assert not last.decode_counters.any(), f"replay {i}: counters left non-zero"
        if not first:
            first = [o.clone() for o in outs]
            for j, o in enumerate(outs):
                what = f"replay {i} layer {j} lens {lens}"
                _assert_close(o, expected[j], torch.bfloat16, what)
                a, e = o.double(), separate[j].double()
                bound = 2**-7 * e.abs() + 2**-16 * e.abs().max()
                assert ((a - e).abs() <= bound).all(), f"{what}: past an ulp of separate"
        for j, o in enumerate(outs):
            assert torch.equal(o, first[j]), f"replay {i} layer {j} lens {lens}: bits changed"


def _dummy_runner(kernels: str, dtype: torch.dtype, kv_cache_dtype: str = "auto"):
    """A ModelRunner of the dummy ``qwen3-0.6b`` shape on CUDA (same seeded weights for every kernel set)."""
    from pitstop.plugin_system.plugin_manager import PluginManager
    from pitstop.plugins.models.llama_presets import PRESETS
    from pitstop.runner.model_runner import ModelRunner

    config = EngineConfig(
        model="dummy:qwen3-0.6b",
        max_model_len=1024,
        kernels=kernels,
        device="cuda",
        max_num_pages=512,
        kv_cache_dtype=kv_cache_dtype,
    )
    runner = ModelRunner(
        config, PRESETS["qwen3-0.6b"], PluginManager(), torch.device("cuda"), dtype
    )
    runner.load_weights(None)
    runner.init_kv_cache(512)
    return runner


def _greedy(runner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill every prompt in one step, then ``steps`` greedy decode steps of the whole batch."""
    from pitstop.entrypoints.sampling_params import SamplingParams
    from pitstop.ground.step import SeqInput, StepInput

    greedy = SamplingParams(temperature=0.0)
    tables = [list(range(i * 64, (i + 1) * 64)) for i in range(len(prompts))]
    seqs = [SeqInput(i, p, 0, tables[i], True, greedy) for i, p in enumerate(prompts)]
    out = [[t] for t in runner.execute(StepInput(seqs)).token_ids]
    for _ in range(steps):
        seqs = [
            SeqInput(i, [out[i][-1]], len(p) + len(out[i]) - 1, tables[i], True, greedy)
            for i, p in enumerate(prompts)
        ]
        for i, tok in enumerate(runner.execute(StepInput(seqs)).token_ids):
            out[i].append(tok)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_qwen3_greedy_matches_reference(dtype: torch.dtype) -> None:
    """Greedy tokens of a dummy qwen3-0.6b: identical in fp32; in bf16 logits no further from fp32 than the reference's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 151936, (n,), generator=gen).tolist() for n in (17, 130, 400, 1)]
    prompts[-1] = prompts[-1] * 2  # a 2-token prompt
    ref = _greedy(_dummy_runner("reference", dtype), prompts, steps=40)
    fused = _greedy(_dummy_runner("fused", dtype), prompts, steps=40)
    if dtype == torch.float32:
        assert fused == ref
        return
    # bf16: greedy paths part at near-ties, so compare logits along the reference's own path
    # (teacher forcing) against the float32 truth: fused may err no more than the reference's
    # own bf16 arithmetic does (with some slack), and never produce NaN.
    seqs = [p + t for p, t in zip(prompts, ref, strict=True)]
    truth = _logits(_dummy_runner("reference", torch.float32), seqs)
    ref_err = (_logits(_dummy_runner("reference", dtype), seqs) - truth).abs().max().item()
    fused_logits = _logits(_dummy_runner("fused", dtype), seqs)
    assert not fused_logits.isnan().any()
    fused_err = (fused_logits - truth).abs().max().item()
    assert fused_err <= 2 * ref_err + 1e-3, (fused_err, ref_err)


def _logits(runner, seqs: list[list[int]]) -> torch.Tensor:
    """Float32 logits of every position of every sequence, all prefilled in one step."""
    from pitstop.ground.step import SeqInput

    tables = [list(range(i * 64, (i + 1) * 64)) for i in range(len(seqs))]
    ids, meta, _ = runner.build_metadata(
        [SeqInput(i, s, 0, tables[i], False) for i, s in enumerate(seqs)]
    )
    with torch.inference_mode():
        hidden = runner.model(ids, runner.rotary, runner.kv_cache, meta)
        return runner.model.compute_logits(hidden).float()


# ---------------------------------------------------------------- fp8 KV cache (issue 15)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fp8_caches(
    shape: tuple[int, ...], cache_dtype: torch.dtype, kv_scale: tuple[float, float], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K (about 3 scales wide) and V (about 1) quantized by the reference, and the scales."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scales = torch.tensor(kv_scale, dtype=torch.float32, device="cuda")
    k = torch.randn(shape, device="cuda", generator=gen) * 3 * kv_scale[0]
    v = torch.randn(shape, device="cuda", generator=gen) * kv_scale[1]
    return (
        reference.quantize_kv(k, scales[0], cache_dtype),
        reference.quantize_kv(v, scales[1], cache_dtype),
        scales,
    )


@pytest.mark.parametrize("kv_scale", [(1.0, 1.0), (0.05, 0.02)])
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_attention_fp8_cache_full_size(
    batch: str, cache_dtype: torch.dtype, kv_scale: tuple[float, float]
) -> None:
    """Decode, prefill and mixed batches over an fp8 cache (bf16 queries, 32/8 heads) against the reference."""
    _check_fp8_attention(BATCHES[batch], (32, 8), 128, 16, cache_dtype, kv_scale, batch)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [(32, 32), (64, 8)])
def test_attention_fp8_cache_gqa_page_sizes(page_size: int, heads: tuple[int, int]) -> None:
    """GQA 1 and 8, page sizes 1, 16 and 64, every kernel path in one batch, e4m3 cache."""
    _check_fp8_attention(
        MIXED, heads, 128, page_size, torch.float8_e4m3fn, (0.1, 0.05), f"page {page_size} {heads}"
    )


def _check_fp8_attention(
    batch: tuple[list[int], list[int]],
    heads: tuple[int, int],
    head_size: int,
    page_size: int,
    cache_dtype: torch.dtype,
    kv_scale: tuple[float, float],
    what: str,
) -> None:
    hq, hkv = heads
    qlens, ctxs = batch
    meta, num_pages = _meta(qlens, ctxs, page_size, seed=0)
    q = torch.randn(sum(qlens), hq, head_size, device="cuda", dtype=torch.bfloat16)
    shape = (num_pages, page_size, hkv, head_size)
    k_cache, v_cache, scales = _fp8_caches(shape, cache_dtype, kv_scale, 1)
    scale = head_size**-0.5
    out = _fused(torch.bfloat16, kv_cache_dtype="fp8_e4m3").attention(
        q, k_cache, v_cache, meta, scale, scales
    )
    expected = reference.paged_attention(q, k_cache, v_cache, meta, scale, scales)
    _assert_close(out, expected, torch.bfloat16, f"{what} {cache_dtype}")


@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (64, 8)])
@pytest.mark.parametrize("batch", ["decode-ragged", "chunked-mixed", "prefill-batch"])
def test_fp8_widened_to_fp16_full_size(batch: str, heads: tuple[int, int]) -> None:
    """Issue 29: bf16 queries over e4m3 pages (scales 0.05, 0.02) with fp16 operands, and with
    queries past fp16's range (x 3e5, the softmax scale divided back): within 1e-2 of a float32
    truth over the same bytes (half a bf16 ulp of the largest output, 2^-8, plus the fp16
    probabilities' rounding), and no less accurate than ``fp8_widen="query"`` but by 2^-9;
    ``"qk-fp8"`` within 1e-2 of the truth over the query it rounds to e4m3."""
    from pitstop.plugins.kernels.triton_ops.paged_attention import FP8_WIDEN, PagedAttention

    hq, hkv = heads
    qlens, ctxs = BATCHES[batch]
    meta, num_pages = _meta(qlens, ctxs, 16, seed=2)
    k_cache, v_cache, scales = _fp8_caches(
        (num_pages, 16, hkv, 128), torch.float8_e4m3fn, (0.05, 0.02), 3
    )
    for q_mul in (1.0, 3e5):
        q = (torch.randn(sum(qlens), hq, 128, device="cuda") * q_mul).to(torch.bfloat16)
        scale = 128**-0.5 / q_mul
        truth = reference.paged_attention(q.float(), k_cache, v_cache, meta, scale, scales)
        errs = {}
        for widen in FP8_WIDEN:
            attn = PagedAttention(torch.device("cuda"), torch.bfloat16, 4096, fp8_widen=widen)
            out = attn(q, k_cache, v_cache, meta, scale, scales)
            assert torch.isfinite(out).all(), f"{widen} x{q_mul}: non-finite output"
            if widen == "qk-fp8":  # held to attention over the query it rounds to e4m3
                rounded = reference.round_query_e4m3(q)
                over = reference.paged_attention(rounded, k_cache, v_cache, meta, scale, scales)
                errs["qk-fp8 over its query"] = (
                    (out.float() - over).abs().max() / over.abs().max()
                ).item()
            errs[widen] = ((out.float() - truth).abs().max() / truth.abs().max()).item()
        assert errs["fp16"] <= 1e-2 and errs["fp16"] <= errs["query"] + 2**-9, (q_mul, errs)
        assert errs["qk-fp8 over its query"] <= 1e-2, (q_mul, errs)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_and_store_fp8_full_size(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """The fp8 bytes stored are the reference's quantization of the same rotated k and of v, bit for
    bit, outliers (1e4 x, past e4m3's 448) saturated; no other slot changes."""
    meta, num_pages = _meta([1000, 1, 1, 17], [3000, 4096, 5, 17], 16, seed=1)
    t, hq, hkv, d = meta.num_tokens, 32, 8, 128
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=dtype) for h in (hq, hkv, hkv))
    k[::7] *= 1e4
    v[3::11] *= -1e4
    angles = torch.outer(
        torch.arange(4096, device="cuda").float(), torch.rand(d // 2, device="cuda")
    )
    rotary = RotaryCache(angles.cos(), angles.sin())
    scales = torch.tensor([0.5, 0.25], device="cuda")
    shape = (num_pages, 16, hkv, d)
    k_cache = torch.randn(shape, device="cuda").to(cache_dtype)
    v_cache = torch.randn(shape, device="cuda").to(cache_dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    ks = _fused(dtype, kv_cache_dtype="fp8_e4m3")
    _, k_out = ks.rope_and_store(q, k, v, rotary, k_cache, v_cache, meta, scales)
    written = torch.zeros(num_pages * 16, dtype=torch.bool, device="cuda")
    written[meta.slot_mapping] = True
    flat = (num_pages * 16, hkv, d)
    for got, before, x, sc in ((k_cache, k0, k_out, scales[0]), (v_cache, v0, v, scales[1])):
        got, before = got.view(flat), before.view(flat)
        # index through uint8 views: torch has no index kernels for float8 on every device
        got_bytes, before_bytes = got.view(torch.uint8), before.view(torch.uint8)
        assert torch.equal(got_bytes[~written], before_bytes[~written])
        stored = reference.gather_pages(got, meta.slot_mapping).float()
        assert torch.isfinite(stored).all()
        assert stored.abs().max() == torch.finfo(cache_dtype).max  # the outliers, saturated
        expected = reference.quantize_kv(x, sc, cache_dtype).float()
        assert torch.equal(stored, expected), (stored != expected).sum().item()


def test_fp8_kernels_run_triton_on_this_gpu() -> None:
    """On compute capability 8.9+ the cache ops stay in Triton with an fp8 cache (and are graph-safe)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 conversions in Triton need compute capability 8.9")
    ks = _fused(torch.bfloat16, kv_cache_dtype="fp8_e4m3")
    assert ks.cuda_graph_safe(128)


def test_dummy_qwen3_fp8_cache_fused_is_as_accurate_as_reference() -> None:
    """A dummy qwen3-0.6b in bf16 with an fp8 cache: along the reference's greedy path, fused
    logits are no further from the float32 truth (wide cache) than the reference kernels' own
    (fp8 rounding amplifies last-bit differences, so the two are not compared with each other)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 151936, (n,), generator=gen).tolist() for n in (17, 130, 400, 2)]
    ref_fp8 = _dummy_runner("reference", torch.bfloat16, kv_cache_dtype="fp8_e4m3")
    path = _greedy(ref_fp8, prompts, steps=24)
    seqs = [p + t for p, t in zip(prompts, path, strict=True)]
    truth = _logits(_dummy_runner("reference", torch.float32), seqs)
    ref_err = (_logits(ref_fp8, seqs) - truth).abs().max().item()
    fused = _logits(_dummy_runner("fused", torch.bfloat16, kv_cache_dtype="fp8_e4m3"), seqs)
    assert torch.isfinite(fused).all()
    fused_err = (fused - truth).abs().max().item()
    assert fused_err <= 2 * ref_err + 1e-3, (fused_err, ref_err)


@pytest.mark.parametrize("cache", ["bf16", "e4m3"])
@pytest.mark.parametrize("shape", [(256, 512), (64, 2048), (1, 4096)], ids=str)
def test_by_batch_decode_tiles_match_the_reference(cache: str, shape: tuple[int, int]) -> None:
    """Issue 29: ``fused.decode_tiles = "by-batch"`` (the sweep's tiles: 32 keys and one warp
    from 128 decodes, 64 keys / two warps / two stages for fp8 below) against the reference,
    at the batch sizes that pick each tile, bf16 and e4m3 caches."""
    from pitstop.plugins.kernels.triton_ops import paged_attention as pa

    batch, context = shape
    meta, num_pages = _meta([1] * batch, [context] * batch, 16, seed=4)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    flags = {"options": {"fused.decode_tiles": "by-batch"}}
    if cache == "e4m3":
        k_cache, v_cache, scales = _fp8_caches(
            (num_pages, 16, 8, 128), torch.float8_e4m3fn, (0.05, 0.02), 5
        )
        ks = _fused(torch.bfloat16, kv_cache_dtype="fp8_e4m3", **flags)
    else:
        k_cache = torch.randn(num_pages, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        scales = None
        ks = _fused(torch.bfloat16, **flags)
    attn = ks._attn
    want_tiles = attn.decode_tiles(128, 4, batch, fp8=scales is not None)
    assert want_tiles != pa.DECODE_TILES[128] or (cache == "bf16" and batch < 128)
    out = ks.attention(q, k_cache, v_cache, meta, 128**-0.5, scales)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 128**-0.5, scales)
    _assert_close(out, expected, torch.bfloat16, f"{shape} {cache} {want_tiles}")


@pytest.mark.parametrize("split_tokens", [256, 512])
@pytest.mark.parametrize("batch", [64, 256])
def test_decode_split_tokens_over_ragged_contexts(split_tokens: int, batch: int) -> None:
    """Issue 44: ``fused.decode_split_tokens`` (contexts cut into pieces of a fixed length at
    batches of one split a sequence) over ragged contexts, 1 to 4,000 tokens, against the
    reference: pieces past a context's end exit unwritten and the merge leaves them out."""
    gen = torch.Generator().manual_seed(batch + split_tokens)
    contexts = torch.randint(1, 4001, (batch,), generator=gen).tolist()
    contexts[:3] = [1, split_tokens, split_tokens + 1]  # one piece exactly, one token over
    meta, num_pages = _meta([1] * batch, contexts, 16, seed=7)
    q = torch.randn(batch, 16, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(num_pages, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    ks = _fused(torch.bfloat16, options={"fused.decode_split_tokens": split_tokens})
    assert ks._attn.split_tokens == split_tokens and ks._attn.num_splits(batch, 8) == 1
    out = ks.attention(q, k_cache, v_cache, meta, 128**-0.5)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 128**-0.5)
    _assert_close(out, expected, torch.bfloat16, f"{batch} ragged decodes, {split_tokens}")
