"""`fused` kernels against `reference`, on inputs drawn by Hypothesis.

On a machine without CUDA the Triton kernels run on CPU tensors through
Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before Triton is
first imported, hence the first lines below. With CUDA the same tests run the
compiled kernels on the GPU (small shapes; tests/plugins/kernels/test_fused_gpu.py has the
full-size ones).

Every fused output is compared with the reference's under a relative bound per
dtype; NaN never passes; freshly allocated outputs are poisoned with NaN (torch
fills uninitialized memory when deterministic algorithms are on), so an
element the kernel forgets to write fails the test.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

import importlib  # noqa: E402
import logging  # noqa: E402

import attrs  # noqa: E402
import pytest  # noqa: E402
from helpers.poison import poisoned_outputs  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pitstop.config import EngineConfig  # noqa: E402
from pitstop.entrypoints.engine_args import engine_config  # noqa: E402
from pitstop.ground.attention import AttentionMetadata  # noqa: E402
from pitstop.plugin_system.plugin_manager import get_plugin_manager  # noqa: E402
from pitstop.plugin_system.protocols import RotaryCache  # noqa: E402
from pitstop.plugins.kernels import reference  # noqa: E402
from pitstop.plugins.kernels.fused import FusedKernels, FusedSettings  # noqa: E402
from pitstop.testing.kernels import paged_metadata  # noqa: E402

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"  # Triton's interpreter runs the kernels
DTYPES = [torch.float32, torch.bfloat16]
# relative error bound (max |fused - reference| / max |reference|) per dtype
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
FEW = settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def fused_set(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> FusedKernels:
    """The ``fused`` kernel set, built as the engine builds it (its settings read from ``config``)."""
    return get_plugin_manager().create("kernels", "fused", config, device, dtype)


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = ""
) -> None:
    """Finite, same shape, and relative max error under the dtype's bound."""
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert torch.isfinite(actual).all(), f"{what}: non-finite output (unwritten or NaN)"
    a, e = actual.float(), expected.float()
    scale = e.abs().max().clamp_min(1e-6)
    err = ((a - e).abs().max() / scale).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]}"


def fused(dtype: torch.dtype, **flags) -> FusedKernels:
    """A fused kernel set on the test device."""
    return fused_set(engine_config(max_model_len=512, **flags), DEVICE, dtype)


def test_all_ops_run_triton_here() -> None:
    """With the interpreter (or CUDA) every op is a Triton kernel; linear stays a torch GEMM."""
    desc = fused(torch.float32).describe()
    # fused.layer (off by default), and cuDNN's long prefills (CUDA only)
    layer_ops = {"norm_linear", "norm_gate_up", "linear_residual", "long_prefill"}
    assert set(desc) - layer_ops == {
        "rms_norm",
        "linear",
        "silu_and_mul",
        "rope_and_store",
        "attention",
        "moe",
    }
    for op in ("rms_norm", "silu_and_mul", "rope_and_store", "attention"):
        assert desc[op] == "triton", desc
    assert desc["moe"] == "triton", desc


def test_fallbacks_are_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    """A flag that is off, or a CPU without the interpreter, gives one log line per op that names it."""
    with caplog.at_level(logging.INFO, logger="pitstop.plugins.kernels.fused"):
        ks = fused_set(
            engine_config(fused_silu=False, fused_qkv=False), torch.device("cpu"), torch.float32
        )
    assert ks.describe()["silu_and_mul"] == "reference (config flag fused_silu is off)"
    assert ks.merge_projections is False
    lines = [r.getMessage() for r in caplog.records if "silu_and_mul" in r.getMessage()]
    assert len(lines) == 1 and "fused_silu" in lines[0]

    old = os.environ.pop("TRITON_INTERPRET", None)
    try:
        ks = fused_set(EngineConfig(), torch.device("cpu"), torch.float32)
    finally:
        if old is not None:
            os.environ["TRITON_INTERPRET"] = old
    for op in ("rms_norm", "silu_and_mul", "rope_and_store", "attention"):
        assert ks.describe()[op] == "reference (no CUDA device and TRITON_INTERPRET not set)"
    x = torch.randn(3, 8)
    torch.testing.assert_close(
        ks.silu_and_mul(x), reference.ReferenceKernels("cpu", torch.float32).silu_and_mul(x)
    )


def test_unsupported_head_size_falls_back() -> None:
    """A head size with no kernel switches rotary and attention to the reference at the first call."""
    ks = fused(torch.float32)
    q = torch.randn(2, 2, 24, device=DEVICE)
    k_cache = torch.zeros(4, 16, 1, 24, device=DEVICE)
    meta = make_meta([2], [2], 16, 4, seed=0)
    out = ks.attention(q, k_cache, k_cache.clone(), meta, 0.2)
    assert out.shape == q.shape
    assert ks.describe()["attention"].startswith("reference (unsupported head size 24")


def test_plugin_registers_fused() -> None:
    """The module registers the `fused` kernel set through the hook."""
    mod = importlib.import_module("pitstop.plugins.kernels.fused")
    names: list[str] = []
    mod.register_kernels(lambda name, factory, *a, **kw: names.append(name))
    assert names == ["fused"]


# ---------------------------------------------------------------- rms_norm, silu


