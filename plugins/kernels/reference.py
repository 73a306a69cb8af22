"""`reference` kernels: plain PyTorch, on CPU and CUDA; the numerical reference.

Every op follows the arithmetic of Hugging Face ``transformers``' Llama code
(RMSNorm in float32, rotary in the neox layout), so that greedy output
matches it token for token. Attention loops over the sequences of a step and
runs PyTorch's scaled-dot-product attention on each one's gathered pages: easy
to read and check, not fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pitstop.attention import AttentionMetadata
from pitstop.config import EngineConfig
from pitstop.hookspecs import hookimpl
from pitstop.protocols import KernelSetBase, RotaryCache


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


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write ``k``, ``v`` ``[T, Hkv, D]`` into the flat slots of the paged caches."""
    num_pages, page_size = k_cache.shape[:2]
    k_cache.view(num_pages * page_size, *k_cache.shape[2:]).index_copy_(
        0, slots, k.to(k_cache.dtype)
    )
    v_cache.view(num_pages * page_size, *v_cache.shape[2:]).index_copy_(
        0, slots, v.to(v_cache.dtype)
    )


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k at ``meta.positions``, store k and v at ``meta.slot_mapping``."""
    cos = rotary.cos.index_select(0, meta.positions)
    sin = rotary.sin.index_select(0, meta.positions)
    q = apply_rotary(q, cos, sin)
    k = apply_rotary(k, cos, sin)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
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
    k = k_cache[tables].reshape(nd, pages * ps, num_kv_heads, head)[:, :max_ctx].transpose(1, 2)
    v = v_cache[tables].reshape(nd, pages * ps, num_kv_heads, head)[:, :max_ctx].transpose(1, 2)
    lens = meta.context_lens[first:]  # already on the device: no host-to-device copy per layer
    mask = (torch.arange(max_ctx, device=q.device).unsqueeze(0) < lens.unsqueeze(1))[
        :, None, None, :
    ]
    qd = q[meta.num_prefill_tokens :].reshape(nd, num_kv_heads, group, head)
    o = F.scaled_dot_product_attention(
        qd, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale
    )
    return o.reshape(nd, num_kv_heads * group, head)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its cached keys.

    Prefills (and chunks) run one sequence at a time; decodes all together
    (:func:`decode_attention`).
    """
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    page_size = meta.page_size
    start = 0
    if meta.num_decodes > 1:
        out[meta.num_prefill_tokens :] = decode_attention(q, k_cache, v_cache, meta, scale)
    num_loop = meta.num_prefills if meta.num_decodes > 1 else meta.num_seqs
    for i in range(num_loop):
        qlen, ctx = meta.query_lens_list[i], meta.context_lens_list[i]
        # a slice of the device block table: no device-to-host copy (and wait) per layer
        pages = meta.block_tables[i, : (ctx + page_size - 1) // page_size].long()
        k = k_cache[pages].flatten(0, 1)[:ctx]  # [ctx, Hkv, D]
        v = v_cache[pages].flatten(0, 1)[:ctx]
        qi = q[start : start + qlen].transpose(0, 1)  # [Hq, qlen, D]
        k = k.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
        v = v.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
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


class ReferenceKernels(KernelSetBase):
    """The plain-PyTorch kernel set (never CUDA-graph safe: it reads lengths on the host)."""

    name = "reference"
    # Keep q/k/v and gate/up as separate weights: the same GEMMs transformers runs.
    merge_projections = False

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """RMSNorm (after adding ``residual``); see :func:`rms_norm`."""
        return rms_norm(x, weight, eps, residual)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ weight.T + bias``."""
        return F.linear(x, weight, bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a merged ``[gate | up]`` tensor."""
        return silu_and_mul(x)

    def rope_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryCache,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k at ``meta.positions``, store k and v at ``meta.slot_mapping``."""
        return rope_and_store(q, k, v, rotary, k_cache, v_cache, meta)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention over the paged cache; see :func:`paged_attention`."""
        return paged_attention(q, k_cache, v_cache, meta, scale)

    def describe(self) -> dict[str, str]:
        """Every op runs plain PyTorch."""
        ops = ("rms_norm", "linear", "silu_and_mul", "rope_and_store", "attention")
        return {op: "reference (PyTorch)" for op in ops}


def make_reference_kernels(
    config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> ReferenceKernels:
    """Plain PyTorch ops; the numerical reference, on any device."""
    return ReferenceKernels(device, dtype)


@hookimpl
def register_kernels(register) -> None:
    """Register the ``reference`` kernel set."""
    register("reference", make_reference_kernels)
