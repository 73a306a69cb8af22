"""`reference` kernels: plain PyTorch, on CPU and CUDA; the numerical reference.

Every op follows the arithmetic of Hugging Face ``transformers``' Llama code
(RMSNorm in float32, rotary in the neox layout), so that greedy output
matches it token for token. Attention loops over the sequences of a step and
runs PyTorch's scaled-dot-product attention on each one's gathered pages: easy
to read and check, not fast.

An fp8 KV cache (``kv_cache_dtype`` fp8_e4m3 / fp8_e5m2) is the numerical
reference of the format: :func:`quantize_kv` stores ``x / scale`` saturated to
the format's finite range and rounded by torch's cast (nearest, ties to even);
:func:`dequantize_kv` multiplies back into the query dtype before attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pitstop.config import EngineConfig
from pitstop.ground.attention import AttentionMetadata
from pitstop.plugin_system.hookspecs import hookimpl
from pitstop.plugin_system.protocols import KernelSetBase, RotaryCache
from pitstop.plugins.kernels import moe_reference


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dimension, after adding ``residual`` when given."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), residual


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` by per-token ``cos``/``sin`` ``[T, D/2]`` (neox halves layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def quantize_kv(
    x: torch.Tensor, scale: torch.Tensor | None, cache_dtype: torch.dtype
) -> torch.Tensor:
    """``x`` in the cache's dtype: for fp8, ``x / scale`` saturated to the format's finite range.

    Saturating (rather than letting the cast overflow) keeps an outlier finite:
    e4m3 has no infinity and would turn it into NaN, e5m2 into inf.
    """
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    assert scale is not None, "an fp8 cache needs its scale"
    limit = torch.finfo(cache_dtype).max
    return (x.to(torch.float32) / scale).clamp(-limit, limit).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V back in the activation dtype: for fp8, times its scale."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    assert scale is not None, "an fp8 cache needs its scale"
    return (x.to(torch.float32) * scale).to(dtype)


def round_query_e4m3(q: torch.Tensor) -> torch.Tensor:
    """``q`` (``[..., D]``) as the fused kernels' ``qk-fp8`` attention multiplies it: each row
    scaled by ``2^-e`` (its largest magnitude into [2^7, 2^8), ``e`` clamped to [-100, 100]),
    rounded to e4m3 and scaled back, in float32. Not used by the reference ops themselves: the
    tests hold that mode to attention over this query."""
    qf = q.to(torch.float32)
    amax = qf.abs().amax(dim=-1, keepdim=True)
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1)
    e = torch.where(amax > 0, exponent - 1 - 7, torch.full_like(exponent, -100)).clamp(-100, 100)
    up = torch.ldexp(torch.ones_like(qf[..., :1]), e)
    return (qf / up).to(torch.float8_e4m3fn).to(torch.float32) * up


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a one-byte float (an fp8 KV cache)."""
    return dtype.is_floating_point and dtype.itemsize == 1


def _bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as uint8 (CPU torch has no index ops for float8), any other as itself."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``cache[pages]`` (any index shape), for every cache dtype."""
    return _bytes_view(cache)[pages].view(cache.dtype)


