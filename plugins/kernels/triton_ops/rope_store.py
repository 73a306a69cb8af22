"""Rotary embedding of q and k (neox halves layout) and the K/V store into the paged cache, in one kernel.

One program per token: it reads the token's cos/sin row once, rotates every
query and key head, writes the rotated q and k, and writes the rotated k and
the untouched v into the token's cache slot. A negative slot (a padding row of
a CUDA-graph batch) writes nothing into the cache.

Rounding follows the reference (cos/sin rounded to the activation dtype, each
product rounded, then the sum), so bf16 results match it bit for bit (through
Triton's interpreter too: :func:`_rounded` rounds to bf16 itself).

With ``qk_norm`` (Qwen3) every q and k head is first RMS-normalized in the same
program, from the halves it already holds: the mean of squares over the whole
head in float32, ``h * rsqrt(mean + eps)`` rounded to the activation dtype, then
times the weight in that dtype, as :func:`pitstop.plugins.kernels.reference.rms_norm`
rounds. Only the order of the float32 sum of squares differs from the reference
(torch's reduction order is its own), so the results are the unfused
``rms_norm`` then ``rope_and_store``'s bit for bit whenever that sum is exact in
float32 (checked through the interpreter), and otherwise differ only where its
last bit moves a value across a rounding boundary of the activation dtype.

With ``row_scale`` ``(x, eps)`` (a fused layer's QKV projection of the rows of ``x``
before their RMSNorm, the norm's gain folded into the weight) the program first
computes its token's ``1 / sqrt(mean(x[t] ** 2) + eps)`` in float32 from the row of
``x`` and multiplies q, k and v by it, each rounded to the activation dtype (as
:func:`pitstop.plugins.kernels.reference.apply_row_scale`; only the order of the float32
sum of squares differs), so the projection's GEMM needs no row-scale launch before it.

An fp8 cache (``float8_e4m3fn`` or ``float8_e5m2``) stores ``k / k_scale`` and
``v / v_scale`` (``kv_scale`` ``[2]``, read on the device so a captured CUDA
graph sees the values of the replay), saturated to the format's finite range
and rounded to nearest-even as torch's cast does (bit for bit the reference's
bytes): an outlier stays finite (±448 in e4m3), never NaN or inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pitstop.ground.attention import AttentionMetadata
from pitstop.plugin_system.protocols import RotaryCache
from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops.launch_math import next_power_of_2

# mantissa bits of the fp8 cache formats Triton stores (float8e4nv, float8e5)
FP8_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


@triton.jit
def _rounded(x, DT: tl.constexpr):
    """Float32 ``x`` rounded to ``DT`` as torch's cast rounds (to nearest, ties to even), in float32.

    bf16 is rounded here, on the float32 bits, so that the cast to bf16 that
    follows is exact: Triton 3.9's interpreter truncates float32 to bf16 (the GPU
    rounds to nearest). Done on the GPU too, so that the interpreter tests run the
    code the GPU runs (a few integer operations per element of a memory-bound kernel).
    """
    if DT == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # keep the top 16 bits, rounded
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN stays NaN
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def _rms_normalize(a1, a2, w_ptr, eps, j, HALF: tl.constexpr, DT: tl.constexpr):
    """RMSNorm of each row (one head) of the float32 halves ``a1``, ``a2``, weight ``w_ptr``.

    Rounds as the reference: the norm in float32 (``rsqrt`` as torch's: ``1 / sqrt``
    on the CPU), rounded to the activation dtype ``DT``, times the weight rounded to
    it; returned in float32. The mean multiplies by ``1 / head_size``, exact for the
    power-of-two head sizes the kernel takes.
    """
    mean = (tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)) * (1.0 / (2 * HALF))
    inv = tl.rsqrt(mean + eps)[:, None]
    w1 = tl.load(w_ptr + j).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + j).to(tl.float32)[None, :]
    return _rounded(_rounded(a1 * inv, DT) * w1, DT), _rounded(_rounded(a2 * inv, DT) * w2, DT)


@triton.jit
def _rotate(
    x_ptr,
    out_ptr,
    w_ptr,
    eps,
    t,
    stride_t,
    stride_h,
    h,
    mask,
    j,
    c,
    s,
    rstd,
    H: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    ROW_SCALE: tl.constexpr,
):
    """Rotate the heads ``h`` of token ``t`` (``H`` heads in all); returns the rotated halves.

    The input rows sit at ``t * stride_t + h * stride_h``, the output (contiguous
    ``[T, H, 2 * HALF]``) rows at ``(t * H + h) * 2 * HALF``. With ``ROW_SCALE`` every
    value is first multiplied by the token's ``rstd`` and rounded; with ``NORM`` each
    head is then RMS-normalized (weight ``w_ptr``, ``eps``).
    """
    row_offs = t * stride_t + h * stride_h
    out_row_offs = (t * H + h) * (2 * HALF)
    x1 = tl.load(x_ptr + row_offs[:, None] + j[None, :], mask=mask, other=0.0)
    x2 = tl.load(x_ptr + row_offs[:, None] + HALF + j[None, :], mask=mask, other=0.0)
    dt: tl.constexpr = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    if ROW_SCALE:
        a1 = _rounded(a1 * rstd, dt)
        a2 = _rounded(a2 * rstd, dt)
    if NORM:
        a1, a2 = _rms_normalize(a1, a2, w_ptr, eps, j, HALF, dt)
    o1 = _rounded(_rounded(a1 * c, dt) - _rounded(a2 * s, dt), dt).to(dt)
    o2 = _rounded(_rounded(a2 * c, dt) + _rounded(a1 * s, dt), dt).to(dt)
    tl.store(out_ptr + out_row_offs[:, None] + j[None, :], o1, mask=mask)
    tl.store(out_ptr + out_row_offs[:, None] + HALF + j[None, :], o2, mask=mask)
    return o1, o2


@triton.jit
def _rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scale_ptr,
    q_norm_ptr,
    k_norm_ptr,
    norm_eps,
    x_ptr,
    stride_x,
    row_eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_cp,
    stride_cs,
    stride_ch,
    page_size,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    ROW_K: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    QUANT: tl.constexpr,
    QUANT_MAX: tl.constexpr,
    QUANT_MANTISSA: tl.constexpr,
    QUANT_MIN_NORMAL: tl.constexpr,
    PDL: tl.constexpr,
):
    # the row's position and KV slot, and its cos/sin, before the wait: the runner copies
    # positions and slots in before the step's first kernel (no kernel of the chain writes
    # them) and the tables are constant; q/k/v, the residual rows and the cache (WAR with
    # attention) after it
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + j).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + j).to(tl.float32)
    _pdl.wait(PDL)
    dt: tl.constexpr = q_out_ptr.dtype.element_ty
    c = _rounded(cos, dt)[None, :]
    s = _rounded(sin, dt)[None, :]
    rstd = 1.0
    if ROW_SCALE:
        rstd = _row_rstd(x_ptr + t * stride_x, row_eps, ROW_K, ROW_BLOCK)

    hq = tl.arange(0, BLOCK_HQ)
    q_mask = (hq < HQ)[:, None] & (j < HALF)[None, :]
    _rotate(
        q_ptr, q_out_ptr, q_norm_ptr, norm_eps, t, stride_qt, stride_qh, hq, q_mask, j, c, s,
        rstd, HQ, HALF, NORM, ROW_SCALE,
    )  # fmt: skip

    hk = tl.arange(0, BLOCK_HKV)
    k_mask = (hk < HKV)[:, None] & (j < HALF)[None, :]
    k1, k2 = _rotate(
        k_ptr, k_out_ptr, k_norm_ptr, norm_eps, t, stride_kt, stride_kh, hk, k_mask, j, c, s,
        rstd, HKV, HALF, NORM, ROW_SCALE,
    )  # fmt: skip
    # the cache slot: page slot // page_size, offset slot % page_size; skip padding rows (slot < 0)
    page = slot // page_size
    off = slot % page_size
    cache_offs = (page * stride_cp + off * stride_cs + hk * stride_ch)[:, None] + j[None, :]
    store_mask = k_mask & (tl.zeros_like(hk) + slot >= 0)[:, None]
    ct = k_cache_ptr.dtype.element_ty
    v_offs = (t * stride_vt + hk * stride_vh)[:, None] + j[None, :]
    v1 = tl.load(v_ptr + v_offs, mask=k_mask, other=0.0)
    v2 = tl.load(v_ptr + v_offs + HALF, mask=k_mask, other=0.0)
    if ROW_SCALE:
        v1 = _rounded(v1.to(tl.float32) * rstd, dt).to(dt)
        v2 = _rounded(v2.to(tl.float32) * rstd, dt).to(dt)
    _pdl.launch_dependents(PDL)
    if QUANT:
        k_scale = tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
        k1 = _quantize(k1, k_scale, QUANT_MAX, QUANT_MANTISSA, QUANT_MIN_NORMAL)
        k2 = _quantize(k2, k_scale, QUANT_MAX, QUANT_MANTISSA, QUANT_MIN_NORMAL)
        v1 = _quantize(v1, v_scale, QUANT_MAX, QUANT_MANTISSA, QUANT_MIN_NORMAL)
        v2 = _quantize(v2, v_scale, QUANT_MAX, QUANT_MANTISSA, QUANT_MIN_NORMAL)
    tl.store(k_cache_ptr + cache_offs, k1.to(ct), mask=store_mask)
    tl.store(k_cache_ptr + cache_offs + HALF, k2.to(ct), mask=store_mask)
    tl.store(v_cache_ptr + cache_offs, v1.to(ct), mask=store_mask)
    tl.store(v_cache_ptr + cache_offs + HALF, v2.to(ct), mask=store_mask)


@triton.jit
def _row_rstd(row_ptr, eps, K: tl.constexpr, BLOCK: tl.constexpr):
    """``1 / sqrt(mean(row ** 2) + eps)`` of one row of ``K`` values, in float32."""
    cols = tl.arange(0, BLOCK)
    sq = tl.zeros([BLOCK], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK):
        x = tl.load(row_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        sq += x * x
    return 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)


@triton.jit
def _quantize(x, scale, LIMIT: tl.constexpr, MANTISSA: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """``x / scale`` clamped to ``±LIMIT`` and rounded to the nearest fp8 value (ties to even), in float32.

    The rounding is done here, on the float32 bits, so that the cast to fp8
    that follows is exact: Triton 3.9's interpreter rounds a value just below a
    power of two that should round up to it (31.1 -> 32 in e4m3) down to half
    of it instead. Done on the GPU too, so the interpreter tests run the code
    the GPU runs (a few integer operations per element of a memory-bound kernel).
    Values below the smallest normal are rounded on the subnormal grid by
    shifting them into ``[MIN_NORMAL, 2 MIN_NORMAL)``, where the spacing is that grid's.
    """
    # div_rn: the correctly rounded quotient torch computes (``/`` may be approximate on the GPU)
    y = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -LIMIT, LIMIT)
    a = tl.abs(y)
    subnormal = a < MIN_NORMAL
    a = tl.where(subnormal, a + MIN_NORMAL, a)
    bits = a.to(tl.int32, bitcast=True)
    SHIFT: tl.constexpr = 23 - MANTISSA  # float32 mantissa bits dropped
    odd = (bits >> SHIFT) & 1
    bits = (bits + ((1 << (SHIFT - 1)) - 1) + odd) & (-(1 << SHIFT))
    a = bits.to(tl.float32, bitcast=True)
    a = tl.where(subnormal, a - MIN_NORMAL, a)
    return tl.where(y < 0, -a, a)


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rotary: RotaryCache,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_scale: torch.Tensor | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
    qk_norm_eps: float = 1e-6,
    row_scale: tuple[torch.Tensor, float] | None = None,
    *,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` at ``meta.positions``; store k, v at ``meta.slot_mapping``.

    q, k, v may be strided views (slices of a merged QKV output) as long as the
    last dimension is contiguous. Caches are ``[num_pages, page_size, Hkv, D]``
    (k and v with the same strides). An fp8 cache needs ``kv_scale``
    (float32 ``[2]``: K's scale, V's). ``qk_norm`` (q's and k's RMSNorm weights
    ``[D]``, in q's dtype): RMS-normalize every head with ``qk_norm_eps`` before
    rotating (the normalized, rotated k is what the cache stores). ``row_scale``
    ``(x [T, K], eps)``: multiply each token's q, k and v by ``1 / rms(x[t])`` first (the
    module docstring). Returns fresh
    contiguous rotated q and k. ``pdl``: programmatic dependent launch (default:
    where it works, :mod:`.pdl`).
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    assert d % 2 == 0 and k.shape == (t, hkv, d) and v.shape == (t, hkv, d)
    if qk_norm is not None:
        assert all(w.shape == (d,) and w.dtype == q.dtype and w.stride(-1) == 1 for w in qk_norm), (
            "qk_norm weights must be contiguous [head_size] tensors in q's dtype"
        )
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    cos, sin = rotary.cos, rotary.sin
    assert cos.stride(-1) == 1 and cos.stride() == sin.stride()
    quant = k_cache.element_size() == 1
    assert not quant or (kv_scale is not None and kv_scale.dtype == torch.float32)
    finfo = torch.finfo(k_cache.dtype)
    x_rows, row_eps = row_scale if row_scale is not None else (cos, 0.0)
    row_k = x_rows.shape[-1] if row_scale is not None else 1  # 1: no recompile per model
    if row_scale is not None:
        assert x_rows.dim() == 2 and x_rows.shape[0] == t, "row_scale's x must be [T, K]"
        if x_rows.stride(-1) != 1:
            x_rows = x_rows.contiguous()
    use_pdl = _pdl.enabled(q.device, pdl)
    _rope_store_kernel[(t,)](
        q,
        k,
        v,
        cos,
        sin,
        meta.positions,
        meta.slot_mapping,
        q_out,
        k_out,
        k_cache,
        v_cache,
        kv_scale if quant else cos,  # any pointer when unused
        qk_norm[0] if qk_norm is not None else cos,
        qk_norm[1] if qk_norm is not None else cos,
        qk_norm_eps,
        x_rows,  # cos when unused
        x_rows.stride(0),
        row_eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.page_size,
        HQ=hq,
        HKV=hkv,
        BLOCK_HQ=next_power_of_2(hq),
        BLOCK_HKV=next_power_of_2(hkv),
        HALF=d // 2,
        NORM=qk_norm is not None,
        ROW_SCALE=row_scale is not None,
        ROW_K=row_k,
        ROW_BLOCK=min(1024, next_power_of_2(row_k)),
        QUANT=quant,
        QUANT_MAX=finfo.max,
        QUANT_MANTISSA=FP8_MANTISSA_BITS.get(k_cache.dtype, 0),
        QUANT_MIN_NORMAL=finfo.smallest_normal,
        PDL=use_pdl,
        num_warps=4,
        **_pdl.launch_kwargs(use_pdl),
    )
    return q_out, k_out