@FEW
@given(
    tokens=st.integers(1, 9),
    width=st.sampled_from([64, 96, 128, 320]),
    dtype=st.sampled_from(DTYPES),
    with_residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_matches_reference(
    tokens: int, width: int, dtype: torch.dtype, with_residual: bool, seed: int
) -> None:
    """Residual add + RMSNorm: both outputs match, inputs are left alone."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=gen).to(DEVICE, dtype)
    residual = (
        torch.randn(tokens, width, generator=gen).to(DEVICE, dtype) if with_residual else None
    )
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(DEVICE, dtype)
    x0 = x.clone()
    with poisoned_outputs():
        out, res = fused(dtype).rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_res = reference.rms_norm(x, weight, 1e-6, residual)
    assert_close(out, ref_out, dtype, "normed")
    if with_residual:
        assert res is not None and ref_res is not None
        assert_close(res, ref_res, dtype, "residual")
    else:
        assert res is None
    assert torch.equal(x, x0)


@FEW
@given(
    tokens=st.integers(1, 6),
    heads=st.integers(1, 5),
    head_size=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_per_head_on_strided_view(
    tokens: int, heads: int, head_size: int, dtype: torch.dtype, seed: int
) -> None:
    """Qwen3's q/k norm: ``[T, H, D]`` rows of a wider merged QKV output, normalized per head."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 3) * head_size, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : heads * head_size].reshape(tokens, heads, head_size)
    weight = (1 + 0.1 * torch.randn(head_size, generator=gen)).to(DEVICE, dtype)
    with poisoned_outputs():
        out, res = fused(dtype).rms_norm(q, weight, 1e-6)
    assert res is None
    assert_close(out, reference.rms_norm(q, weight, 1e-6)[0], dtype, "per-head norm")


@FEW
@given(
    tokens=st.integers(1, 9),
    d=st.sampled_from([8, 48, 96, 256, 3000]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_silu_and_mul_matches_reference(tokens: int, d: int, dtype: torch.dtype, seed: int) -> None:
    """SiLU-and-mul of a merged [gate | up] tensor."""
    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(tokens, 2 * d, generator=gen)).to(DEVICE, dtype)
    with poisoned_outputs():
        out = fused(dtype).silu_and_mul(x)
    assert_close(
        out, reference.ReferenceKernels(DEVICE, dtype).silu_and_mul(x), dtype, "silu_and_mul"
    )


# ---------------------------------------------------------------- paged batches


def make_meta(
    query_lens: list[int], context_lens: list[int], page_size: int, num_pages: int, seed: int
) -> AttentionMetadata:
    """Metadata of a batch (prefills first, then decodes) over randomly scattered pages."""
    return paged_metadata(query_lens, context_lens, page_size, num_pages, seed, DEVICE)


@st.composite
def batches(
    draw: st.DrawFn,
    max_seqs: int = 4,
    max_context: int = 80,
    page_sizes: tuple[int, ...] = (1, 8, 16, 64),
) -> tuple[list[int], list[int], int]:
    """(query lengths, context lengths, page size): decodes, whole prompts and chunks over a prefix.

    Contexts cluster around page and tile borders (the interpreter's key tiles are 16 wide): a
    tile spans 16 pages of 1 token, two of 8, one of 16, or a quarter of one of 64.
    """
    page_size = draw(st.sampled_from(page_sizes))
    n = draw(st.integers(1, max_seqs))
    qlens, ctxs = [], []
    for _ in range(n):
        borders = [page_size - 1, page_size, page_size + 1, 2 * page_size, 16, 17, 33]
        near_border = st.sampled_from([b for b in borders if b >= 1])
        ctx = draw(st.one_of(st.integers(1, max_context), near_border))
        kind = draw(st.sampled_from(["decode", "prompt", "chunk"]))
        q = 1 if kind == "decode" else ctx if kind == "prompt" else draw(st.integers(1, ctx))
        qlens.append(q)
        ctxs.append(ctx)
    return qlens, ctxs, page_size


def heads_strategy(ratios: tuple[int, ...] = (1, 2, 4)) -> st.SearchStrategy[tuple[int, int]]:
    """(query heads, KV heads) with the given GQA ratios."""
    return st.tuples(st.integers(1, 2), st.sampled_from(ratios)).map(lambda t: (t[0] * t[1], t[0]))


@FEW
@given(
    # as its fp8 twin below: one program per token, so longer contexts add interpreted
    # programs, not cases (the contexts at page borders, up to 128, are still drawn)
    batch=batches(max_seqs=3, max_context=40),
    heads=heads_strategy(),
    head_size=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rope_and_store_matches_reference(
    batch: tuple[list[int], list[int], int],
    heads: tuple[int, int],
    head_size: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    """Rotated q and k match; the cache slots written equal the reference's and no other slot changes."""
    qlens, ctxs, page_size = batch
    hq, hkv = heads
    num_pages = sum(-(-c // page_size) for c in ctxs) + 3
    meta = make_meta(qlens, ctxs, page_size, num_pages, seed)
    t = sum(qlens)
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * head_size, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * head_size, hkv * head_size, hkv * head_size], dim=-1)
    q, k, v = (x.reshape(t, -1, head_size) for x in (q, k, v))
    angles = torch.outer(torch.arange(256).float(), torch.rand(head_size // 2, generator=gen))
    rotary = RotaryCache(angles.cos().to(DEVICE), angles.sin().to(DEVICE))
    cache_shape = (num_pages, page_size, hkv, head_size)
    k_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k0, v0 = k_cache.clone(), v_cache.clone()
    with poisoned_outputs():
        q_out, k_out = fused(dtype).rope_and_store(q, k, v, rotary, k_cache, v_cache, meta)
    q_exp, k_exp = reference.ReferenceKernels(DEVICE, dtype).rope_and_store(
        q, k, v, rotary, k_ref, v_ref, meta
    )
    assert_close(q_out, q_exp, dtype, "q")
    assert_close(k_out, k_exp, dtype, "k")
    if INTERPRETED:  # the reference's rounding step by step: its bits (a GPU may fuse FMAs)
        assert torch.equal(q_out, q_exp) and torch.equal(k_out, k_exp)
    written = torch.zeros(num_pages * page_size, dtype=torch.bool, device=DEVICE)
    written[meta.slot_mapping] = True
    flat = (num_pages * page_size, hkv, head_size)
    for got, exp, before, name in ((k_cache, k_ref, k0, "k"), (v_cache, v_ref, v0, "v")):
        got, exp, before = got.view(flat), exp.view(flat), before.view(flat)
        assert torch.equal(got[~written], before[~written]), (
            f"{name} cache: a slot outside slot_mapping changed"
        )
        assert_close(got[written], exp[written], dtype, f"{name} cache slots")
    assert torch.equal(v_cache.view(flat)[written], v_ref.view(flat)[written])  # v is a plain copy


def run_attention(
    ks: FusedKernels | reference.ReferenceKernels | object,
    batch: tuple[list[int], list[int], int],
    hq: int,
    hkv: int,
    head_size: int,
    dtype: torch.dtype,
    seed: int,
    cache_dtype: torch.dtype | None = None,
    kv_scale: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Fused attention of a random batch against the reference's.

    ``cache_dtype`` fp8: the caches hold random K/V (K of about the size ``kv_scale[0]``
    times a few, V likewise) quantized with ``kv_scale`` by the reference.
    """
    qlens, ctxs, page_size = batch
    num_pages = sum(-(-c // page_size) for c in ctxs) + 2
    meta = make_meta(qlens, ctxs, page_size, num_pages, seed)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(qlens), hq, head_size, generator=gen).to(DEVICE, dtype)
    shape = (num_pages, page_size, hkv, head_size)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    extra = {}
    if cache_dtype is not None:
        scales = torch.tensor(kv_scale, dtype=torch.float32, device=DEVICE)
        # values well inside the format's range (a few scales wide), quantized by the reference
        k_cache = reference.quantize_kv(k_cache * 3 * kv_scale[0], scales[0], cache_dtype)
        v_cache = reference.quantize_kv(v_cache * kv_scale[1], scales[1], cache_dtype)
        extra = {"kv_scale": scales}
    scale = head_size**-0.5
    with poisoned_outputs():
        out = ks.attention(q, k_cache, v_cache, meta, scale, **extra)  # type: ignore[attr-defined]
    expected = reference.paged_attention(q, k_cache, v_cache, meta, scale, **extra)
    assert_close(
        out, expected, dtype, f"attention q={meta.query_lens_list} ctx={meta.context_lens_list}"
    )


@settings(FEW, max_examples=40)
@given(
    batch=batches(),
    heads=heads_strategy((1, 3, 4, 8)),
    head_size=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_attention_matches_reference(
    batch: tuple[list[int], list[int], int],
    heads: tuple[int, int],
    head_size: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    """Mixed prefill / chunk / decode batches over scattered pages (GQA 1, 3, 4, 8; pages 1..64)."""
    run_attention(fused(dtype), batch, heads[0], heads[1], head_size, dtype, seed)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
KV_SCALES = st.tuples(st.sampled_from([1.0, 0.02, 4.0]), st.sampled_from([1.0, 0.01, 2.0]))


@settings(FEW, max_examples=25)
@given(
    batch=batches(),
    heads=heads_strategy((1, 3, 4, 8)),
    head_size=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    cache_dtype=st.sampled_from(FP8),
    kv_scale=KV_SCALES,
    seed=st.integers(0, 2**16),
)
def test_attention_fp8_cache_matches_reference(
    batch: tuple[list[int], list[int], int],
    heads: tuple[int, int],
    head_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    kv_scale: tuple[float, float],
    seed: int,
) -> None:
    """An fp8 cache read by the fused kernels (scales folded in) gives the reference's
    dequantize-then-attend output, within the activation dtype's bound."""
    hq, hkv = heads
    run_attention(fused(dtype), batch, hq, hkv, head_size, dtype, seed, cache_dtype, kv_scale)


@FEW
@given(
    batch=batches(max_seqs=3, max_context=40),
    heads=heads_strategy(),
    head_size=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    cache_dtype=st.sampled_from(FP8),
    kv_scale=KV_SCALES,
    spread=st.sampled_from([1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_rope_and_store_fp8_cache_is_the_reference_quantization(
    batch: tuple[list[int], list[int], int],
    heads: tuple[int, int],
    head_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    kv_scale: tuple[float, float],
    spread: float,
    seed: int,
) -> None:
    """The fp8 values the fused store writes are, bit for bit, the reference's quantization
    (divide by the scale, saturate, round to nearest even) of the same rotated k and of v,
    outliers (``spread`` 1e3: far past the format's range) included; other slots keep their bytes."""
    qlens, ctxs, page_size = batch
    hq, hkv = heads
    num_pages = sum(-(-c // page_size) for c in ctxs) + 3
    meta = make_meta(qlens, ctxs, page_size, num_pages, seed)
    t = sum(qlens)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        (torch.randn(t, h, head_size, generator=gen) * spread).to(DEVICE, dtype)
        for h in (hq, hkv, hkv)
    )
    angles = torch.outer(torch.arange(256).float(), torch.rand(head_size // 2, generator=gen))
    rotary = RotaryCache(angles.cos().to(DEVICE), angles.sin().to(DEVICE))
    shape = (num_pages, page_size, hkv, head_size)
    scales = torch.tensor(kv_scale, dtype=torch.float32, device=DEVICE)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE).to(cache_dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    _, k_out = fused(dtype).rope_and_store(q, k, v, rotary, k_cache, v_cache, meta, scales)
    flat = (num_pages * page_size, hkv, head_size)
    written = torch.zeros(num_pages * page_size, dtype=torch.bool, device=DEVICE)
    written[meta.slot_mapping] = True
    limit = torch.finfo(cache_dtype).max
    for got, before, x, sc, name in (
        (k_cache, k0, k_out, scales[0], "k"),
        (v_cache, v0, v, scales[1], "v"),
    ):
        got, before = got.view(flat), before.view(flat)
        # index through uint8 views: torch has no index kernels for float8 on every device
        got_bytes, before_bytes = got.view(torch.uint8), before.view(torch.uint8)
        assert torch.equal(got_bytes[~written], before_bytes[~written]), (
            f"{name} cache: a slot outside slot_mapping changed"
        )
        stored = reference.gather_pages(got, meta.slot_mapping).float()
        assert torch.isfinite(stored).all() and stored.abs().max() <= limit, (
            f"{name}: not saturated"
        )
        expected = reference.quantize_kv(x, sc, cache_dtype).float()
        mismatch = (stored != expected).sum().item()
        assert mismatch == 0, f"{name} cache: {mismatch} of {stored.numel()} values differ"


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("kernels", ["reference", "fused"])
def test_fp8_outliers_saturate_to_finite_outputs(kernels: str, cache_dtype: torch.dtype) -> None:
    """K and V of 1e30 (far outside fp8: e4m3 ends at 448, e5m2 at 57344) are stored as the
    largest finite value, and attention over them (prefill and decode) stays finite."""
    qlens, ctxs, page_size = [12, 1, 1], [12, 30, 17], 8
    num_pages = sum(-(-c // page_size) for c in ctxs) + 2
    meta = make_meta(qlens, ctxs, page_size, num_pages, seed=3)
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d = 4, 2, 64
    ks = (
        fused(torch.float32)
        if kernels == "fused"
        else reference.ReferenceKernels(DEVICE, torch.float32)
    )
    shape = (num_pages, page_size, hkv, d)
    scales = torch.ones(2, dtype=torch.float32, device=DEVICE)
    k_cache = reference.quantize_kv(
        torch.randn(shape, generator=gen).to(DEVICE), scales[0], cache_dtype
    )
    v_cache = reference.quantize_kv(
        torch.randn(shape, generator=gen).to(DEVICE), scales[1], cache_dtype
    )
    t = sum(qlens)
    q = torch.randn(t, hq, d, generator=gen).to(DEVICE)
    k = torch.randn(t, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(t, hkv, d, generator=gen).to(DEVICE)
    k[::3] *= 1e30
    v[1::2] *= -1e30
    angles = torch.outer(torch.arange(64).float(), torch.rand(d // 2, generator=gen))
    rotary = RotaryCache(angles.cos().to(DEVICE), angles.sin().to(DEVICE))
    q, _ = ks.rope_and_store(q, k, v, rotary, k_cache, v_cache, meta, kv_scale=scales)
    limit = torch.finfo(cache_dtype).max
    for cache in (k_cache, v_cache):
        stored = reference.gather_pages(cache.view(-1, hkv, d), meta.slot_mapping).float()
        assert torch.isfinite(stored).all()
        assert stored.abs().max() == limit  # the outliers, saturated
    out = ks.attention(q, k_cache, v_cache, meta, d**-0.5, kv_scale=scales)
    assert torch.isfinite(out).all()
    assert out.abs().max() > 1.0  # the saturated V rows carry weight: the output is not all zeros


# ---------------------------------------------------------------- fp8 pages widened to fp16 (issue 29)

# Against a float64 truth over the same fp8 bytes, a bf16 output is off by at most one bf16 ulp
# of its largest element, 2^-7 (a GPU rounds to nearest: half of it; Triton's interpreter
# truncates float32 to bf16), plus the fp16 rounding of the probabilities before P·V (2^-11 of
# each term: ~2^-9 of the largest output for these random V, averages of a few rows): 1e-2.
# The queries and K/V are exact fp16 operands, the products and sums float32.
WIDEN_TOL = 1e-2
# decode contexts on either side of the interpreter's 16-key tiles and of split borders,
# a chunk over a cached prefix, a fresh prompt
WIDEN_BATCH = ([20, 9, 1, 1, 1, 1, 1, 1], [53, 9, 1, 15, 16, 17, 47, 100])


def _fp8_widen_case(
    group: int,
    cache_dtype: torch.dtype,
    kv_scale: tuple[float, float],
    q_scale: torch.Tensor | float = 1.0,
    page_size: int = 8,
    seed: int = 0,
) -> tuple[tuple, torch.Tensor]:
    """(attention arguments, float64 truth) of WIDEN_BATCH over an fp8 cache, 2 KV heads of 64.

    ``q_scale`` multiplies the bf16 queries (per head if a tensor) and divides the softmax
    scale, so that the scores stay those of unit queries however far from fp16's range they are.
    """
    qlens, ctxs = WIDEN_BATCH
    hkv, d = 2, 64
    num_pages = sum(-(-c // page_size) for c in ctxs) + 2
    meta = make_meta(qlens, ctxs, page_size, num_pages, seed)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(qlens), hkv * group, d, generator=gen)
    q = (q * torch.as_tensor(q_scale).reshape(-1, 1)).to(DEVICE, torch.bfloat16)
    shape = (num_pages, page_size, hkv, d)
    scales = torch.tensor(kv_scale, dtype=torch.float32, device=DEVICE)
    k = torch.randn(shape, generator=gen).to(DEVICE) * 3 * kv_scale[0]
    v = torch.randn(shape, generator=gen).to(DEVICE) * kv_scale[1]
    k_cache = reference.quantize_kv(k, scales[0], cache_dtype)
    v_cache = reference.quantize_kv(v, scales[1], cache_dtype)
    scale = d**-0.5 / float(torch.as_tensor(q_scale).max())
    truth = reference.paged_attention(q.double(), k_cache, v_cache, meta, scale, scales)
    return (q, k_cache, v_cache, meta, scale, scales), truth


def _widened(fp8_widen: str, args: tuple, num_sms: int = 4) -> torch.Tensor:
    from pitstop.plugins.kernels.triton_ops.paged_attention import PagedAttention

    attn = PagedAttention(DEVICE, args[0].dtype, 512, fp8_widen=fp8_widen, num_sms=num_sms)
    with poisoned_outputs():
        out = attn(*args)
    assert torch.isfinite(out).all(), f"fp8_widen={fp8_widen}: non-finite output"
    return out


def _rel_err(out: torch.Tensor, truth: torch.Tensor) -> float:
    return ((out.double() - truth).abs().max() / truth.abs().max()).item()


@pytest.mark.parametrize("num_sms", [4, 64])
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_fp8_widened_to_fp16_matches_float64_truth(
    group: int, cache_dtype: torch.dtype, num_sms: int
) -> None:
    """bf16 queries over fp8 pages with non-unit scales, fp16 operands: prefill, chunk and decodes
    (1 split and several, contexts across tile and split borders) within WIDEN_TOL of a float64
    truth, and no less accurate than widening to bf16 (``fp8_widen="query"``) but by half an ulp."""
    args, truth = _fp8_widen_case(group, cache_dtype, (0.05, 0.02), seed=group)
    err = _rel_err(_widened("fp16", args, num_sms), truth)
    err_query = _rel_err(_widened("query", args, num_sms), truth)
    assert err <= WIDEN_TOL, f"fp16 widening: relative error {err:.3g}"
    assert err <= err_query + 2**-9, f"fp16 {err:.3g} vs query {err_query:.3g}"


@pytest.mark.parametrize(
    "q_scale",
    [3e5, 1e-6, torch.tensor([1e4, 1.0, 1e-2, 1.0, 1.0, 3.0, 1.0, 1e-2])],
    ids=["past-fp16-max", "fp16-subnormal", "heads-apart"],
)
def test_fp8_widened_to_fp16_any_query_range(q_scale: torch.Tensor | float) -> None:
    """Queries whose bf16 values overflow fp16 (3e5 > 65504), would be fp16 subnormals (1e-6), or
    differ per head by 1e6 in one tile: the power-of-two pre-scaling keeps them exact."""
    args, truth = _fp8_widen_case(4, torch.float8_e4m3fn, (4.0, 2.0), q_scale, page_size=16)
    err = _rel_err(_widened("fp16", args), truth)
    assert err <= WIDEN_TOL, f"relative error {err:.3g}"


@pytest.mark.parametrize("num_sms", [4, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_qk_fp8_is_attention_over_the_e4m3_rounded_query(group: int, num_sms: int) -> None:
    """``fp8_widen="qk-fp8"`` over an e4m3 cache: the query rounded to e4m3 per row
    (reference.round_query_e4m3) is the one loss; over that query the prefill, chunk and decodes
    (1 split and several) are within WIDEN_TOL of a float64 truth, as the fp16 mode is over
    the exact query."""
    args, _ = _fp8_widen_case(group, torch.float8_e4m3fn, (0.05, 0.02), seed=group)
    q, k_cache, v_cache, meta, scale, scales = args
    rounded = reference.round_query_e4m3(q).double()
    truth = reference.paged_attention(rounded, k_cache, v_cache, meta, scale, scales)
    err = _rel_err(_widened("qk-fp8", args, num_sms), truth)
    assert err <= WIDEN_TOL, f"qk-fp8: relative error {err:.3g} over the rounded query"


@pytest.mark.parametrize(
    "q_scale",
    [3e5, 1e-6, torch.tensor([1e4, 1.0, 1e-2, 1.0, 1.0, 3.0, 1.0, 1e-2])],
    ids=["past-fp16-max", "fp16-subnormal", "heads-apart"],
)
def test_qk_fp8_any_query_range(q_scale: torch.Tensor | float) -> None:
    """Each row's own power of two: queries far outside e4m3's range (448), or heads 1e6 apart
    in one program, lose nothing beyond their rows' rounding to 3 mantissa bits."""
    args, _ = _fp8_widen_case(4, torch.float8_e4m3fn, (4.0, 2.0), q_scale, page_size=16)
    q, k_cache, v_cache, meta, scale, scales = args
    rounded = reference.round_query_e4m3(q).double()
    truth = reference.paged_attention(rounded, k_cache, v_cache, meta, scale, scales)
    err = _rel_err(_widened("qk-fp8", args), truth)
    assert err <= WIDEN_TOL, f"relative error {err:.3g}"


def test_qk_fp8_takes_e4m3_caches_and_bf16_queries_only() -> None:
    """An e5m2 cache under ``qk-fp8`` widens to fp16 instead (the same bits as ``fp16``); float32
    queries and bf16 caches are left alone."""
    from pitstop.plugins.kernels.triton_ops.paged_attention import PagedAttention

    args, _ = _fp8_widen_case(4, torch.float8_e5m2, (0.05, 0.02))
    assert torch.equal(_widened("qk-fp8", args, 64), _widened("fp16", args, 64))
    q, k_cache, _, _, _, scales = args
    attn = PagedAttention(DEVICE, torch.bfloat16, 512, fp8_widen="qk-fp8")
    assert not attn.query_fp8(q, scales, k_cache) and attn.widen_f16(q, scales, k_cache)
    e4m3 = k_cache.view(torch.uint8).view(torch.float8_e4m3fn)
    assert attn.query_fp8(q, scales, e4m3) and not attn.widen_f16(q, scales, e4m3)
    assert not attn.query_fp8(q.float(), scales, e4m3) and not attn.query_fp8(q, None, e4m3)


def test_round_query_e4m3_keeps_each_row_in_range() -> None:
    """Each row's largest magnitude lands in [2^7, 2^8) before the rounding: no row saturates,
    zero rows stay zero, and a value e4m3 holds exactly (after the row's scaling) is unchanged."""
    q = torch.tensor([[3e5, -1.0, 0.5], [1e-6, 2e-6, -3e-6], [0.0, 0.0, 0.0], [1.0, 0.5, 0.25]])
    r = reference.round_query_e4m3(q)
    assert torch.isfinite(r).all() and torch.equal(r[2], q[2]) and torch.equal(r[3], q[3])
    # half an e4m3 ulp of each element, or half the subnormal spacing below the row's scale
    # (2^-10 of 2^e <= row max / 2^7): an element 2^-17 below its row's largest may go to zero
    row_max = q.abs().amax(dim=-1, keepdim=True)
    assert ((r - q).abs() <= q.abs() * 2**-4 + row_max * 2**-17).all()
    assert r[0, 1] == 0 and abs(r[0, 0] - 3e5) <= 3e5 * 2**-4 and r[1].ne(0).all()


def test_fp8_widen_leaves_bf16_caches_and_float32_queries_alone() -> None:
    """A bf16 cache, or float32 queries over fp8 pages, give the same bits whatever fp8_widen says
    (the fp16 operands are for bf16 queries over fp8 pages only); a bad value is refused."""
    from pitstop.plugins.kernels.triton_ops.paged_attention import PagedAttention

    args, _ = _fp8_widen_case(4, torch.float8_e4m3fn, (0.05, 0.02))
    q, k_cache, v_cache, meta, scale, scales = args
    bf16_caches = (
        q,
        *(reference.dequantize_kv(c, s, q.dtype) for c, s in zip(args[1:3], scales, strict=True)),
    )
    for case in (
        (*bf16_caches, meta, scale),
        (q.float(), k_cache, v_cache, meta, scale, scales),
    ):
        outs = [_widened(w, case, num_sms=64) for w in ("fp16", "query", "qk-fp8")]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    attn = PagedAttention(DEVICE, torch.bfloat16, 512)
    assert attn.fp8_widen == "fp16" and attn.widen_f16(q, scales)
    assert not attn.widen_f16(q, None) and not attn.widen_f16(q.float(), scales)
    with pytest.raises(ValueError, match="fp8_widen"):
        PagedAttention(DEVICE, torch.bfloat16, 512, fp8_widen="bf16")


def test_fp8_cache_on_an_old_gpu_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before compute capability 8.9 Triton has no fp8 conversions: the cache ops fall back, saying why."""
    from pitstop.plugins.kernels import fused as fused_module

    assert fused_module.fp8_unsupported_reason("auto", torch.device("cuda")) is None
    assert fused_module.fp8_unsupported_reason("fp8_e4m3", torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    reason = fused_module.fp8_unsupported_reason("fp8_e4m3", torch.device("cuda"))
    assert reason is not None and "8.9" in reason and "8.0" in reason


def test_rescale_when_the_maximum_jumps() -> None:
    """Scores that grow along the context (keys scaled up page by page) force rescales mid-row."""
    qlens, ctxs, page_size = [60, 1], [90, 77], 8
    num_pages = sum(-(-c // page_size) for c in ctxs) + 2
    meta = make_meta(qlens, ctxs, page_size, num_pages, seed=5)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(qlens), 4, 64, generator=gen).to(DEVICE)
    ramp = torch.linspace(0.5, 12.0, num_pages)[torch.randperm(num_pages, generator=gen)]
    k_cache = torch.randn(num_pages, page_size, 2, 64, generator=gen) * ramp[:, None, None, None]
    v_cache = torch.randn(num_pages, page_size, 2, 64, generator=gen)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    with poisoned_outputs():
        out = fused(torch.float32).attention(q, k_cache, v_cache, meta, 0.125)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert_close(out, expected, torch.float32, "rescaled")


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_chunk_over_cached_prefix(page_size: int, group: int) -> None:
    """One launch: a chunk over a prefix that ends mid-page, a fresh prompt, a 3-token draft, decodes.

    The chunk's rows span several query tiles and its keys several pages and key tiles; the
    decode contexts sit on either side of page and tile borders.
    """
    batch = ([37, 50, 3, 1, 1, 1], [100, 50, 65, 64, 65, 17], page_size)
    run_attention(fused(torch.bfloat16), batch, 2 * group, 2, 64, torch.bfloat16, seed=group)


def test_tiles_keyed_by_head_size_and_group() -> None:
    """Every (head size, GQA ratio) gets tiles that hold at least one query token per row tile."""
    from pitstop.plugins.kernels.triton_ops import paged_attention as pa

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head in (16, 32, 64, 128, 256):
            for group in (1, 2, 3, 4, 7, 8, 16, 32):
                t = pa.prefill_tiles(head, group, dtype)
                assert t.block_m >= group and t.block_m & (t.block_m - 1) == 0, (head, group, t)
                assert t.block_n & (t.block_n - 1) == 0 and t.num_stages >= 1
                dt = pa.decode_tiles(head, group, dtype)
                assert dt.block_n >= 16 and dt.block_n & (dt.block_n - 1) == 0
    attn = pa.PagedAttention(torch.device("cpu"), torch.bfloat16, 512)
    # a short query (a draft, a small chunk) takes a row tile that it fills
    assert attn.prefill_tiles(64, 4, max_query_len=3).block_m == 16
    assert attn.prefill_tiles(64, 4, max_query_len=500).block_m == pa.INTERPRETER_PREFILL.block_m


def test_by_batch_decode_tiles_follow_the_sweep_and_fixed_stays() -> None:
    """``decode_tile_rule="by-batch"`` picks the sweep's tiles by batch and cache dtype on a GPU;
    ``"fixed"`` (the default) keeps one tile per head size; a bad rule is refused."""
    from pitstop.plugins.kernels.triton_ops import paged_attention as pa

    fixed = pa.PagedAttention(torch.device("cpu"), torch.bfloat16, 512)
    rule = pa.PagedAttention(torch.device("cpu"), torch.bfloat16, 512, decode_tile_rule="by-batch")
    assert rule.decode_tiles(128, 4, 256) == pa.INTERPRETER_DECODE  # the interpreter's tiles
    fixed.on_gpu = rule.on_gpu = True  # the rule itself, without a GPU
    base = pa.DECODE_TILES[128]
    assert {fixed.decode_tiles(128, 4, n, fp8) for n in (1, 256) for fp8 in (0, 1)} == {base}
    assert rule.decode_tiles(128, 4, 256) == rule.decode_tiles(128, 2, 128, fp8=True)
    assert rule.decode_tiles(128, 4, 256) == pa.WIDE_BATCH_TILES
    assert rule.decode_tiles(128, 4, 64, fp8=True) == pa.FP8_DECODE_TILES
    assert rule.decode_tiles(128, 4, 64) == base  # bf16 below 128 decodes: unchanged
    assert rule.decode_tiles(128, 16, 256) == pa.decode_tiles(128, 16, torch.bfloat16)  # unswept
    with pytest.raises(ValueError, match="decode_tile_rule"):
        pa.PagedAttention(torch.device("cpu"), torch.bfloat16, 512, decode_tile_rule="fast")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_sms", [1, 64])
def test_decode_split_counts(dtype: torch.dtype, num_sms: int) -> None:
    """Decode with one split and with many (including splits left empty by a short context)."""
    ks = fused(dtype)
    ks._attn.num_sms = num_sms  # type: ignore[union-attr]
    batch = ([1, 1, 1], [1, 47, 100], 16)
    assert (ks._attn.num_splits(3, 2) > 1) == (num_sms > 1)  # type: ignore[union-attr]
    run_attention(ks, batch, 4, 2, 64, dtype, seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_tokens", [1, 16, 40])
def test_decode_split_tokens_cuts_contexts_in_pieces(
    dtype: torch.dtype, split_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fused.decode_split_tokens``: a decode batch large enough for one split a sequence
    cuts each context into pieces of that many tokens (rounded up to the tile: 16 in the
    interpreter), the grid spanning ``max_model_len``; the pieces past a short context exit
    without writing and the merge reads only those the context reaches. Ragged contexts
    (one token to several pieces, a prefill beside them) against the reference."""
    from pitstop.plugins.kernels.triton_ops import paged_decode

    grids: list[tuple[int, ...]] = []
    kernel = paged_decode._decode_kernel

    class Spy:  # the decode launches' grids
        def __getitem__(self, grid: tuple[int, ...]) -> object:
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(paged_decode, "_decode_kernel", Spy())
    ks = fused(dtype, options={"fused.decode_split_tokens": split_tokens})
    attn = ks._attn  # type: ignore[union-attr]
    assert attn.split_tokens == split_tokens and attn.num_splits(5, 2) == 1
    batch = ([7, 1, 1, 1, 1, 1], [7, 1, 15, 16, 17, 100], 16)
    run_attention(ks, batch, 4, 2, 64, dtype, seed=3)
    run_attention(ks, ([1] * 4, [33, 2, 64, 5], 8), 4, 4, 64, dtype, seed=4)
    pieces = -(-512 // (-(-split_tokens // 16) * 16))  # max_model_len over the rounded length
    assert grids == [(5, 2, pieces), (4, 4, pieces)]


def test_decode_split_tokens_refuses_what_it_cannot_join() -> None:
    """``fused.decode_split_tokens`` below zero, beside the one-launch merge or the shared
    pass, and the shared pass beside the one-launch merge or qk-fp8 over an e4m3 cache:
    refused, naming the setting (not left unused without a word)."""
    from pitstop.errors import ConfigError

    for options, match in [
        ({"fused.decode_split_tokens": -1}, ">= 0"),
        ({"fused.decode_split_tokens": 64, "fused.decode_merge": "last-program"}, "last-program"),
        ({"fused.decode_split_tokens": 64, "fused.decode_prefix_share": 256}, "prefix_share"),
        ({"fused.decode_prefix_share": 256, "fused.decode_merge": "last-program"}, "last-program"),
    ]:
        with pytest.raises(ConfigError, match=match):
            fused(torch.float32, options=options)
    qk_fp8 = {"fused.decode_prefix_share": 256, "fused.fp8_widen": "qk-fp8"}
    with pytest.raises(ConfigError, match="qk-fp8"):
        fused(torch.bfloat16, kv_cache_dtype="fp8_e4m3", options=qk_fp8)
    fused(torch.bfloat16, options=qk_fp8)  # a bf16 cache: qk-fp8 does not apply, no conflict


def test_padding_rows_are_harmless() -> None:
    """A decode row with context 0 and slot -1 (CUDA-graph padding) writes no slot and outputs zeros."""
    ks = fused(torch.float32)
    meta = make_meta([1, 1], [5, 1], 16, 4, seed=0)
    meta = AttentionMetadata(
        positions=meta.positions,
        slot_mapping=torch.tensor([meta.slot_mapping[0].item(), -1], device=DEVICE),
        block_tables=meta.block_tables.clone().index_fill_(0, torch.tensor([1], device=DEVICE), -1),
        context_lens=torch.tensor([5, 0], dtype=torch.int32, device=DEVICE),
        cu_query_lens=meta.cu_query_lens,
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=2,
        max_query_len=1,
        max_context_len=5,
        page_size=16,
        context_lens_list=[5, 0],
        query_lens_list=[1, 1],
    )
    q = torch.randn(2, 2, 64, device=DEVICE)
    k = torch.randn(2, 1, 64, device=DEVICE)
    cache = torch.randn(4, 16, 1, 64, device=DEVICE)
    before = cache.clone()
    angles = torch.outer(torch.arange(16).float(), torch.rand(32))
    rotary = RotaryCache(angles.cos().to(DEVICE), angles.sin().to(DEVICE))
    v_cache = cache.clone()
    q, _ = ks.rope_and_store(q, k, k, rotary, cache, v_cache, meta)
    changed = (cache != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [meta.slot_mapping[0].item() // 16]
    out = ks.attention(q, cache, v_cache, meta, 0.125)
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))


# ---------------------------------------------------------------- Qwen3's q/k norm in rope_and_store (issue 29)


def _qk_norm_case(
    batch: tuple[list[int], list[int], int],
    hq: int,
    hkv: int,
    head_size: int,
    dtype: torch.dtype,
    seed: int,
    pad: int = 0,
    exact: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> dict:
    """Inputs of ``rope_and_store`` with Qwen3's q/k norm: q, k, v strided views of one merged
    QKV output, norm weights near 1, ``pad`` padding rows (slot -1) after the batch's tokens.

    ``exact``: every q and k value a multiple of 1/8 below 2 in magnitude, so that a head's
    float32 sum of squares is exact in any order (the one thing the fused kernel computes in
    another order than torch).
    """
    qlens, ctxs, page_size = batch
    num_pages = sum(-(-c // page_size) for c in ctxs) + 3
    meta = make_meta(qlens, ctxs, page_size, num_pages, seed)
    gen = torch.Generator().manual_seed(seed)
    if pad:
        positions = torch.randint(0, 256, (pad,), generator=gen).to(DEVICE)
        meta = attrs.evolve(
            meta,
            positions=torch.cat([meta.positions, positions]),
            slot_mapping=torch.cat([meta.slot_mapping, torch.full_like(positions, -1)]),
        )
    t = meta.num_tokens
    width = (hq + 2 * hkv) * head_size
    if exact:
        qkv = torch.randint(-15, 16, (t, width), generator=gen) / 8
    else:
        qkv = torch.randn(t, width, generator=gen) * 3
    q, k, v = qkv.to(DEVICE, dtype).split([hq * head_size, hkv * head_size, hkv * head_size], -1)
    q, k, v = (x.reshape(t, -1, head_size) for x in (q, k, v))
    weights = tuple(
        (1 + 0.2 * torch.randn(head_size, generator=gen)).to(DEVICE, dtype) for _ in "qk"
    )
    angles = torch.outer(torch.arange(256).float(), torch.rand(head_size // 2, generator=gen))
    rotary = RotaryCache(angles.cos().to(DEVICE), angles.sin().to(DEVICE))
    k_cache = torch.randn(num_pages, page_size, hkv, head_size, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(DEVICE, dtype)
    extra = {}
    if cache_dtype is not None:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
        extra["kv_scale"] = torch.tensor([0.5, 0.25], dtype=torch.float32, device=DEVICE)
    return dict(
        q=q, k=k, v=v, rotary=rotary, k_cache=k_cache, v_cache=v_cache, meta=meta,
        weights=weights, extra=extra,
    )  # fmt: skip


def _unfused_qk_norm(case: dict, eps: float) -> tuple[torch.Tensor, ...]:
    """The reference path: ``rms_norm`` of q and k, then ``rope_and_store`` into copies of the
    caches with one more page, where the padding rows (slot -1) are sent. Returns (q, k, k_cache,
    v_cache), the caches without that page."""
    meta, k_cache = case["meta"], case["k_cache"]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    spare = torch.arange(num_slots, num_slots + meta.num_tokens, device=DEVICE)
    slots = torch.where(meta.slot_mapping >= 0, meta.slot_mapping, spare)
    meta = attrs.evolve(meta, slot_mapping=slots)
    spare_pages = -(-meta.num_tokens // k_cache.shape[1])
    caches = [  # through bytes: CPU torch has no cat for float8
        torch.cat([_bytes(c), _bytes(c[:1]).repeat(spare_pages, 1, 1, 1)]).view(c.dtype)
        for c in (k_cache, case["v_cache"])
    ]
    ks = reference.ReferenceKernels(DEVICE, case["q"].dtype)
    q = ks.rms_norm(case["q"], case["weights"][0], eps)[0]
    k = ks.rms_norm(case["k"], case["weights"][1], eps)[0]
    q, k = ks.rope_and_store(q, k, case["v"], case["rotary"], *caches, meta, **case["extra"])
    pages = k_cache.shape[0]
    return q, k, caches[0][:pages], caches[1][:pages]


def _fused_qk_norm(
    case: dict, eps: float, ks: FusedKernels | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_and_store`` with ``qk_norm`` of a fused set (outputs poisoned); the rotated q and k."""
    ks = ks or fused(case["q"].dtype)
    assert ks.fuses_qk_norm
    with poisoned_outputs():
        return ks.rope_and_store(
            case["q"], case["k"], case["v"], case["rotary"], case["k_cache"], case["v_cache"],
            case["meta"], **case["extra"], qk_norm=case["weights"], qk_norm_eps=eps,
        )  # fmt: skip


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """Any tensor's raw bytes (compares fp8 and NaN payloads exactly)."""
    return x.contiguous().view(torch.uint8)


@FEW
@given(
    batch=batches(max_seqs=3, max_context=40),
    heads=heads_strategy((1, 2, 4)),
    head_size=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    pad=st.integers(0, 2),
    exact=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rope_and_store_with_qk_norm_matches_rms_norm_then_rope(
    batch: tuple[list[int], list[int], int],
    heads: tuple[int, int],
    head_size: int,
    dtype: torch.dtype,
    pad: int,
    exact: bool,
    seed: int,
) -> None:
    """Qwen3's q/k norm inside the fused rotary + store equals the reference's ``rms_norm`` then
    ``rope_and_store``: q, k and the slots written (padding rows write none, no other slot changes).

    Through the interpreter bit for bit, in bf16 and float32, when every head's sum of squares is
    exact (the kernel sums in another order than torch, its one difference); within the dtype's
    bound otherwise, and on a GPU (where float32 products may fuse into FMAs).
    """
    case = _qk_norm_case(batch, *heads, head_size, dtype, seed, pad, exact)
    k0, v0 = case["k_cache"].clone(), case["v_cache"].clone()
    q_exp, k_exp, k_ref, v_ref = _unfused_qk_norm(case, 1e-6)
    q_out, k_out = _fused_qk_norm(case, 1e-6)
    k_cache, v_cache = case["k_cache"], case["v_cache"]
    meta = case["meta"]
    pages, page_size = k_cache.shape[:2]
    written = torch.zeros(pages * page_size, dtype=torch.bool, device=DEVICE)
    written[meta.slot_mapping[meta.slot_mapping >= 0]] = True
    flat = (pages * page_size, *k_cache.shape[2:])
    assert torch.equal(k_cache.view(flat)[~written], k0.view(flat)[~written])
    assert torch.equal(v_cache.view(flat)[~written], v0.view(flat)[~written])
    assert torch.equal(v_cache, v_ref)  # v is a plain copy
    pairs = ((q_out, q_exp, "q"), (k_out, k_exp, "k"), (k_cache, k_ref, "k cache"))
    for got, exp, what in pairs:
        if exact and INTERPRETED:
            assert torch.equal(_bytes(got), _bytes(exp)), f"{what}: bits differ"
        else:
            assert_close(got, exp, dtype, what)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("exact", [False, True])
def test_rope_and_store_with_qk_norm_fp8_cache(
    cache_dtype: torch.dtype, dtype: torch.dtype, exact: bool
) -> None:
    """An fp8 cache with the q/k norm: the bytes stored are the reference's quantization of the
    normalized, rotated k (bit for bit) and of v; the whole unfused path's bytes when that k is
    the reference's (exact sums, through the interpreter); padding rows (slot -1) store nothing."""
    case = _qk_norm_case(([3, 1, 1], [7, 12, 1], 4), 4, 2, 64, dtype, 5, 1, exact, cache_dtype)
    k0 = case["k_cache"].clone()
    q_exp, k_exp, k_ref, v_ref = _unfused_qk_norm(case, 1e-6)
    q_out, k_out = _fused_qk_norm(case, 1e-6)
    meta, scales = case["meta"], case["extra"]["kv_scale"]
    real = meta.slot_mapping >= 0
    for cache, x, scale in (
        (case["k_cache"], k_out, scales[0]),
        (case["v_cache"], case["v"], scales[1]),
    ):
        stored = reference.gather_pages(cache.flatten(0, 1), meta.slot_mapping[real])
        expected = reference.quantize_kv(x[real], scale, cache_dtype)
        assert torch.equal(_bytes(stored), _bytes(expected))
    assert torch.equal(_bytes(case["v_cache"]), _bytes(v_ref))
    if exact and INTERPRETED:
        assert torch.equal(q_out, q_exp) and torch.equal(k_out, k_exp)
        assert torch.equal(_bytes(case["k_cache"]), _bytes(k_ref))
    else:
        assert_close(q_out, q_exp, dtype, "q")
        assert_close(k_out, k_exp, dtype, "k")
    changed = (_bytes(case["k_cache"]) != _bytes(k0)).flatten(0, 1).flatten(1).any(-1)
    written = torch.zeros_like(changed)
    written[meta.slot_mapping[real]] = True
    assert not (changed & ~written).any(), "a slot outside slot_mapping changed"


def test_qk_norm_capability_follows_the_rotary_kernel() -> None:
    """``fuses_qk_norm`` is declared while rope_and_store runs Triton; the reference set, a set
    whose rotary falls back, and a third-party set that says nothing read as False."""
    from pitstop.plugin_system.protocols import KernelSetBase

    assert KernelSetBase.of(fused(torch.float32), "fuses_qk_norm") is True
    off = fused(torch.float32, fused_attention=False)
    assert off.describe()["rope_and_store"].startswith("reference")
    assert KernelSetBase.of(off, "fuses_qk_norm") is False
    assert (
        KernelSetBase.of(reference.ReferenceKernels(DEVICE, torch.float32), "fuses_qk_norm")
        is False
    )
    assert KernelSetBase.of(object(), "fuses_qk_norm") is False
    # fused.qk_norm = false keeps the Triton rotary but leaves the norms to rms_norm
    apart = fused_set(
        EngineConfig(max_model_len=512, options={"fused.qk_norm": False}), DEVICE, torch.float32
    )
    assert apart.describe()["rope_and_store"] == "triton"
    assert KernelSetBase.of(apart, "fuses_qk_norm") is False


def test_qk_norm_survives_the_head_size_fallback() -> None:
    """A head size without a kernel switches rotary to the reference at the first call; the set
    still declared ``fuses_qk_norm`` when the model was built, and the reference op normalizes
    q and k itself: the reference path's bits exactly."""
    ks = fused(torch.float32)
    case = _qk_norm_case(([2, 1], [5, 9], 4), 2, 1, 64, torch.float32, 3, pad=0)
    narrow = {n: case[n][..., :24].contiguous() for n in ("q", "k", "v")}
    narrow["k_cache"] = case["k_cache"][..., :24].contiguous()
    narrow["v_cache"] = case["v_cache"][..., :24].contiguous()
    narrow["weights"] = tuple(w[:24].contiguous() for w in case["weights"])
    angles = torch.outer(torch.arange(256).float(), torch.rand(12)).to(DEVICE)
    narrow["rotary"] = RotaryCache(angles.cos(), angles.sin())
    case = case | narrow
    ref_case = case | {"k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
    q_exp, k_exp, k_ref, _ = _unfused_qk_norm(ref_case, 1e-5)
    q_out, k_out = _fused_qk_norm(case, 1e-5, ks)
    assert ks.describe()["rope_and_store"].startswith("reference (unsupported head size 24")
    assert torch.equal(q_out, q_exp) and torch.equal(k_out, k_exp)
    assert torch.equal(case["k_cache"], k_ref)


# ---------------------------------------------------------------- one-launch split-K decode (issue 29)

# decode contexts per batch size: inside one split, on either side of the interpreter's 16-key
# tiles and of split borders, and shorter than one split (the other splits empty); a 5-token
# chunk goes first, so that the decodes' rows start past it. The split count per batch size
# (num_sms picks it): 16, 8 and 4 splits of 16, 16 and 32 keys for the 100-token context.
MERGE_CONTEXTS = {1: [100], 3: [1, 47, 100], 8: [1, 15, 16, 17, 47, 64, 65, 100]}
MERGE_SPLITS = {1: 16, 3: 8, 8: 4}


def _merge_case(
    batch: int,
    group: int,
    cache_dtype: torch.dtype | None,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
    hkv: int = 2,
    d: int = 64,
    page_size: int = 8,
) -> tuple:
    """Attention arguments of a 5-token chunk and ``batch`` decodes (MERGE_CONTEXTS) over pages
    of ``cache_dtype`` (None: the queries' dtype; fp8: scales 0.05 and 0.02)."""
    qlens, ctxs = [5] + [1] * batch, [30] + MERGE_CONTEXTS[batch]
    num_pages = sum(-(-c // page_size) for c in ctxs) + 2
    meta = make_meta(qlens, ctxs, page_size, num_pages, seed)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(qlens), hkv * group, d, generator=gen).to(DEVICE, dtype)
    shape = (num_pages, page_size, hkv, d)
    k, v = (torch.randn(shape, generator=gen).to(DEVICE) for _ in range(2))
    scales = torch.tensor([0.05, 0.02], dtype=torch.float32, device=DEVICE)
    if cache_dtype is None:
        return q, k.to(dtype), v.to(dtype), meta, d**-0.5
    k = reference.quantize_kv(k * 3 * scales[0], scales[0], cache_dtype)
    v = reference.quantize_kv(v * scales[1], scales[1], cache_dtype)
    return q, k, v, meta, d**-0.5, scales


def _merge_attention(merge: str, dtype: torch.dtype, splits: int, pairs: int):
    """A PagedAttention whose decodes take ``splits`` splits at ``pairs`` (decode, KV head) pairs
    (splits as short as 16 keys on a GPU too, where they would be 128 at least)."""
    from pitstop.plugins.kernels.triton_ops.paged_attention import PagedAttention

    num_sms = max(1, pairs * splits // 4)
    attn = PagedAttention(
        DEVICE, dtype, 512, num_sms=num_sms, min_split_tokens=16, decode_merge=merge
    )
    assert attn.num_splits(pairs, 1) == splits
    return attn


def assert_within_an_ulp(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Element-wise within one ulp of the output dtype (``eps * |expected|`` is at least one ulp),
    plus 2^-16 of the largest output: the two merges sum the same float32 terms in another order
    (a tree over the splits, or split after split), which moves a float32 sum by a few of its
    ulps, relative to the terms (2^-16 covers cancelling terms); rounded to bf16 that is the
    same value or its neighbour."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite output"
    a, e = actual.double(), expected.double()
    bound = torch.finfo(actual.dtype).eps * e.abs() + 2**-16 * e.abs().max()
    worst = ((a - e).abs() - bound).max().item()
    assert worst <= 0, f"{what}: {worst:.3g} past one ulp"


def _assert_counters_zero(attn, what: str) -> None:
    counters = attn.decode_counters
    assert counters is not None and counters.dtype == torch.int32
    assert not counters.any(), f"{what}: counters left at {counters.nonzero().flatten().tolist()}"


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_last_program_merge_matches_reference_and_separate(
    batch: int, group: int, cache_dtype: torch.dtype | None
) -> None:
    """``decode_merge="last-program"``: the split that arrives last merges inside the decode launch.

    Its output is the reference's within the decode tolerance and the ``separate`` merge's within
    one ulp (equal bits here: the interpreter sums both in the same order), and it leaves every
    arrival counter at zero, for a second launch over other contexts too. The interpreter runs
    the programs one after another, so this cannot show a race: the ordering argument is in
    paged_attention.py's module docstring, the replay test in tests/plugins/kernels/test_fused_gpu.py.
    """
    hkv = 2
    splits = MERGE_SPLITS[batch]
    args = _merge_case(batch, group, cache_dtype, seed=batch * 10 + group)
    sep = _merge_attention("separate", torch.bfloat16, splits, batch * hkv)
    last = _merge_attention("last-program", torch.bfloat16, splits, batch * hkv)
    _assert_counters_zero(last, "fresh")
    what = f"batch {batch} group {group} cache {cache_dtype}"
    with poisoned_outputs():
        expected = sep(*args)
        out = last(*args)
    _assert_counters_zero(last, what)
    assert_close(out, reference.paged_attention(*args), torch.bfloat16, what)
    assert_within_an_ulp(out, expected, what)
    if not torch.cuda.is_available():
        assert torch.equal(out, expected), what

    # a second launch: new queries, the decode contexts 35 shorter (other splits empty; within
    # each sequence's pages, which the block table lists)
    q, k, v, meta, *rest = args
    ctx = meta.context_lens.clone()
    ctx[1:] = (ctx[1:] - 35).clamp_min(1)
    lens = ctx.tolist()
    meta2 = AttentionMetadata(
        positions=meta.positions,
        slot_mapping=meta.slot_mapping,
        block_tables=meta.block_tables,
        context_lens=ctx,
        cu_query_lens=meta.cu_query_lens,
        num_prefills=meta.num_prefills,
        num_prefill_tokens=meta.num_prefill_tokens,
        num_decodes=meta.num_decodes,
        max_query_len=meta.max_query_len,
        max_context_len=max(lens),
        page_size=meta.page_size,
        context_lens_list=lens,
        query_lens_list=meta.query_lens_list,
    )
    args2 = (torch.randn_like(q, dtype=torch.float32).to(q.dtype), k, v, meta2, *rest)
    with poisoned_outputs():
        out2 = last(*args2)
    _assert_counters_zero(last, f"{what}, second launch")
    assert_close(out2, reference.paged_attention(*args2), torch.bfloat16, f"{what}, second")
    assert_within_an_ulp(out2, sep(*args2), f"{what}, second")


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e5m2], ids=["fp32", "e5m2"])
def test_last_program_merge_float32(cache_dtype: torch.dtype | None) -> None:
    """float32 queries (IEEE products): the one-launch merge within 1e-5 of the reference and
    within an ulp of the separate merge; one split (num_sms 1) writes the output directly,
    touching no counter, the same bits as ``separate``."""
    args = _merge_case(3, 4, cache_dtype, seed=7, dtype=torch.float32)
    for splits in (8, 1):
        sep = _merge_attention("separate", torch.float32, splits, 6)
        last = _merge_attention("last-program", torch.float32, splits, 6)
        with poisoned_outputs():
            out, expected = last(*args), sep(*args)
        _assert_counters_zero(last, f"{splits} splits")
        assert_close(out, reference.paged_attention(*args), torch.float32, f"{splits} splits")
        assert_within_an_ulp(out, expected, f"{splits} splits")
        if splits == 1:
            assert torch.equal(out, expected)


def test_last_program_counters_and_knob() -> None:
    """The counters: zeros at construction, enough for every split count that num_splits() gives,
    grown (zeroed) for a forced count that needs more; ``separate`` owns none; a bad value names
    the choices."""
    from pitstop.plugins.kernels.triton_ops.paged_attention import PagedAttention

    attn = PagedAttention(DEVICE, torch.bfloat16, 4096, num_sms=132, decode_merge="last-program")
    assert attn.decode_counters is not None and attn.decode_counters.numel() == 4 * 132
    assert not attn.decode_counters.any()
    for nd in range(1, 600):
        for hkv in (1, 2, 8):
            if attn.num_splits(nd, hkv) > 1:
                assert nd * hkv <= attn.decode_counters.numel(), (nd, hkv)
    assert PagedAttention(DEVICE, torch.bfloat16, 512).decode_counters is None
    with pytest.raises(ValueError, match="separate"):
        PagedAttention(DEVICE, torch.bfloat16, 512, decode_merge="atomic")

    small = PagedAttention(DEVICE, torch.bfloat16, 512, num_sms=1, decode_merge="last-program")
    small.num_splits = lambda num_decodes, num_kv_heads: 2  # type: ignore[method-assign]
    args = _merge_case(3, 4, None, seed=3)
    with poisoned_outputs():
        out = small(*args)
    assert small.decode_counters is not None and small.decode_counters.numel() >= 6
    _assert_counters_zero(small, "grown")
    assert_close(out, reference.paged_attention(*args), torch.bfloat16, "grown")
    small.decode_counters.fill_(1)
    small.reset_decode_counters()
    _assert_counters_zero(small, "reset")


# ---------------------------------------------------------------- whole model


def _tiny_runner(
    arch: str,
    kernels: str,
    dtype: torch.dtype,
    page_size: int,
    kv_cache_dtype: str = "auto",
    options: dict[str, object] | None = None,
):
    """A ModelRunner over a tiny random Hugging Face model of ``arch`` (same weights for every
    kernel set; ``options``: the kernel set's settings)."""
    transformers = pytest.importorskip("transformers")
    from pitstop.plugin_system.plugin_manager import PluginManager
    from pitstop.plugins.models.llama_config import config_from_hf
    from pitstop.runner.model_runner import ModelRunner

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    torch.manual_seed(0)
    hf_config = cfg_cls(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=arch == "llama",
    )
    hf_model = model_cls(hf_config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
    config_dict = hf_config.to_dict()
    config_dict["architectures"] = [model_cls.__name__]
    modules = [
        importlib.import_module(m)
        for m in (
            "pitstop.model",
            "pitstop.plugins.kernels.reference",
            "pitstop.plugins.kernels.fused",
            "pitstop.plugins.samplers.standard",
            "pitstop.plugins.weight_formats.dense",
        )
    ]
    plugins = PluginManager(load_entry_points=False, extra_modules=modules)
    config = EngineConfig(
        max_model_len=128,
        page_size=page_size,
        kernels=kernels,
        device=DEVICE.type,
        kv_cache_dtype=kv_cache_dtype,
        options=options or {},
    )
    runner = ModelRunner(config, config_from_hf(config_dict), plugins, DEVICE, dtype)
    state = {k: v.to(dtype) for k, v in hf_model.state_dict().items()}
    runner.load_weights(lambda: iter(state.items()))
    runner.init_kv_cache(32)
    return runner


def _greedy_schedule(
    runner, prompts: list[list[int]], page_size: int, steps: int
) -> list[list[int]]:
    """Prefill (the last prompt in two chunks, its second chunk beside decodes), then greedy decodes."""
    from pitstop.entrypoints.sampling_params import SamplingParams
    from pitstop.ground.step import SeqInput, StepInput

    greedy = SamplingParams(temperature=0.0)
    pages_each = 128 // page_size
    tables = [
        list(range(i * pages_each, (i + 1) * pages_each))[: 32 // len(prompts)]
        for i in range(len(prompts))
    ]
    out: list[list[int]] = [[] for _ in prompts]
    *whole, last = prompts
    half = len(last) // 2
    # step 1: whole prompts, and the first chunk of the last one (samples nothing)
    first = [SeqInput(i, p, 0, tables[i], True, greedy) for i, p in enumerate(whole)]
    first.append(SeqInput(len(whole), last[:half], 0, tables[-1], False, greedy))
    for i, tok in enumerate(runner.execute(StepInput(first)).token_ids):
        out[i].append(tok)
    # step 2: the last prompt's second chunk first (a prefill), then the others' decodes
    second = [SeqInput(len(whole), last[half:], half, tables[-1], True, greedy)]
    second += [
        SeqInput(i, [out[i][-1]], len(p), tables[i], True, greedy) for i, p in enumerate(whole)
    ]
    toks = runner.execute(StepInput(second)).token_ids
    out[-1].append(toks[0])
    for i, tok in enumerate(toks[1:]):
        out[i].append(tok)
    for _ in range(steps):
        seqs = [
            SeqInput(i, [out[i][-1]], len(p) + len(out[i]) - 1, tables[i], True, greedy)
            for i, p in enumerate(prompts)
        ]
        for i, tok in enumerate(runner.execute(StepInput(seqs)).token_ids):
            out[i].append(tok)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_greedy_tokens_match_reference(arch: str) -> None:
    """A tiny random model gives the same greedy tokens through `fused` as through `reference` (fp32)."""
    page_size = 16
    prompts = [[3, 17, 5, 9, 22, 1, 8], [4, 4], [11] * 15 + [7, 2, 9, 30, 31, 64, 90, 12, 5]]
    tokens = {}
    for kernels in ("reference", "fused"):
        runner = _tiny_runner(arch, kernels, torch.float32, page_size)
        if kernels == "fused":
            assert runner.kernels.describe()["attention"] == "triton"
            assert runner.model.merged
        tokens[kernels] = _greedy_schedule(runner, prompts, page_size, steps=6)
    assert tokens["fused"] == tokens["reference"]
    assert [len(t) for t in tokens["fused"]] == [8, 8, 7]


def _forced_logits(runner, prompts: list[list[int]], forced: list[list[int]]) -> torch.Tensor:
    """Float32 logits of every prompt position (one prefill step), then of one decode step per
    column of ``forced`` (each sequence fed its forced token): the same path for every runner."""
    from pitstop.ground.step import SeqInput

    tables = [list(range(i * 8, (i + 1) * 8)) for i in range(len(prompts))]

    def step(seqs: list) -> torch.Tensor:
        ids, meta, _ = runner.build_metadata(seqs)
        hidden = runner.model(ids, runner.rotary, runner.kv_cache, meta)
        return runner.model.compute_logits(hidden).float()

    with torch.inference_mode():
        out = [step([SeqInput(i, p, 0, tables[i], True) for i, p in enumerate(prompts)])]
        for n in range(len(forced[0])):
            seqs = [
                SeqInput(i, [forced[i][n]], len(p) + n, tables[i], True)
                for i, p in enumerate(prompts)
            ]
            out.append(step(seqs))
    return torch.cat(out)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_tiny_model_fp8_cache_fused_is_as_accurate_as_reference(kv_cache_dtype: str) -> None:
    """With an fp8 cache, `fused` logits (prefill, then decodes) are no further from the
    float32-cache truth than `reference` ones (fp32 model, same forced tokens).

    Not token for token: fp8 rounding amplifies the last-bit differences of two correct kernel
    sets (a K value one float32 ulp apart can round to the neighbouring fp8 value, 6% away), so
    greedy paths of fused and reference part at near-ties; the kernel tests above compare them
    on identical fp8 bytes instead."""
    page_size = 16
    prompts = [[3, 17, 5, 9, 22, 1, 8], [4, 4], [11] * 15 + [7, 2, 9, 30, 31, 64, 90, 12, 5]]
    gen = torch.Generator().manual_seed(4)
    forced = torch.randint(0, 128, (len(prompts), 10), generator=gen).tolist()
    truth = _forced_logits(
        _tiny_runner("llama", "reference", torch.float32, page_size), prompts, forced
    )
    errors = {}
    for kernels in ("reference", "fused"):
        runner = _tiny_runner("llama", kernels, torch.float32, page_size, kv_cache_dtype)
        assert runner.kv_cache.element_size() == 1
        if kernels == "fused":
            assert runner.kernels.describe()["attention"] == "triton"
        logits = _forced_logits(runner, prompts, forced)
        assert torch.isfinite(logits).all()
        errors[kernels] = (logits - truth).abs().max().item()
    assert errors["reference"] > 1e-4, "the fp8 cache changed nothing"
    assert errors["fused"] <= 2 * errors["reference"], errors


def test_fused_settings_offer_exactly_the_kernel_choices() -> None:
    """``fused.py`` repeats PagedAttention's choices (it imports no Triton until the kernel set is
    built); the setting accepts every mode the kernels take, and no other."""
    from pitstop.plugins.kernels.triton_ops import paged_attention as pa

    fields = attrs.fields_dict(FusedSettings)
    assert fields["fp8_widen"].metadata["choices"] == pa.FP8_WIDEN
    assert fields["decode_merge"].metadata["choices"] == pa.DECODE_MERGE
    assert fields["decode_tiles"].metadata["choices"] == pa.DECODE_TILE_RULES


def test_fp8_widen_is_a_fused_setting() -> None:
    """``fused.fp8_widen`` (default ``fp16``) reaches the attention kernels; a bad value is refused
    where the config is built, with the choices named."""
    from pitstop.errors import ConfigError
    from pitstop.plugin_system.plugin_manager import get_plugin_manager

    default = fused_set(EngineConfig(max_model_len=512), DEVICE, torch.bfloat16)
    assert default._attn.fp8_widen == "fp16"
    config = EngineConfig(max_model_len=512, options={"fused.fp8_widen": "query"})
    chosen = fused_set(config, DEVICE, torch.bfloat16)
    assert chosen._attn.fp8_widen == "query"
    config = EngineConfig(max_model_len=512, options={"fused.fp8_widen": "qk-fp8"})
    assert fused_set(config, DEVICE, torch.bfloat16)._attn.fp8_widen == "qk-fp8"
    merged = fused_set(
        EngineConfig(max_model_len=512, options={"fused.decode_merge": "last-program"}),
        DEVICE,
        torch.bfloat16,
    )
    assert default._attn.decode_merge == "separate"
    assert merged._attn.decode_merge == "last-program"
    with pytest.raises(ConfigError, match="fp16"):
        get_plugin_manager().resolve(
            EngineConfig(kernels="fused", options={"fused.fp8_widen": "bf16"})
        )


def test_tiny_qwen3_normalizes_q_and_k_inside_rope_and_store() -> None:
    """A tiny Qwen3 (q/k norm) through `fused`: the norm goes into rope_and_store (two rms_norm
    calls fewer per layer), and the logits (a prefill, then decodes) are the reference set's and
    those of the same set with the norm left to rms_norm, within the float32 bound."""
    page_size = 16
    prompts = [[3, 17, 5, 9, 22, 1, 8], [4, 4], [11] * 15 + [7, 2, 9]]
    gen = torch.Generator().manual_seed(1)
    forced = torch.randint(0, 128, (len(prompts), 4), generator=gen).tolist()
    reference_runner = _tiny_runner("qwen3", "reference", torch.float32, page_size)
    assert not any(layer.self_attn.fuse_qk_norm for layer in reference_runner.model.layers)
    expected = _forced_logits(reference_runner, prompts, forced)

    # the unfused layer, whatever fused.layer's default: its rms_norm calls are counted below
    runner = _tiny_runner(
        "qwen3", "fused", torch.float32, page_size, options={"fused.layer": False}
    )
    attns = [layer.self_attn for layer in runner.model.layers]
    assert all(attn.fuse_qk_norm for attn in attns)
    kernels, calls = runner.kernels, []
    rms_norm = kernels.rms_norm

    def counted(*args: object, **kwargs: object):
        calls.append(1)
        return rms_norm(*args, **kwargs)

    kernels.rms_norm = counted
    fused_logits = _forced_logits(runner, prompts, forced)
    num_fused = len(calls)
    for attn in attns:
        attn.fuse_qk_norm = False  # the unfused path of the same set, on the same weights
    calls.clear()
    unfused_logits = _forced_logits(runner, prompts, forced)
    steps, layers = 1 + len(forced[0]), len(attns)
    assert num_fused == steps * (2 * layers + 1)  # input and post-attention norms, final norm
    assert len(calls) == steps * (4 * layers + 1)
    assert_close(fused_logits, expected, torch.float32, "fused q/k norm vs reference")
    assert_close(fused_logits, unfused_logits, torch.float32, "fused q/k norm vs rms_norm")


def test_the_conformance_suite_checks_the_fused_set_with_its_qk_norm() -> None:
    """``pitstop.testing.kernels.check_kernel_set`` on the fused set, which declares
    ``fuses_qk_norm``: its rope_and_store is also checked with the q/k norms passed in."""
    from pitstop.testing.kernels import check_kernel_set

    made = []

    def make(device: torch.device, dtype: torch.dtype) -> FusedKernels:
        made.append(fused(dtype))
        return made[-1]

    check_kernel_set(make, device=DEVICE, dtypes=(torch.float32,), max_examples=3)
    assert made and made[0].fuses_qk_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("query_lens", "context_lens", "page_size", "heads"),
    [
        ((1, 7, 30), (1, 7, 30), 16, (4, 2)),  # a one-token prompt first (issue: NaN rows)
        ((3, 1, 9, 1, 20, 1), (5, 12, 9, 40, 20, 33), 4, (6, 2)),  # decodes between, and last
    ],
)
def test_attention_one_token_sequence_before_a_longer_one(
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    page_size: int,
    heads: tuple[int, int],
    dtype: torch.dtype,
) -> None:
    """A step built by ``build_metadata`` from sequences not sorted prefills first (a one-token
    prompt before longer ones, as ``helpers.checkpoints.prefill_logits`` builds them). The
    kernels run the first ``num_prefills`` sequences as prefills and the rest as decodes from
    row ``num_prefill_tokens``; ``num_prefills`` once counted the sequences of more than one
    token wherever they sat, so the rows of a long sequence after a short one were never
    written (``torch.empty``: garbage, at times NaN). Now every sequence up to the last long
    one is a prefill (``runner_batch._flatten``). Outputs are poisoned and so
    is every cache slot no sequence has written: each row must be the reference's (computed
    on the same sequences sorted prefills first)."""
    from pitstop.ground.step import SeqInput
    from pitstop.runner.batch import build_metadata

    hq, hkv = heads
    head_size = 64
    num_pages = sum(-(-c // page_size) for c in context_lens) + 3
    gen = torch.Generator().manual_seed(7)
    free = torch.randperm(num_pages, generator=gen).tolist()
    seqs = []
    for i, (n, c) in enumerate(zip(query_lens, context_lens, strict=True)):
        pages, free = free[: -(-c // page_size)], free[-(-c // page_size) :]
        seqs.append(SeqInput(i, [0] * n, c - n, pages, True))
    shape = (num_pages, page_size, hkv, head_size)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    for s, c in zip(seqs, context_lens, strict=True):  # the written slots: positions < context
        pos = torch.arange(c)
        page, off = torch.tensor(s.block_table)[pos // page_size], pos % page_size
        k_cache[page, off] = torch.randn(c, hkv, head_size, generator=gen)
        v_cache[page, off] = torch.randn(c, hkv, head_size, generator=gen)
    k_cache, v_cache = k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype)
    q = torch.randn(sum(query_lens), hq, head_size, generator=gen).to(DEVICE, dtype)
    no_pending = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    _, meta, _ = build_metadata(seqs, page_size, DEVICE, no_pending, lambda seq_id: 0)
    # every sequence up to the last one of several tokens runs as a prefill; the rest, decodes
    last_long = max(i for i, n in enumerate(query_lens) if n > 1)
    assert meta.num_prefills == last_long + 1
    assert meta.num_prefill_tokens == sum(query_lens[: last_long + 1])
    scale = head_size**-0.5
    with poisoned_outputs():
        out = fused(dtype).attention(q, k_cache, v_cache, meta, scale)
    # the reference on the same sequences laid out as the runner lays them out
    order = sorted(range(len(seqs)), key=lambda i: query_lens[i] == 1)
    cu = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in order]).to(DEVICE)
    _, sorted_meta, _ = build_metadata(
        [seqs[i] for i in order], page_size, DEVICE, no_pending, lambda seq_id: 0
    )
    expected = torch.empty_like(q)
    expected[rows] = reference.paged_attention(q[rows], k_cache, v_cache, sorted_meta, scale)
    assert_close(out, expected, dtype, f"attention q={query_lens} ctx={context_lens}")
