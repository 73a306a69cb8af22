"""Microbenchmark of the `fused` kernels on a CUDA device (not a test).

Times each kernel with ``triton.testing.do_bench`` and states its achieved
rate against the H200 ceilings measured in WORKLOADS.md (4.23 TB/s copy,
792 TFLOP/s bf16):

- decode attention: bytes = every cached K and V token read once per KV head
  + q and out; vs the reference (per-sequence SDPA);
- residual add + RMSNorm: bytes = x, residual read; out, new residual written;
- SiLU-and-mul: bytes = [T, 2d] read, [T, d] written;
- prefill attention: causal FLOPs = 4 * Hq * D * sum over tokens of their context.

Usage (on the H200)::

    python benchmarks/kernels_bench.py                 # every kernel, default shapes
    python benchmarks/kernels_bench.py --only decode --batch 64 --context 2048
"""

from __future__ import annotations

import argparse

import torch

from pitstop.attention import AttentionMetadata
from pitstop.config import EngineConfig
from pitstop.plugins.kernels import reference

COPY_BW = 4.23e12  # bytes/s, device-to-device copy (read + written), H200
BF16_FLOPS = 792e12


def paged_meta(
    batch: int, query_len: int, context: int, page_size: int
) -> tuple[AttentionMetadata, int]:
    """``batch`` sequences of ``context`` tokens (the last ``query_len`` new) over shuffled pages."""
    pages_each = -(-context // page_size)
    num_pages = batch * pages_each
    perm = torch.randperm(num_pages).view(batch, pages_each)
    positions = torch.arange(context - query_len, context).repeat(batch)
    seq = torch.arange(batch).repeat_interleave(query_len)
    slots = perm[seq, positions // page_size] * page_size + positions % page_size
    cu = torch.arange(batch + 1, dtype=torch.int32) * query_len
    prefill = query_len > 1
    meta = AttentionMetadata(
        positions=positions.cuda(),
        slot_mapping=slots.cuda(),
        block_tables=perm.to(torch.int32).cuda(),
        context_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        cu_query_lens=cu.cuda(),
        num_prefills=batch if prefill else 0,
        num_prefill_tokens=batch * query_len if prefill else 0,
        num_decodes=0 if prefill else batch,
        max_query_len=query_len,
        max_context_len=context,
        page_size=page_size,
        context_lens_list=[context] * batch,
        query_lens_list=[query_len] * batch,
    )
    return meta, num_pages


def bench(fn) -> float:
    """Median milliseconds of ``fn`` (L2 flushed between runs by do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200)


def report(name: str, ms: float, nbytes: float | None = None, flops: float | None = None) -> None:
    """One line: time, and the rate against the ceiling."""
    line = f"{name:<44} {ms * 1e3:9.1f} us"
    if nbytes is not None:
        bw = nbytes / (ms * 1e-3)
        line += f"  {bw / 1e12:6.2f} TB/s  {100 * bw / COPY_BW:5.1f}% of copy"
    if flops is not None:
        rate = flops / (ms * 1e-3)
        line += f"  {rate / 1e12:7.1f} TFLOP/s  {100 * rate / BF16_FLOPS:5.1f}% of bf16 peak"
    print(line, flush=True)


def bench_decode(kernels, args: argparse.Namespace, dtype: torch.dtype) -> None:
    """Decode attention at batch x context, fused vs reference."""
    meta, num_pages = paged_meta(args.batch, 1, args.context, args.page_size)
    hq, hkv, d = args.heads, args.kv_heads, args.head_size
    q = torch.randn(args.batch, hq, d, device="cuda", dtype=dtype)
    k_cache = torch.randn(num_pages, args.page_size, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    elt = k_cache.element_size()
    nbytes = 2 * args.batch * args.context * hkv * d * elt + 2 * q.numel() * elt
    name = f"decode attn B={args.batch} ctx={args.context} {hq}/{hkv}x{d}"
    splits = kernels._attn.num_splits(args.batch, hkv)
    report(
        f"{name} fused (splits={splits})",
        bench(lambda: kernels.attention(q, k_cache, v_cache, meta, d**-0.5)),
        nbytes,
    )
    if not args.skip_reference:
        report(
            f"{name} reference",
            bench(lambda: reference.paged_attention(q, k_cache, v_cache, meta, d**-0.5)),
            nbytes,
        )


def bench_prefill(kernels, args: argparse.Namespace, dtype: torch.dtype) -> None:
    """Causal prefill attention of one prompt of ``--prefill-len`` tokens."""
    n = args.prefill_len
    meta, num_pages = paged_meta(1, n, n, args.page_size)
    hq, hkv, d = args.heads, args.kv_heads, args.head_size
    q = torch.randn(n, hq, d, device="cuda", dtype=dtype)
    k_cache = torch.randn(num_pages, args.page_size, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    flops = 4 * hq * d * n * (n + 1) / 2
    name = f"prefill attn {n} tokens {hq}/{hkv}x{d}"
    report(
        f"{name} fused",
        bench(lambda: kernels.attention(q, k_cache, v_cache, meta, d**-0.5)),
        flops=flops,
    )
    if not args.skip_reference:
        report(
            f"{name} reference",
            bench(lambda: reference.paged_attention(q, k_cache, v_cache, meta, d**-0.5)),
            flops=flops,
        )


def bench_norm_silu(kernels, args: argparse.Namespace, dtype: torch.dtype) -> None:
    """Residual add + RMSNorm and SiLU-and-mul over ``--tokens`` rows."""
    t, h = args.tokens, args.hidden
    x = torch.randn(t, h, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    w = torch.ones(h, device="cuda", dtype=dtype)
    nbytes = 4 * x.numel() * x.element_size()
    report(f"add+rmsnorm {t}x{h} fused", bench(lambda: kernels.rms_norm(x, w, 1e-6, r)), nbytes)
    report(
        f"add+rmsnorm {t}x{h} reference", bench(lambda: reference.rms_norm(x, w, 1e-6, r)), nbytes
    )
    g = torch.randn(t, 2 * args.ffn, device="cuda", dtype=dtype)
    nbytes = 3 * t * args.ffn * g.element_size()
    report(f"silu_and_mul {t}x{args.ffn} fused", bench(lambda: kernels.silu_and_mul(g)), nbytes)
    ref = reference.ReferenceKernels(torch.device("cuda"), dtype)
    report(f"silu_and_mul {t}x{args.ffn} reference", bench(lambda: ref.silu_and_mul(g)), nbytes)


def main() -> None:
    """Parse flags, build the fused kernel set, run the chosen benchmarks."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["decode", "prefill", "norm"], action="append")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=12288)
    p.add_argument("--precision", choices=["fp32", "fast"], default="fp32")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--skip-reference", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_bench needs a CUDA device")
    from pitstop.plugins.kernels.fused import FusedKernels

    dtype = torch.bfloat16
    config = EngineConfig(max_model_len=args.max_model_len, fused_precision=args.precision)
    kernels = FusedKernels(config, torch.device("cuda"), dtype)
    print(f"{torch.cuda.get_device_name()}; {kernels.describe()}")
    only = set(args.only or ["decode", "prefill", "norm"])
    with torch.inference_mode():
        if "decode" in only:
            bench_decode(kernels, args, dtype)
        if "prefill" in only:
            bench_prefill(kernels, args, dtype)
        if "norm" in only:
            bench_norm_silu(kernels, args, dtype)


if __name__ == "__main__":
    main()