def split_scales(
    kv_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """(K's scale, V's scale) of an fp8 cache's ``kv_scale`` ``[2]``; (None, None) for a wider cache."""
    return (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Write ``k``, ``v`` ``[T, Hkv, D]`` into the flat slots of the paged caches.

    ``kv_scale`` ``[2]`` (K's, then V's) divides the values of an fp8 cache.
    """
    num_pages, page_size = k_cache.shape[:2]
    k_scale, v_scale = split_scales(kv_scale)
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = _bytes_view(cache).view(num_pages * page_size, *cache.shape[2:])
        flat.index_copy_(0, slots, _bytes_view(quantize_kv(x, scale, cache.dtype)))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a merged ``[gate | up]`` tensor."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k at ``meta.positions``, store k and v at ``meta.slot_mapping``.

    ``qk_norm`` (q's and k's weights): first :func:`rms_norm` every head of q and k
    with ``qk_norm_eps``, exactly as the unfused ``rms_norm`` calls would.
    ``row_scale`` ``(x, eps)``: q, k and v are projections of the rows of ``x`` before
    their RMSNorm (its gain folded into the weight: a kernel set's
    ``norm_linear_deferred``, :class:`~pitstop.plugin_system.protocols.KernelSetBase`); each
    token's q, k and v are first multiplied by :func:`rms_scale` of its row of ``x``
    (float32) and rounded to their dtype, as :func:`norm_linear`'s output is rounded.
    """
    if row_scale is not None:
        q, k, v = apply_row_scale((q, k, v), *row_scale)
    if qk_norm is not None:
        q = rms_norm(q, qk_norm[0], qk_norm_eps)[0]
        k = rms_norm(k, qk_norm[1], qk_norm_eps)[0]
    cos = rotary.cos.index_select(0, meta.positions)
    sin = rotary.sin.index_select(0, meta.positions)
    q = apply_rotary(q, cos, sin)
    k = apply_rotary(k, cos, sin)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scale)
    return q, k


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the decode sequences (one query each) in one batched call.

    Gathers every decode sequence's pages up to the longest context, masks the
    padding, and runs one SDPA with the query heads of a KV head grouped
    together (no K/V repetition for GQA).
    """
    first = meta.num_prefills
    nd = meta.num_decodes
    ctx = meta.context_lens_list[first:]
    max_ctx = max(ctx)
    ps = meta.page_size
    pages = -(-max_ctx // ps)
    tables = meta.block_tables[first:, :pages].clamp(min=0).long()  # -1 padding -> any page, masked
    num_kv_heads, head = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    k_scale, v_scale = split_scales(kv_scale)
    k, v = (
        dequantize_kv(gather_pages(cache, tables), sc, q.dtype)
        .reshape(nd, pages * ps, num_kv_heads, head)[:, :max_ctx]
        .transpose(1, 2)
        for cache, sc in ((k_cache, k_scale), (v_cache, v_scale))
    )
    lens = meta.context_lens[first:]  # already on the device: no host-to-device copy per layer
    visible = torch.arange(max_ctx, device=q.device).unsqueeze(0) < lens.unsqueeze(1)
    # Slots past a context were never written (NaN with poison_memory): a masked score is
    # still NaN * 0 in the product with V, so they are zeroed, not only masked.
    written = visible[:, None, :, None]
    k, v = torch.where(written, k, 0), torch.where(written, v, 0)
    qd = q[meta.num_prefill_tokens :].reshape(nd, num_kv_heads, group, head)
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=visible[:, None, None, :], scale=scale)
    return o.reshape(nd, num_kv_heads * group, head)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its cached keys.

    Prefills (and chunks) run one sequence at a time; decodes all together
    (:func:`decode_attention`). An fp8 cache is dequantized with ``kv_scale``
    (K's scale, then V's) into the query dtype before the products.
    """
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    page_size = meta.page_size
    start = 0
    if meta.num_decodes > 1:
        out[meta.num_prefill_tokens :] = decode_attention(
            q, k_cache, v_cache, meta, scale, kv_scale
        )
    k_scale, v_scale = split_scales(kv_scale)
    num_loop = meta.num_prefills if meta.num_decodes > 1 else meta.num_seqs
    for i in range(num_loop):
        qlen, ctx = meta.query_lens_list[i], meta.context_lens_list[i]
        # a slice of the device block table: no device-to-host copy (and wait) per layer
        pages = meta.block_tables[i, : (ctx + page_size - 1) // page_size].long()
        k = gather_pages(k_cache, pages).flatten(0, 1)[:ctx]  # [ctx, Hkv, D]
        v = gather_pages(v_cache, pages).flatten(0, 1)[:ctx]
        qi = q[start : start + qlen].transpose(0, 1)  # [Hq, qlen, D]
        k = dequantize_kv(k.transpose(0, 1), k_scale, q.dtype).repeat_interleave(group, dim=0)
        v = dequantize_kv(v.transpose(0, 1), v_scale, q.dtype).repeat_interleave(group, dim=0)
        if qlen == 1:
            o = F.scaled_dot_product_attention(qi, k, v, scale=scale)
        else:
            # query j sits at position ctx - qlen + j and sees keys 0..that position
            qpos = torch.arange(ctx - qlen, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
        out[start : start + qlen] = o.transpose(0, 1)
        start += qlen
    return out


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row's ``1 / sqrt(mean(x**2) + eps)`` in float32, ``[T, 1]`` (RMSNorm without its gain)."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def norm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float | None,
    bias: torch.Tensor | None = None,
    lora: Any = None,
) -> torch.Tensor:
    """RMSNorm folded into the projection after it: ``rstd(x) * x @ weight.T (+ bias)``.

    ``weight`` already holds the norm's gain (``W' = W * g[None, :]``, done once at load), so
    only the row scale remains; it is applied to ``x`` here (rounded to ``x``'s dtype, as
    transformers rounds the normalized row) before the GEMM. ``eps=None``: no norm.
    ``lora`` (:class:`.lora_reference.ProjectionLoRA`, its A gain-folded too): the adapter's
    delta of the scaled rows added after the GEMM.
    """
    if eps is not None:
        x = (x.float() * rms_scale(x, eps)).to(x.dtype)
    y = F.linear(x, weight, bias)
    return y if lora is None else lora.add(x, y)


def apply_row_scale(
    parts: tuple[torch.Tensor, ...], x: torch.Tensor, eps: float
) -> tuple[torch.Tensor, ...]:
    """Each of ``parts`` (``[T, ...]``, projections of the rows of ``x [T, K]``) times its
    token's :func:`rms_scale` in float32, rounded back to its dtype: the row scale of an
    RMSNorm applied after the projection (the two commute) instead of before it."""
    scale = rms_scale(x, eps)
    return tuple((p.float() * scale.view(-1, *([1] * (p.dim() - 1)))).to(p.dtype) for p in parts)


def norm_gate_up(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float | None,
    bias: torch.Tensor | None = None,
    lora: Any = None,
    next_lora: Any = None,
) -> torch.Tensor:
    """The MLP's first half in one op: ``silu(gate) * up`` of :func:`norm_linear` over the merged
    ``[gate | up]`` weight (rows ``[2F, K]``, gain folded); returns ``[T, F]``. ``next_lora``
    (the down projection's, whose shrink a kernel set may sum here) is not used: the
    reference's projections each compute their own."""
    del next_lora
    return silu_and_mul(norm_linear(x, weight, eps, bias, lora))


def linear_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora: Any = None,
    next_lora: Any = None,
) -> torch.Tensor:
    """``residual + x @ weight.T (+ bias)``: a projection that writes the residual stream
    (a new tensor here; a kernel set may add into ``residual`` in place and return it);
    ``lora``: the adapter's delta of ``x`` added too; ``next_lora``: not used here (as for
    :func:`norm_gate_up`)."""
    del next_lora
    y = residual + F.linear(x, weight, bias)
    return y if lora is None else lora.add(x, y)


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    weights_dtype: torch.dtype | None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """A sparse-MoE block's experts as transformers runs them: :func:`.moe_reference.route`
    then the loop over the experts hit (:func:`.moe_reference.experts`; ``scales``: fp8
    experts' row scales). Reads which experts were hit on the host, so it is never captured
    in a CUDA graph."""
    weights, ids = moe_reference.route(router_logits, top_k, renormalize, weights_dtype)
    return moe_reference.experts(x, weights, ids, gate_up, down, scales)


OPS = ("rms_norm", "linear", "silu_and_mul", "rope_and_store", "attention", "moe")
# The ops of a fused decoder layer (KernelSetBase.fuses_layer; the model folds the norms' gains
# into the projections at load and runs a layer as these three plus rotary and attention).
LAYER_OPS = ("norm_linear", "norm_gate_up", "linear_residual")


class DispatchKernels(KernelSetBase):
    """A kernel set whose ops call the functions it holds: the reference ones unless replaced.

    A subclass swaps an op by setting ``_rms_norm``, ``_silu``, ``_rope``, ``_attn`` or ``_moe`` on
    the instance, and may check the head size once, at the first rotary/attention call
    (``_head_size_checked`` False, :meth:`_check_head_size`).
    """

    _rms_norm: Callable[..., Any] = staticmethod(rms_norm)
    _silu: Callable[[torch.Tensor], torch.Tensor] = staticmethod(silu_and_mul)
    _rope: Callable[..., Any] = staticmethod(rope_and_store)
    _attn: Callable[..., torch.Tensor] = staticmethod(paged_attention)
    _norm_linear: Callable[..., torch.Tensor] = staticmethod(norm_linear)
    _norm_gate_up: Callable[..., torch.Tensor] = staticmethod(norm_gate_up)
    _linear_residual: Callable[..., torch.Tensor] = staticmethod(linear_residual)
    _moe: Callable[..., torch.Tensor] = staticmethod(moe)
    _head_size_checked = True

    def _check_head_size(self, head_size: int) -> None:
        """Once, at the first rotary/attention call: nothing to check here."""
        self._head_size_checked = True

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """RMSNorm of ``x`` (+ ``residual`` first, when given); returns (normed, new residual or None)."""
        return self._rms_norm(x, weight, eps, residual)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` through torch (cuBLAS on CUDA; one GEMM for merged weights)."""
        return F.linear(x, weight, bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[..., :d]) * x[..., d:]`` of a merged ``[gate | up]`` output of width ``2d``."""
        return self._silu(x)

    def norm_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None = None,
        lora: Any = None,
    ) -> torch.Tensor:
        """``rstd(x) * x @ weight.T (+ bias)``, the norm's gain folded into ``weight`` at load."""
        return self._norm_linear(x, weight, eps, bias, lora)

    def norm_gate_up(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None = None,
        lora: Any = None,
    ) -> torch.Tensor:
        """``silu(gate) * up`` of :meth:`norm_linear` over the merged ``[gate | up]`` weight."""
        return self._norm_gate_up(x, weight, eps, bias, lora)

    def linear_residual(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        bias: torch.Tensor | None = None,
        lora: Any = None,
    ) -> torch.Tensor:
        """``residual + x @ weight.T (+ bias)``: the projection that writes the residual stream."""
        return self._linear_residual(x, weight, residual, bias, lora)

    def rope_and_store(
        self,
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k at ``meta.positions`` (neox layout), store k and v at ``meta.slot_mapping``.

        An fp8 cache stores ``k / kv_scale[0]`` and ``v / kv_scale[1]``, saturated.
        ``qk_norm`` (q's and k's RMSNorm weights): RMS-normalize every head first, in
        ``_rope`` (the reference op and the Triton one both take it). ``row_scale``
        ``(x, eps)``: q, k, v still lack their rows' RMSNorm scale (a deferred
        ``norm_linear_deferred``); applied first (:func:`rope_and_store`).
        """
        if not self._head_size_checked:
            self._check_head_size(q.shape[-1])
        # passed on only when given, so that a ``_rope`` without the parameters keeps working
        extra: dict[str, Any] = {}
        if qk_norm is not None:
            extra.update(qk_norm=qk_norm, qk_norm_eps=qk_norm_eps)
        if row_scale is not None:
            extra["row_scale"] = row_scale
        return self._rope(q, k, v, rotary, k_cache, v_cache, meta, kv_scale, **extra)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of q ``[T, Hq, D]`` over the paged cache; prefills and decodes in one batch.

        An fp8 cache is read with its scales ``kv_scale`` (K's, then V's).
        """
        if not self._head_size_checked:
            self._check_head_size(q.shape[-1])
        return self._attn(q, k_cache, v_cache, meta, scale, kv_scale)

    def moe(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor | None,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        *,
        renormalize: bool,
        weights_dtype: torch.dtype | None,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        router: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        norm_eps: float | None = None,
    ) -> torch.Tensor:
        """A sparse-MoE block's experts, ``[T, H]``: routing of ``router_logits [T, E]``
        (softmax, top-k, ``renormalize``, ``weights_dtype``) and the weighted sum of each
        token's experts over ``gate_up [E, 2F, H]`` and ``down [E, H, F]`` (fp8 with
        ``scales``) (:class:`~pitstop.plugin_system.protocols.MoEOps`); ``router [E, H]``
        ``residual [T, H]`` and ``norm_eps`` are passed on to ``_moe`` (the model gives them
        only to a set that sets ``moe_takes_router`` / ``moe_adds_residual`` /
        ``moe_takes_norm``, whose ``_moe`` takes them)."""
        kw: dict[str, Any] = {} if router is None else {"router": router}
        if residual is not None:
            kw["residual"] = residual
        if norm_eps is not None:
            kw["norm_eps"] = norm_eps
        return self._moe(
            x,
            router_logits,
            gate_up,
            down,
            top_k,
            renormalize=renormalize,
            weights_dtype=weights_dtype,
            scales=scales,
            **kw,
        )


class ReferenceKernels(DispatchKernels):
    """The plain-PyTorch kernel set (never CUDA-graph safe: it reads lengths on the host)."""

    name = "reference"
    # Keep q/k/v and gate/up as separate weights: the same GEMMs transformers runs.
    merge_projections = False
    # Qwen3's q/k norm as two rms_norm calls before rotary, the ops transformers runs (its
    # rope_and_store takes qk_norm all the same, for a set that falls back to it).
    fuses_qk_norm = False

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    def describe(self) -> dict[str, str]:
        """Every op runs plain PyTorch."""
        return {op: "reference (PyTorch)" for op in OPS}


def make_reference_kernels(
    config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> ReferenceKernels:
    """Plain PyTorch ops; the numerical reference, on any device."""
    return ReferenceKernels(device, dtype)


@hookimpl
def register_kernels(register) -> None:
    """Register the ``reference`` kernel set (``kernels="auto"``'s choice on any device
    no other kernel set declares itself for)."""
    register("reference", make_reference_kernels, auto_devices=("*",))
