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
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from pitstop.ground.attention import AttentionMetadata
from pitstop.plugins.kernels.triton_ops.launch_math import next_power_of_2

log = logging.getLogger(__name__)

CHUNK_FACTOR = 4  # a chunk over cached tokens takes cuDNN from a context this many times min_tokens


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
        ctxs = meta.context_lens_list[: meta.num_prefills]
        if len(lens) != meta.num_prefills or len(ctxs) != meta.num_prefills:
            return False
        return all_long(lens, ctxs, self.min_tokens)

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
                _attend_chunk(qs, k, v, ctx - n, scale, out[start : start + n])
                start += n
        except RuntimeError as exc:  # no cuDNN attention in this build, or an input it refuses
            self.disabled_reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            log.warning("cuDNN prefill off, the Triton kernel instead: %s", self.disabled_reason)
            return False
        return True


def all_long(query_lens: list[int], context_lens: list[int], min_tokens: int) -> bool:
    """Whether every prefill sequence is long enough for cuDNN to pay: at least
    ``min_tokens`` query tokens, and a chunk over cached tokens (which pays a gather of the
    prefix, two calls and a merge) a context of at least ``CHUNK_FACTOR * min_tokens``. On
    the H200 (2026-12-05) the chunks 2,048 over 29,952 and 8,192 over 23,808 took 0.78 and
    0.74 of the Triton kernel's time, 2,048 over 2,048 1.15 of it."""
    return bool(query_lens) and all(
        n >= min_tokens and (ctx == n or ctx >= CHUNK_FACTOR * min_tokens)
        for n, ctx in zip(query_lens, context_lens, strict=True)
    )


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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal attention of ``q [1, Hq, n, D]`` at positions ``prefix..prefix+n-1`` over
    ``k``/``v`` ``[1, Hkv, prefix+n, D]``, written into ``out [n, Hq, D]``."""
    group = q.shape[1] // k.shape[1]
    if prefix == 0:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        out.copy_(o[0].transpose(0, 1))
        return
    q = q.contiguous()
    o_pre, lse_pre = _cudnn(q, k[:, :, :prefix], v[:, :, :prefix], group, False, scale)
    o_self, lse_self = _cudnn(q, k[:, :, prefix:], v[:, :, prefix:], group, True, scale)
    merge_by_lse(o_pre[0], lse_pre[0], o_self[0], lse_self[0], out)


_native_gqa: bool | None = None  # whether the private op took fewer K/V heads (learned once)


def _cudnn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's attention with its log-sum-exp rows (natural log, float32 ``[1, H, n]``).
    With GQA (``group`` > 1) the K/V heads go in as they are where this torch's op takes
    them, else repeated per query head (learned at the first call)."""
    global _native_gqa
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    k, v = k.contiguous(), v.contiguous()
    if group > 1 and _native_gqa is not False:
        try:
            out, lse, *_ = op(q, k, v, None, True, 0.0, causal, False, scale=scale)
            _native_gqa = True
            return out, lse.reshape(q.shape[0], q.shape[1], q.shape[2]).float()
        except RuntimeError as exc:
            if _native_gqa:  # it worked before: this is another failure
                raise
            _native_gqa = False
            log.info("cuDNN attention takes as many K/V heads as query heads here: %s", exc)
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out, lse, *_ = op(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse.reshape(q.shape[0], q.shape[1], q.shape[2]).float()


def merge_by_lse(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out [n, H, D] = (o_a e^lse_a + o_b e^lse_b) / (e^lse_a + e^lse_b)`` in one pass:
    two attention results over disjoint keys (``o_* [H, n, D]``, their log-sum-exp rows
    ``lse_* [H, n]``, natural log) merged as the attention over all keys, in float32,
    rounded once into ``out`` (which may be a strided view)."""
    h, n, d = o_a.shape
    o_a, o_b = (o if o.stride(-1) == 1 else o.contiguous() for o in (o_a, o_b))
    assert out.shape == (n, h, d) and out.stride(-1) == 1, "out: [n, H, D], D contiguous"
    grid = (n, h)
    _merge_kernel[grid](
        o_a, o_b, lse_a, lse_b, out,
        o_a.stride(0), o_a.stride(1), o_b.stride(0), o_b.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
        out.stride(0), out.stride(1),
        D=d, BLOCK_D=next_power_of_2(d),
    )  # fmt: skip


@triton.jit
def _merge_kernel(
    a_ptr, b_ptr, la_ptr, lb_ptr, out_ptr,
    sa_h, sa_n, sb_h, sb_n, sla_h, sla_n, slb_h, slb_n, so_n, so_h,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    la = tl.load(la_ptr + head * sla_h + row * sla_n).to(tl.float32)
    lb = tl.load(lb_ptr + head * slb_h + row * slb_n).to(tl.float32)
    m = tl.maximum(la, lb)
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    a = tl.load(a_ptr + head * sa_h + row * sa_n + d, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + head * sb_h + row * sb_n + d, mask=mask, other=0.0).to(tl.float32)
    o = (a * wa + b * wb) / (wa + wb)
    dt: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * so_n + head * so_h + d, o.to(dt), mask=mask)
