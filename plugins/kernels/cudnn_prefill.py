"""Long prefills through cuDNN's attention (torch's SDPA backend), over the paged KV cache.

On the H200 cuDNN's fused attention runs a causal prompt at 516-606 TFLOP/s where the
Triton prefill kernel reaches 386-437 (``benchmarks/kernels_bench.py --suite --peer``,
2026-12-05), so a step whose every prefill sequence is long sends them here instead.

cuDNN reads contiguous K/V, so each sequence's pages are gathered first (one copy of
its K and V: at 32k tokens of 8 KV heads x 128 that is about 1% of the attention's
time). A sequence with no cached prefix is one causal call. A chunk that continues
from ``P`` cached tokens is two calls whose softmax statistics are merged (the same
identity as split-K decode): the chunk against the prefix, unmasked, and the chunk
against itself, causal; with ``lse`` each call's log-sum-exp per query row,

    out = out_prefix * exp(lse_prefix - lse) + out_self * exp(lse_self - lse),
    lse = logaddexp(lse_prefix, lse_self).

This keeps cuDNN on its fast masks (none, and top-left causal on a square), where a
bottom-right causal mask over the whole context ran at 225-310 TFLOP/s.

Only on CUDA, for bf16/fp16 caches (no fp8 scales), outside CUDA-graph capture (the
choice reads the step's host-side lengths), and with every prefill of the step at
least ``min_tokens`` long; otherwise the caller runs its own kernel. A torch build or
input that cuDNN refuses is noted once and never tried again.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from pitstop.ground.attention import AttentionMetadata

log = logging.getLogger(__name__)


class CudnnPrefill:
    """Attends a step's long prefill sequences with cuDNN; ``attend`` says whether it did."""

    def __init__(self, min_tokens: int) -> None:
        self.min_tokens = min_tokens
        self.disabled_reason: str | None = None

    def applies(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step's prefills go to cuDNN (see the module docstring)."""
        if self.disabled_reason is not None or self.min_tokens <= 0 or not meta.num_prefills:
            return False
        if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
            return False
        if k_cache.dtype != q.dtype or torch.cuda.is_current_stream_capturing():
            return False
        lens = meta.query_lens_list[: meta.num_prefills]
        return len(lens) == meta.num_prefills and min(lens) >= self.min_tokens

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> bool:
        """Write the prefill sequences' attention into ``out`` (``[T, Hq, D]``, flat as
        ``q``); False (``out`` untouched) when this step does not apply or cuDNN refuses."""
        if not self.applies(q, k_cache, meta):
            return False
        try:
            start = 0
            for i in range(meta.num_prefills):
                n, ctx = meta.query_lens_list[i], meta.context_lens_list[i]
                k, v = _gather(k_cache, v_cache, meta.block_tables[i], ctx, meta.page_size)
                qs = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
                o = _attend_chunk(qs, k, v, ctx - n, scale)
                out[start : start + n].copy_(o[0].transpose(0, 1))
                start += n
        except RuntimeError as exc:  # no cuDNN attention in this build, or an input it refuses
            self.disabled_reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            log.warning("cuDNN prefill off, the Triton kernel instead: %s", self.disabled_reason)
            return False
        return True


def _gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, ctx: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first ``ctx`` cached K and V as ``[1, Hkv, ctx, D]`` (a gathered copy)."""
    used = pages[: -(-ctx // page_size)].long()
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.index_select(0, used).view(-1, hkv, d)[:ctx]
    v = v_cache.index_select(0, used).view(-1, hkv, d)[:ctx]
    return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


def _attend_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float
) -> torch.Tensor:
    """Causal attention of ``q [1, Hq, n, D]`` at positions ``prefix..prefix+n-1`` over
    ``k``/``v`` ``[1, Hkv, prefix+n, D]``; returns ``[1, Hq, n, D]``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    if prefix == 0:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1
            )
    q = q.contiguous()
    o_pre, lse_pre = _cudnn(q, k[:, :, :prefix], v[:, :, :prefix], group, False, scale)
    o_self, lse_self = _cudnn(q, k[:, :, prefix:], v[:, :, prefix:], group, True, scale)
    lse = torch.logaddexp(lse_pre, lse_self)
    w_pre = torch.exp(lse_pre - lse).unsqueeze(-1)
    w_self = torch.exp(lse_self - lse).unsqueeze(-1)
    return (o_pre.float() * w_pre + o_self.float() * w_self).to(q.dtype)


def _cudnn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's attention with its log-sum-exp rows (natural log, float32 ``[1, H, n]``);
    K/V repeated ``group`` times per head (the op takes as many as the query has)."""
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k.contiguous(), v.contiguous(), None, True, 0.0, causal, False, scale=scale
    )
    return out, lse.reshape(q.shape[0], q.shape[1], q.shape[2]).float()
