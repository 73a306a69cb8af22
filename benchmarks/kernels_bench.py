"""Microbenchmark of the `fused` kernels on a CUDA device (not a test).

Times each kernel with ``tuning.cold_median_ms`` (median, a 256 MB read before
every run) and states its achieved rate against the H200 ceilings measured in
docs/workloads.md (4.23 TB/s copy, 792 TFLOP/s bf16):

- decode attention: bytes = every cached K and V token read once per KV head
  (at the cache's element size: 2 bytes in bf16, 1 in fp8) + q and out;
- prefill attention: causal FLOPs = 4 * Hq * D * (sum over query tokens of the
  keys each one sees), so a chunk over a cached prefix counts the prefix too;
- residual add + RMSNorm: bytes = x, residual read; out, new residual written;
- SiLU-and-mul: bytes = [T, 2d] read, [T, d] written.

Usage (on the H200)::

    python benchmarks/kernels_bench.py                 # every kernel, default shapes
    python benchmarks/kernels_bench.py --only decode --batch 64 --context 2048
    python benchmarks/kernels_bench.py --only prefill --prefill-len 2048 --prefix 2048
    python benchmarks/kernels_bench.py --suite         # the attention shapes of docs/benchmarks.md
    python benchmarks/kernels_bench.py --suite --only prefill --peer   # prefill, with torch's beside
    python benchmarks/kernels_bench.py --decode-suite bfloat16 --decode-suite fp8_e4m3  # KV bytes
    python benchmarks/kernels_bench.py --tune --json tune.json   # the tile sweep behind PREFILL_TILES
    python benchmarks/kernels_bench.py --decode-sweep --jobs 14 --json sweep.json  # issue 29

``--tune`` checks each candidate tile shape against the reference, then times
it: the prefill kernel at 4,096 and 16,384 causal tokens (a few candidates also
at other GQA ratios and head size 64, and at page sizes 1 and 64), the decode
kernel at batch 256 x 512, 64 x 2,048 and 8 x 2,048, then split counts for
small batches; the winners are what ``PREFILL_TILES`` / ``DECODE_TILES`` and
``PagedAttention.num_splits`` in ``plugins/kernels/triton_ops/paged_attention.py``
hold. Decode is timed both eagerly and from a CUDA graph over rotated copies
of its inputs (how the engine runs it; eager timing of a small decode
measures the host's launch overhead). ``--jobs N`` first compiles every
candidate in N processes (Triton's on-disk cache), so the sweep itself only
times. ``benchmarks/kernels_h200.sh`` runs tests, sweep and suite in one call.

``--decode-sweep`` (issue 29) times decode launch configurations from CUDA
graphs over bf16 and fp8_e4m3 caches (fp8 with scales 0.05 and 0.02) at
1 x 4,096, 8 x 2,048, 64 x 2,048, 256 x 512 and 1 x 32,768: the engine's
(the tiles in code, ``num_splits()``, and for fp8 every widening,
``fp8_widen="fp16"``, ``"query"`` and ``"qk-fp8"``), every split count 1..128 (powers of
two) with the tiles in code, the one-launch merge
(``decode_merge="last-program"``: the split arriving last merges, no second
kernel) at every split count 2..128 with the tiles in code and the default
widening, every tile shape of block_n 32/64/128 x warps 1/2/4 x stages 2/3/4
at the engine's split count, then the best tiles at the best split count.
Each is checked against the reference first (a last-program candidate also
for its counters, all zero after the timed replays). It prints the best per
shape, the engine's, the runners-up, and the best of each merge, as % of
copy bandwidth at the cache's bytes (1 per fp8 element); ``--sweep-budget``
(default 130 s) stops it starting candidates, ``--jobs`` compiles them in
processes first (at most 55% of the budget), ``--verbose`` prints every config.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from pitstop.entrypoints.engine_args import engine_config
from pitstop.ground.attention import AttentionMetadata
from pitstop.plugins.kernels import reference
from pitstop.testing.timing import graph_seconds

COPY_BW = 4.23e12  # bytes/s, device-to-device copy (read + written), H200
BF16_FLOPS = 792e12
ROWS: list[dict[str, Any]] = []  # every line printed, for --json
# --dry-run: the attention sweep and suite on CPU through Triton's interpreter, every length
# divided by DRY_SCALE and timed once by the wall clock (checks this script, measures nothing)
DEVICE = "cuda"
DRY_SCALE = 1
COMPILE_ONLY = False  # --compile-only: run each case once (fills Triton's cache), time nothing


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
        positions=positions.to(DEVICE),
        slot_mapping=slots.to(DEVICE),
        block_tables=perm.to(DEVICE, torch.int32),
        context_lens=torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
        cu_query_lens=cu.to(DEVICE),
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


def bench(fn: Callable[[], Any], rep: int = 200) -> float:
    """Median milliseconds of ``fn``, each run after a 256 MB read
    (:func:`pitstop.plugins.kernels.triton_ops.tuning.cold_median_ms`: out of L2, and L2
    clean; until 2026-12-06 ``do_bench``'s 256 MB write, which left L2 dirty and added its
    write-back to every memory-bound kernel's time, so older figures read lower rates)."""
    if DEVICE != "cuda":
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from pitstop.plugins.kernels.triton_ops.tuning import cold_median_ms

    return cold_median_ms(fn, warmup=25, rep=rep)


def report(
    name: str, ms: float, nbytes: float | None = None, flops: float | None = None, **extra: Any
) -> dict[str, Any]:
    """One line: time, and the rate against the ceiling; also kept for ``--json``."""
    line = f"{name:<58} {ms * 1e3:9.1f} us"
    row: dict[str, Any] = {"name": name, "us": round(ms * 1e3, 2), **extra}
    if nbytes is not None:
        bw = nbytes / (ms * 1e-3)
        line += f"  {bw / 1e12:6.2f} TB/s  {100 * bw / COPY_BW:5.1f}% of copy"
        row.update(tb_s=round(bw / 1e12, 3), frac_copy=round(bw / COPY_BW, 4))
    if flops is not None:
        rate = flops / (ms * 1e-3)
        line += f"  {rate / 1e12:7.1f} TFLOP/s  {100 * rate / BF16_FLOPS:5.1f}% of bf16 peak"
        row.update(tflop_s=round(rate / 1e12, 1), frac_peak=round(rate / BF16_FLOPS, 4))
    print(line, flush=True)
    ROWS.append(row)
    save_json()
    return row


JSON_OUT: dict[str, Any] = {}  # --json's path and header: rewritten after every line, so a run
# stopped by its time limit still leaves what it measured


def save_json(winners: dict[str, Any] | None = None) -> None:
    """Write the header, the winners and every row so far to ``--json``'s path (if given)."""
    if "path" not in JSON_OUT:
        return
    if winners is not None:
        JSON_OUT["header"]["winners"] = winners
    with open(JSON_OUT["path"], "w") as f:
        json.dump({**JSON_OUT["header"], "rows": ROWS}, f, indent=1)


# ---------------------------------------------------------------- attention cases


KV_CACHE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def attention_inputs(
    batch: int,
    query_len: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_size: int,
    page_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q and paged K/V caches (never zeros) for ``batch`` sequences.

    ``kv_dtype`` fp8: the caches hold the same random values quantized with scale 1.
    """
    meta, num_pages = paged_meta(batch, query_len, context, page_size)
    q = torch.randn(batch * query_len, heads, head_size, device=DEVICE, dtype=dtype)
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_size, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    if kv_dtype is not None and kv_dtype != dtype:
        one = torch.ones((), device=DEVICE)
        k_cache, v_cache = (reference.quantize_kv(c, one, kv_dtype) for c in (k_cache, v_cache))
    return q, k_cache, v_cache, meta


def prefill_flops(query_len: int, context: int, heads: int, head_size: int) -> float:
    """Causal attention FLOPs of one sequence: query j (at position prefix + j) sees prefix + j + 1 keys."""
    prefix = context - query_len
    keys = query_len * prefix + query_len * (query_len + 1) / 2
    return 4 * heads * head_size * keys


def decode_bytes(
    batch: int, context: int, heads: int, kv_heads: int, d: int, elt: int, q_elt: int | None = None
) -> float:
    """Each cached K and V token read once per KV head (``elt`` bytes each: 1 for fp8), plus q
    read and out written (``q_elt`` bytes, default ``elt``)."""
    q_elt = elt if q_elt is None else q_elt
    return 2 * batch * context * kv_heads * d * elt + 2 * batch * heads * d * q_elt


def make_attention(
    dtype: torch.dtype,
    max_context: int,
    prefill=None,
    decode=None,
    splits: int | None = None,
    fp8_widen: str = "fp16",
    decode_merge: str = "separate",
):
    """A PagedAttention with the given tiles (None: the tables in code), optionally a forced split count."""
    from pitstop.plugins.kernels.triton_ops.paged_attention import PagedAttention

    attn = PagedAttention(
        torch.device(DEVICE),
        dtype,
        max_context,
        prefill=prefill,
        decode=decode,
        fp8_widen=fp8_widen,
        decode_merge=decode_merge,
    )
    if splits is not None:
        attn.num_splits = lambda num_decodes, num_kv_heads: splits  # type: ignore[method-assign]
    return attn


REFERENCE: dict[tuple, torch.Tensor] = {}  # reference outputs by case, for the sweep's checks


def graph_ms(calls: list[Callable[[], Any]], replays: int = 20) -> float:
    """Median milliseconds per call of ``calls`` replayed from one CUDA graph (no launch gaps;
    :func:`pitstop.testing.timing.graph_seconds`).

    This is how the engine runs decode steps. Each call reads its own buffers, so
    one replay reads far more than the L2 holds and nothing is served from it.
    """
    if DEVICE != "cuda":
        return bench(lambda: [c() for c in calls]) / len(calls)
    return 1e3 * graph_seconds(calls, replays)


def checked_time(
    attn,
    case: tuple,
    d: int,
    rep: int,
    graph_bytes: float | None = None,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> tuple[float, float, float | None]:
    """(eager ms, graph ms or None, relative max error against the reference) on ``case``'s seeded inputs.

    ``graph_bytes``: also time from a CUDA graph over enough copies of the
    inputs to read ~512 MB per replay. The reference check is skipped (error 0)
    where its dense mask would not fit (prompts past 16k tokens). ``kv_dtype``:
    the caches' element type (fp8: scales of 1, the reference dequantizes).
    """
    torch.manual_seed(hash(case) % 2**31)
    scales = torch.ones(2, device=DEVICE)  # used only by an fp8 cache
    q, k, v, meta = attention_inputs(*case, torch.bfloat16, kv_dtype)
    out = attn(q, k, v, meta, d**-0.5, scales)
    if COMPILE_ONLY:
        return 0.0, None, 0.0
    err = 0.0
    if case[1] * case[2] <= 16384 * 16384:
        key = (*case, kv_dtype)
        if key not in REFERENCE:
            REFERENCE[key] = reference.paged_attention(q, k, v, meta, d**-0.5, scales)
        ref = REFERENCE[key].float()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    del out
    eager = bench(lambda: attn(q, k, v, meta, d**-0.5, scales), rep)
    graph = None
    if graph_bytes is not None:
        copies = max(2, min(512, -(-int(512e6) // int(graph_bytes))))
        if DEVICE != "cuda":
            copies = 2
        inputs = [(q, k, v, meta)] + [
            attention_inputs(*case, torch.bfloat16, kv_dtype) for _ in range(copies - 1)
        ]
        calls = [lambda x=x: attn(x[0], x[1], x[2], x[3], d**-0.5, scales) for x in inputs]
        graph = graph_ms(calls)
    return eager, graph, err


def time_prefill(attn, n: int, prefix: int, hq: int, hkv: int, d: int, page: int, rep: int = 200):
    """(ms, FLOPs, error) of one prefill of ``n`` tokens over ``prefix`` cached ones."""
    n, prefix = max(2, n // DRY_SCALE), prefix // DRY_SCALE
    ms, _, err = checked_time(attn, (1, n, prefix + n, hq, hkv, d, page), d, rep)
    return ms, prefill_flops(n, prefix + n, hq, d), err


def time_decode(
    attn,
    batch: int,
    ctx: int,
    hq: int,
    hkv: int,
    d: int,
    page: int,
    rep: int = 200,
    kv_dtype: torch.dtype = torch.bfloat16,
):
    """(eager ms, graph ms, bytes, error) of one decode step of ``batch`` sequences at ``ctx``.

    The bytes are those the kernel reads and writes: K/V at ``kv_dtype``'s size
    (1 byte for fp8), q and out in bf16.
    """
    batch, ctx = max(1, batch // DRY_SCALE), max(1, ctx // DRY_SCALE)
    nbytes = decode_bytes(batch, ctx, hq, hkv, d, kv_dtype.itemsize, q_elt=2)
    case = (batch, 1, ctx, hq, hkv, d, page)
    eager, graph, err = checked_time(attn, case, d, rep, nbytes, kv_dtype)
    return eager, graph, nbytes, err


# ---------------------------------------------------------------- the default benchmarks


def bench_decode(kernels, args: argparse.Namespace, dtype: torch.dtype) -> None:
    """Decode attention at batch x context, fused vs reference."""
    meta, num_pages = paged_meta(args.batch, 1, args.context, args.page_size)
    hq, hkv, d = args.heads, args.kv_heads, args.head_size
    q = torch.randn(args.batch, hq, d, device="cuda", dtype=dtype)
    k_cache = torch.randn(num_pages, args.page_size, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    nbytes = decode_bytes(args.batch, args.context, hq, hkv, d, k_cache.element_size())
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
    """Causal prefill attention of one prompt (or chunk over ``--prefix`` cached tokens)."""
    n, prefix = args.prefill_len, args.prefix
    hq, hkv, d = args.heads, args.kv_heads, args.head_size
    q, k_cache, v_cache, meta = attention_inputs(
        1, n, prefix + n, hq, hkv, d, args.page_size, dtype
    )
    flops = prefill_flops(n, prefix + n, hq, d)
    name = f"prefill attn {n} tokens" + (f" over {prefix}" if prefix else "") + f" {hq}/{hkv}x{d}"
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


# ---------------------------------------------------------------- the issue-14 suite


# (tokens, cached prefix): fresh prompts, and chunks that continue from cached pages (the last
# two: the 32,000-token prompt's last 8,192-token chunk, and a 2,048-token chunk late in it)
SUITE_PREFILL = [(4096, 0), (16384, 0), (2048, 2048), (32000, 0), (8192, 23808), (2048, 29952)]
SUITE_DECODE = [(256, 512), (64, 2048), (1, 128), (8, 2048), (1, 4096), (1, 32768)]


def run_suite(args: argparse.Namespace, tiles: dict[str, Any]) -> None:
    """The attention figures of docs/benchmarks.md, 32/8 heads x 128, page 16, bf16, with the peers."""
    hq, hkv, d, page = args.heads, args.kv_heads, args.head_size, args.page_size
    pre = tiles.get("prefill")
    only = set(args.only or ["decode", "prefill"])
    for n, prefix in SUITE_PREFILL if "prefill" in only else []:
        attn = make_attention(torch.bfloat16, max(4096, n + prefix), prefill=pre)
        t = attn.prefill_tiles(d, hq // hkv, n)
        ms, flops, err = time_prefill(attn, n, prefix, hq, hkv, d, page)
        what = f"prefill {n}" + (f" over {prefix} cached" if prefix else "") + " causal"
        report(f"{what} {hq}/{hkv}x{d} fused {tuple(t)}", ms, flops=flops, tiles=list(t), err=err)
        if DEVICE == "cuda":  # the engine's cuDNN path (fused.cudnn_prefill), pages gathered
            from pitstop.plugins.kernels.cudnn_prefill import CudnnPrefill

            attn.long_prefill = CudnnPrefill(1)
            ms, flops, err = time_prefill(attn, n, prefix, hq, hkv, d, page)
            off = attn.long_prefill.disabled_reason
            report(f"{what} {hq}/{hkv}x{d} cudnn-prefill" + (f" OFF: {off}" if off else ""),
                   ms, flops=flops, err=err)  # fmt: skip
        if args.peer and n + prefix <= 32768 and DEVICE == "cuda":
            sdpa_peers(n, hq, hkv, d, flops, prefix)
    if "decode" in only:
        run_decode_suite(args, tiles, "bfloat16")


def run_decode_suite(args: argparse.Namespace, tiles: dict[str, Any], kv_cache_dtype: str) -> None:
    """The decode shapes of the suite with the KV cache in ``kv_cache_dtype`` (fp8: half the bytes)."""
    hq, hkv, d, page = args.heads, args.kv_heads, args.head_size, args.page_size
    kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    for batch, ctx in SUITE_DECODE:
        max_ctx = max(4096, ctx)
        attn = make_attention(
            torch.bfloat16, max_ctx, decode=tiles.get("decode"), splits=tiles.get("splits")
        )
        splits = attn.num_splits(batch, hkv)
        eager, graph, nbytes, err = time_decode(
            attn, batch, ctx, hq, hkv, d, page, kv_dtype=kv_dtype
        )
        t = tuple(attn.decode_tiles(d, hq // hkv))
        what = f"decode {batch}x{ctx} {hq}/{hkv}x{d} kv {kv_cache_dtype} fused {t} splits={splits}"
        extra = dict(tiles=list(t), splits=splits, kv_cache_dtype=kv_cache_dtype, bytes=nbytes)
        report(f"{what} graph", graph, nbytes, err=err, mode="graph", **extra)
        report(f"{what} eager", eager, nbytes, mode="eager", **extra)


def sdpa_peers(n: int, hq: int, hkv: int, d: int, flops: float, prefix: int = 0) -> None:
    """torch's attention on the same shape over contiguous K/V (what a cuDNN or FlashAttention
    path for prefill would run, issue 44): SDPA's FlashAttention-2 and cuDNN backends (K/V
    repeated per query head, and cuDNN with ``enable_gqa``), and ``varlen_attn`` where this
    torch has it. With a cached ``prefix`` the mask is causal aligned to the bottom right
    (the chunk's queries see every cached key), through ``causal_lower_right``."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, prefix + n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    mask: dict[str, Any] = {"is_causal": True}
    if prefix:
        from torch.nn.attention.bias import causal_lower_right

        mask = {"attn_mask": causal_lower_right(n, prefix + n)}
    what = f"{n}" + (f" over {prefix}" if prefix else "") + " causal (contiguous)"
    cases = [
        ("FLASH_ATTENTION", SDPBackend.FLASH_ATTENTION, kr, vr, {}),
        ("CUDNN_ATTENTION", SDPBackend.CUDNN_ATTENTION, kr, vr, {}),
        ("CUDNN_ATTENTION gqa", SDPBackend.CUDNN_ATTENTION, k, v, {"enable_gqa": True}),
    ]
    for name, backend, kk, vv, extra in cases:
        try:
            with sdpa_kernel(backend):
                ms = bench(lambda kk=kk, vv=vv, extra=extra: F.scaled_dot_product_attention(
                    q, kk, vv, **mask, **extra))  # fmt: skip
            report(f"  peer: torch SDPA {name} {what}", ms, flops=flops)
        except Exception as exc:  # a backend that this build or shape lacks
            print(f"  peer {name}: {type(exc).__name__}: {str(exc)[:120]}")
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        print("  peer varlen_attn: not in this torch")
        return
    qv, kv, vv = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # [T, H, D]
    cu_q = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, prefix + n], dtype=torch.int32, device="cuda")
    try:
        ms = bench(lambda: varlen_attn(
            qv, kv, vv, cu_q, cu_k, n, prefix + n, window_size=(-1, 0), enable_gqa=True))  # fmt: skip
        report(f"  peer: torch varlen_attn {what}", ms, flops=flops)
    except Exception as exc:  # an older signature, or a shape it refuses
        print(f"  peer varlen_attn: {type(exc).__name__}: {str(exc)[:120]}")


# ---------------------------------------------------------------- the tile sweep


PREFILL_CANDIDATES = [  # (block_m, block_n, num_warps, num_stages)
    (128, 64, 4, 3),
    (128, 64, 4, 2),
    (128, 64, 4, 4),
    (128, 32, 4, 3),
    (128, 128, 8, 3),
    (256, 64, 8, 2),
    (256, 64, 8, 3),
    (256, 32, 8, 3),
]
PREFILL_LENGTHS = (4096, 16384)  # the winner has the best mean rate over both
FOLLOW_CANDIDATES = [(128, 64, 4, 3), (128, 128, 8, 3)]  # for the other GQA ratios, head sizes
FOLLOW_HEADS = [(32, 32, 128), (16, 8, 128), (64, 8, 128), (32, 8, 64)]  # (Hq, Hkv, D)
DECODE_CANDIDATES = [(32, 1, 6), (16, 1, 6), (64, 4, 3), (64, 2, 4)]  # (block_n, warps, stages)
TUNE_DECODE_SHAPES = [(256, 512), (64, 2048), (8, 2048)]  # the winner: best worst of the first two
TUNE_SPLIT_SHAPES = [(1, 128), (1, 4096), (8, 2048)]
SPLIT_CANDIDATES = [1, 2, 4, 8, 16, 32, 64]


def tune_jobs(best_decode: tuple | None = None) -> list[tuple]:
    """The sweep as (kind, key, tiles, shape) jobs: prefill and decode tiles, then split counts."""
    from pitstop.plugins.kernels.triton_ops.paged_attention import DecodeTiles, PrefillTiles

    jobs: list[tuple] = []
    for c in PREFILL_CANDIDATES:
        for n in PREFILL_LENGTHS:
            jobs.append(("prefill", (128, 4), PrefillTiles(*c), (n, 0, 32, 8, 128, 16)))
    for c in FOLLOW_CANDIDATES:
        for hq, hkv, d in FOLLOW_HEADS:
            jobs.append(("prefill", (d, hq // hkv), PrefillTiles(*c), (4096, 0, hq, hkv, d, 16)))
    for page in (1, 64):
        tiles = PrefillTiles(*PREFILL_CANDIDATES[0])
        jobs.append(("prefill-page", (128, 4), tiles, (4096, 0, 32, 8, 128, page)))
    for c in DECODE_CANDIDATES:
        for batch, ctx in TUNE_DECODE_SHAPES:
            jobs.append(("decode", (128, 4), DecodeTiles(*c), (batch, ctx, 32, 8, 128, 16, None)))
    dec = DecodeTiles(*(best_decode or DECODE_CANDIDATES[0]))
    for batch, ctx in TUNE_SPLIT_SHAPES:  # past a short context's end, splits are empty
        for s in SPLIT_CANDIDATES:
            jobs.append(("split", (128, 4), dec, (batch, ctx, 32, 8, 128, 16, s)))
    return jobs


def run_job(job: tuple, rep: int) -> dict[str, Any] | None:
    """Time one sweep job; a tile shape that does not compile, run or match is reported, not fatal."""
    kind, key, tiles, shape = job
    try:
        if kind.startswith("prefill"):
            n, prefix, hq, hkv, d, page = shape
            attn = make_attention(torch.bfloat16, 4096, prefill=tiles)
            ms, flops, err = time_prefill(attn, n, prefix, hq, hkv, d, page, rep)
            name = f"tune {kind} {n} {hq}/{hkv}x{d} page {page} {tuple(tiles)}"
            extra: dict[str, Any] = {"flops": flops, "shape": [n, prefix]}
        else:
            batch, ctx, hq, hkv, d, page, splits = shape
            attn = make_attention(torch.bfloat16, max(4096, ctx), decode=tiles, splits=splits)
            used = attn.num_splits(batch, hkv)
            eager, ms, nbytes, err = time_decode(attn, batch, ctx, hq, hkv, d, page, rep)
            name = f"tune {kind} {batch}x{ctx} {tuple(tiles)} splits={used} graph"
            extra = {
                "nbytes": nbytes,
                "splits": used,
                "shape": [batch, ctx],
                "eager_us": eager * 1e3,
            }
    except Exception as exc:
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        print(f"tune {kind} {tuple(tiles)} {shape}: FAILED {msg}", flush=True)
        ROWS.append({"kind": kind, "tiles": list(tiles), "shape": list(shape), "failed": msg})
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return None
    if not err <= 2e-2:  # a wrong (or NaN) result never wins
        print(f"{name}: WRONG, relative error {err:.3g}", flush=True)
        ROWS.append({"kind": kind, "tiles": list(tiles), "shape": list(shape), "wrong": err})
        return None
    row = report(
        name,
        ms,
        extra.pop("nbytes", None),
        extra.pop("flops", None),
        kind=kind,
        key=list(key),
        tiles=list(tiles),
        err=round(err, 5),
        **extra,
    )
    return row


def compile_in_processes(
    jobs: int, flags: list[str] | None = None, timeout: float | None = None
) -> None:
    """Compile every sweep candidate in ``jobs`` processes first: the sweep then hits Triton's cache.

    ``flags``: the sweep's (default ``--tune``); ``timeout``: seconds after which the processes
    still compiling are stopped (what they left is compiled when first timed).
    """
    import time

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                *(flags or ["--tune"]),
                "--compile-only",
                f"--shard={i}/{jobs}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(jobs)
    ]
    end = None if timeout is None else time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(None if end is None else max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def best_by(rows: list[dict], kind: str, metric: str, group_key: Callable[[dict], Any]) -> dict:
    """The best row of ``kind`` for each group (highest ``metric``)."""
    best: dict[Any, dict] = {}
    for r in rows:
        if r.get("kind") != kind or metric not in r:
            continue
        g = group_key(r)
        if g not in best or r[metric] > best[g][metric]:
            best[g] = r
    return best


def run_tune(args: argparse.Namespace) -> dict[str, Any]:
    """The sweep; returns the winners (prefill per (head, group), decode tiles, splits per shape)."""
    if args.compile_only:  # one shard of the whole compile set, each job run once
        i, n = (int(x) for x in args.shard.split("/"))
        for job in tune_jobs()[i::n]:
            run_job(job, rep=1)
        return {}
    if args.jobs > 1 and DEVICE == "cuda":
        compile_in_processes(args.jobs)
    if args.warm_only:
        return {}
    for job in tune_jobs():
        if job[0] != "split":
            run_job(job, args.rep)
    # decode winner: the best worst-case fraction of copy over the two large shapes
    by_tiles: dict[tuple, list[float]] = {}
    for r in ROWS:
        if r.get("kind") == "decode" and "frac_copy" in r:
            by_tiles.setdefault(tuple(r["tiles"]), []).append(r["frac_copy"])
    complete = [t for t, v in by_tiles.items() if len(v) == len(TUNE_DECODE_SHAPES)]
    best_dec = max(complete, key=lambda t: (min(by_tiles[t][:2]), statistics.mean(by_tiles[t])))
    for job in tune_jobs(best_decode=best_dec):
        if job[0] == "split":
            run_job(job, args.rep)
    # prefill winner per (head size, group): the best mean rate over the lengths it was run at
    rates: dict[tuple, dict[tuple, list[float]]] = {}
    for r in ROWS:
        if r.get("kind") == "prefill" and "tflop_s" in r:
            rates.setdefault(tuple(r["key"]), {}).setdefault(tuple(r["tiles"]), []).append(
                r["tflop_s"]
            )
    prefill_best = {}
    for key, by in rates.items():
        runs = max(len(v) for v in by.values())
        full = {t: statistics.mean(v) for t, v in by.items() if len(v) == runs}
        best = max(full, key=lambda t: full[t])
        prefill_best[key] = {"tiles": list(best), "tflop_s": round(full[best], 1)}
    split_best = best_by(ROWS, "split", "frac_copy", lambda r: tuple(r["shape"]))
    winners = {
        "prefill": {f"{k[0]}/{k[1]}": r["tiles"] for k, r in sorted(prefill_best.items())},
        "decode": list(best_dec),
        "splits": {f"{k[0]}x{k[1]}": r["splits"] for k, r in sorted(split_best.items())},
    }
    print("\nwinners:", json.dumps(winners), flush=True)
    for k, r in sorted(prefill_best.items()):
        print(f"  prefill head {k[0]} group {k[1]}: {r['tiles']} {r['tflop_s']} TFLOP/s")
    for t, v in sorted(by_tiles.items(), key=lambda kv: -min(kv[1][:2])):
        print(f"  decode {t}: " + " ".join(f"{100 * x:.1f}%" for x in v))
    for k, r in sorted(split_best.items()):
        runs = [x for x in ROWS if x.get("kind") == "split" and tuple(x.get("shape", ())) == k]
        each = " ".join(f"{x['splits']}:{x['us']:.1f}" for x in runs)
        print(
            f"  splits {k[0]}x{k[1]}: best {r['splits']} ({100 * r['frac_copy']:.1f}%); us {each}"
        )
    return winners


# ---------------------------------------------------------------- the decode sweep (issue 29)


SWEEP_SHAPES = [(1, 4096), (8, 2048), (64, 2048), (256, 512), (1, 32768)]  # (batch, context)
SWEEP_KV = ("bfloat16", "fp8_e4m3")
SWEEP_SPLITS = [1, 2, 4, 8, 16, 32, 64, 128]
SWEEP_TILES = [(n, w, s) for n in (32, 64, 128) for w in (1, 2, 4) for s in (2, 3, 4)]
SWEEP_BUDGET_S = 130.0  # --sweep-budget's default: no candidate starts after it
SWEEP_COMPILE_SHARE = 0.55  # of the budget, at most, for the parallel compile (--jobs)
H200_SMS = 132  # the candidates' split counts off a GPU (tests, --dry-run)


class SweepConfig(NamedTuple):
    """One decode launch configuration of the sweep."""

    kv: str  # a KV_CACHE_DTYPES key
    tiles: tuple[int, int, int]  # DecodeTiles: block_n, warps, stages
    splits: int
    widen: str | None  # PagedAttention's fp8_widen; None for a bf16 cache (it changes nothing)
    merge: str = "separate"  # PagedAttention's decode_merge (changes nothing at one split)


def sweep_shapes(text: str) -> list[tuple[int, int]]:
    """``--sweep-shapes``: ``"256x1024,128x2048"`` -> ``[(256, 1024), (128, 2048)]``."""
    shapes = []
    for item in text.split(","):
        batch, sep, ctx = item.strip().lower().partition("x")
        if not sep or not batch.isdigit() or not ctx.isdigit() or int(batch) < 1 or int(ctx) < 1:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not BATCHxCONTEXT with two positive integers (e.g. 256x1024)"
            )
        shapes.append((int(batch), int(ctx)))
    return shapes


def sweep_candidates(
    kv: str, batch: int, ctx: int, hq: int, hkv: int, d: int, num_sms: int
) -> list[tuple[str, SweepConfig]]:
    """The sweep's (stage, config) list for one shape, the engine's config first.

    Stages: ``current`` (the tiles in code, ``num_splits()``, the default widening; for fp8
    also ``fp8_widen="query"``, the widening before issue 29), ``splits`` (the tiles in code,
    every split count of SWEEP_SPLITS, for fp8 with every widening), ``merge`` (the tiles in
    code, ``decode_merge="last-program"`` at every split count of SWEEP_SPLITS but 1, the default
    widening), ``tiles`` (every tile shape of SWEEP_TILES at the engine's split count, the
    default widening). The run adds a ``best`` stage: the best tiles at the best split count
    (both with the separate merge), where that pair was not timed.
    """
    from pitstop.plugins.kernels.triton_ops.paged_attention import (
        FP8_WIDEN,
        PagedAttention,
        decode_tiles,
    )

    engine = PagedAttention(torch.device("cuda"), torch.bfloat16, max(4096, ctx), num_sms=num_sms)
    tiles = tuple(decode_tiles(d, hq // hkv, torch.bfloat16))
    splits = engine.num_splits(batch, hkv)
    widens: tuple[str | None, ...] = (None,) if kv == "bfloat16" else FP8_WIDEN
    out = [("current", SweepConfig(kv, tiles, splits, w)) for w in widens]
    for w in widens:
        out += [("splits", SweepConfig(kv, tiles, s, w)) for s in SWEEP_SPLITS if s != splits]
    last = [SweepConfig(kv, tiles, s, widens[0], "last-program") for s in SWEEP_SPLITS if s > 1]
    out += [("merge", cfg) for cfg in last]
    out += [("tiles", SweepConfig(kv, t, splits, widens[0])) for t in SWEEP_TILES if t != tiles]
    return out


def sweep_plan(args: argparse.Namespace, num_sms: int) -> dict[tuple[str, int, int], list]:
    """``sweep_candidates`` of every (KV dtype, batch, context) of the sweep."""
    hq, hkv, d = args.heads, args.kv_heads, args.head_size
    return {
        (kv, b, c): sweep_candidates(kv, b, c, hq, hkv, d, num_sms)
        for kv in SWEEP_KV
        for b, c in (args.sweep_shapes or SWEEP_SHAPES)
    }


def sweep_compile_set(plan: dict[tuple[str, int, int], list]) -> list[SweepConfig]:
    """The distinct compiled variants of a plan (the shape does not change the kernel)."""
    return sorted({cfg for cands in plan.values() for _, cfg in cands}, key=repr)


def sweep_attention(cfg: SweepConfig, max_context: int):
    """A PagedAttention launching ``cfg`` whatever the batch size."""
    from pitstop.plugins.kernels.triton_ops.paged_attention import DecodeTiles

    return make_attention(
        torch.bfloat16,
        max_context,
        decode=DecodeTiles(*cfg.tiles),
        splits=cfg.splits,
        fp8_widen=cfg.widen or "fp16",
        decode_merge=cfg.merge,
    )


class SweepInputs(NamedTuple):
    """One shape's inputs: enough copies for a graph replay to read ~512 MB, the reference output."""

    copies: list[tuple]
    nbytes: float
    ref: torch.Tensor


def sweep_inputs(kv: str, batch: int, ctx: int, args: argparse.Namespace) -> SweepInputs:
    """Seeded inputs of one (KV dtype, shape); fp8 caches with non-unit scales."""
    hq, hkv, d, page = args.heads, args.kv_heads, args.head_size, args.page_size
    batch, ctx = max(1, batch // DRY_SCALE), max(1, ctx // DRY_SCALE)  # --dry-run only
    kv_dtype = KV_CACHE_DTYPES[kv]
    nbytes = decode_bytes(batch, ctx, hq, hkv, d, kv_dtype.itemsize, q_elt=2)
    copies = 2 if DEVICE != "cuda" else max(2, min(512, -(-int(512e6) // int(nbytes))))
    torch.manual_seed(batch * 100003 + ctx)
    scales = torch.tensor([0.05, 0.02] if kv_dtype.itemsize == 1 else [1.0, 1.0], device=DEVICE)
    made = []
    for _ in range(copies):
        q, k, v, meta = attention_inputs(batch, 1, ctx, hq, hkv, d, page, torch.bfloat16)
        if kv_dtype.itemsize == 1:
            k, v = (
                reference.quantize_kv(c * s, s, kv_dtype)
                for c, s in zip((k, v), scales, strict=True)
            )
        made.append((q, k, v, meta, d**-0.5, scales))
    ref = reference.paged_attention(*made[0])
    return SweepInputs(made, nbytes, ref)


def time_sweep_config(
    stage: str, cfg: SweepConfig, batch: int, ctx: int, inputs: SweepInputs
) -> dict[str, Any]:
    """Check ``cfg`` against the reference, then time it from a CUDA graph; the row (not printed)."""
    row: dict[str, Any] = {
        "kind": "decode-sweep",
        "stage": stage,
        "kv_cache_dtype": cfg.kv,
        "shape": [batch, ctx],
        "tiles": list(cfg.tiles),
        "splits": cfg.splits,
        "widen": cfg.widen,
        "merge": cfg.merge,
    }
    attn = sweep_attention(cfg, max(4096, ctx))
    try:
        out = attn(*inputs.copies[0])
        ref = inputs.ref.float()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        if not err <= 2e-2:  # a wrong (or NaN) result never wins
            row["wrong"] = err
            return row
        ms = graph_ms([lambda x=x: attn(*x) for x in inputs.copies])
        if attn.decode_counters is not None:  # last-program: every replay left them at zero
            left = int(attn.decode_counters.count_nonzero())
            if left:
                row["wrong"] = f"{left} arrival counters non-zero after the replays"
                return row
    except Exception as exc:  # a tile shape that does not compile or launch (shared memory)
        row["failed"] = (
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        )
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return row
    bw = inputs.nbytes / (ms * 1e-3)
    row.update(
        name=f"sweep {cfg.kv} {batch}x{ctx} {cfg.tiles} splits={cfg.splits} widen={cfg.widen}"
        + (f" merge={cfg.merge}" if cfg.merge != "separate" else ""),
        us=round(ms * 1e3, 2),
        tb_s=round(bw / 1e12, 3),
        frac_copy=round(bw / COPY_BW, 4),
        err=round(err, 5),
        nbytes=inputs.nbytes,
    )
    return row


def sweep_best(rows: list[dict[str, Any]]) -> dict[tuple[str, int, int], dict[str, Any]]:
    """The fastest correct row of each (KV dtype, batch, context)."""
    best: dict[tuple[str, int, int], dict[str, Any]] = {}
    for r in rows:
        if r.get("kind") != "decode-sweep" or "frac_copy" not in r:
            continue
        key = (r["kv_cache_dtype"], *r["shape"])
        if key not in best or r["us"] < best[key]["us"]:  # the same bytes within a shape
            best[key] = r
    return best


def best_pair_config(key: tuple[str, int, int], rows: list[dict[str, Any]]) -> SweepConfig | None:
    """The ``best`` stage's config of one shape: the best tiles at the best split count (each
    the fastest of its stage, the default widening), None where that pair was timed already."""
    mine = [
        r
        for r in rows
        if r.get("kind") == "decode-sweep"
        and (r["kv_cache_dtype"], *r["shape"]) == key
        and r["widen"] in (None, "fp16")
        and r.get("merge", "separate") == "separate"
        and "frac_copy" in r
    ]
    by_stage = {
        s: min((r for r in mine if r["stage"] in (s, "current")), key=lambda r: r["us"])
        for s in ("splits", "tiles")
        if any(r["stage"] in (s, "current") for r in mine)
    }
    if len(by_stage) < 2:
        return None
    widen = None if key[0] == "bfloat16" else "fp16"
    cfg = SweepConfig(
        key[0], tuple(by_stage["tiles"]["tiles"]), by_stage["splits"]["splits"], widen
    )
    timed = {(tuple(r["tiles"]), r["splits"]) for r in mine}
    return None if (cfg.tiles, cfg.splits) in timed else cfg


def sweep_table(rows: list[dict[str, Any]], top: int = 3) -> str:
    """The compact summary: per shape the best config first, then the engine's, then the runners-up."""

    def cfg(r: dict[str, Any]) -> str:
        w = f" {r['widen']}" if r.get("widen") else ""
        w += " last-program" if r.get("merge", "separate") != "separate" else ""
        return (
            f"{100 * r['frac_copy']:5.1f}% {r['us']:8.1f}us {tuple(r['tiles'])} s={r['splits']}{w}"
        )

    best = sweep_best(rows)
    lines = ["decode sweep (CUDA graph; % of copy bandwidth, fp8 at 1 byte/element):"]

    def order(k: tuple[str, int, int]) -> tuple:
        kv, shape = k[0], tuple(k[1:])
        known = SWEEP_KV.index(kv) if kv in SWEEP_KV else len(SWEEP_KV)
        return known, SWEEP_SHAPES.index(shape) if shape in SWEEP_SHAPES else len(SWEEP_SHAPES), k

    for key in sorted(best, key=order):
        kv, b, c = key
        mine = sorted(
            (
                r
                for r in rows
                if r.get("kind") == "decode-sweep"
                and (r["kv_cache_dtype"], *r["shape"]) == key
                and "frac_copy" in r
            ),
            key=lambda r: r["us"],
        )
        current = [r for r in mine if r["stage"] == "current"]
        lines.append(f"{kv:<9} {b:>3}x{c:<6} best {cfg(mine[0])} [{mine[0]['stage']}]")
        for r in current:
            lines.append(f"{'':<17}now  {cfg(r)}")
        for r in [r for r in mine[1:] if r["stage"] != "current"][:top]:
            lines.append(f"{'':<17}next {cfg(r)} [{r['stage']}]")
        by_merge = {}  # the fastest of each merge (separate, last-program), any stage
        for r in mine:
            by_merge.setdefault(r.get("merge", "separate"), r)
        if len(by_merge) > 1:
            each = "; ".join(f"{m} {cfg(r)}" for m, r in sorted(by_merge.items()))
            lines.append(f"{'':<17}merge {each}")
        bad = [r for r in rows if (r.get("kv_cache_dtype"), *r.get("shape", ())) == key]
        n_bad = sum(1 for r in bad if "failed" in r or "wrong" in r)
        if n_bad:
            lines.append(f"{'':<17}({n_bad} configs failed to compile/launch or were wrong)")
    return "\n".join(lines)


def run_decode_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """The issue-29 sweep: every stage of ``sweep_candidates`` over SWEEP_KV x SWEEP_SHAPES.

    Stages run in order over all shapes (current, splits, merge, tiles, best), so a run cut short by
    ``--sweep-budget`` loses the least useful candidates. Returns the best config per shape.
    """
    import time

    t0 = time.monotonic()
    budget = args.sweep_budget
    num_sms = (
        torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else H200_SMS
    )
    plan = sweep_plan(args, num_sms)
    if args.compile_only:  # one shard of the compile set, each variant launched once, tiny
        i, n = (int(x) for x in args.shard.split("/"))
        hq, hkv, d, page = args.heads, args.kv_heads, args.head_size, args.page_size
        for cfg in sweep_compile_set(plan)[i::n]:
            inp = attention_inputs(
                1, 1, 64, hq, hkv, d, page, torch.bfloat16, KV_CACHE_DTYPES[cfg.kv]
            )
            try:
                sweep_attention(cfg, 4096)(*inp, d**-0.5, torch.ones(2, device=DEVICE))
            except Exception:  # reported by the timed run
                pass
        return {}
    if args.jobs > 1 and DEVICE == "cuda":
        flags = ["--decode-sweep", "--heads", str(args.heads), "--kv-heads", str(args.kv_heads)]
        flags += ["--head-size", str(args.head_size), "--page-size", str(args.page_size)]
        if args.sweep_shapes:  # the split counts (so the compiled set) follow the batch sizes
            flags += ["--sweep-shapes", ",".join(f"{b}x{c}" for b, c in args.sweep_shapes)]
        compile_in_processes(args.jobs, flags, timeout=SWEEP_COMPILE_SHARE * budget)
        print(f"compiled in {time.monotonic() - t0:.0f} s ({args.jobs} processes)", flush=True)
    inputs = {key: sweep_inputs(*key, args) for key in plan}
    rows: list[dict[str, Any]] = []
    skipped = 0

    def run(stage: str, cfg: SweepConfig, key: tuple[str, int, int]) -> None:
        nonlocal skipped
        if time.monotonic() - t0 > budget:
            skipped += 1
            return
        row = time_sweep_config(stage, cfg, key[1], key[2], inputs[key])
        rows.append(row)
        ROWS.append(row)
        if args.verbose and "frac_copy" in row:
            print(f"{row['name']:<64} {row['us']:9.1f} us {100 * row['frac_copy']:5.1f}%")
        save_json()

    for stage in ("current", "splits", "merge", "tiles"):
        for key, cands in plan.items():
            for s, cfg in cands:
                if s == stage:
                    run(stage, cfg, key)
        print(f"stage {stage} done at {time.monotonic() - t0:.0f} s", flush=True)
    for key in plan:
        cfg = best_pair_config(key, rows)
        if cfg is not None:
            run("best", cfg, key)
    if skipped:
        print(f"--sweep-budget {budget:.0f} s reached: {skipped} candidates not timed")
    print(sweep_table(rows), flush=True)
    print(f"sweep took {time.monotonic() - t0:.0f} s", flush=True)
    best = sweep_best(rows)
    return {
        f"{k[0]} {k[1]}x{k[2]}": {
            "tiles": r["tiles"],
            "splits": r["splits"],
            "widen": r["widen"],
            "merge": r.get("merge", "separate"),
            "frac_copy": r["frac_copy"],
        }
        for k, r in best.items()
    }


def main() -> None:
    """Parse flags, build the fused kernel set, run the chosen benchmarks."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--only", choices=["decode", "prefill", "norm"], action="append")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--prefix", type=int, default=0, help="cached tokens before the prefill chunk")
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
    p.add_argument(
        "--suite", action="store_true", help="the attention shapes of docs/benchmarks.md"
    )
    p.add_argument("--peer", action="store_true", help="with --suite: torch SDPA beside prefill")
    p.add_argument(
        "--decode-suite",
        choices=sorted(KV_CACHE_DTYPES),
        action="append",
        metavar="KV_CACHE_DTYPE",
        help="the suite's decode shapes with the KV cache in this dtype (repeatable: "
        "bfloat16, fp8_e4m3, fp8_e5m2); bytes counted at the cache's element size",
    )
    p.add_argument(
        "--decode-tiles",
        action="append",
        metavar="BLOCK_N,WARPS,STAGES",
        help="with --decode-suite: also run it with these decode tiles (repeatable; "
        "default: only the tiles in code)",
    )
    p.add_argument("--tune", action="store_true", help="sweep tile shapes and split counts")
    p.add_argument(
        "--decode-sweep",
        action="store_true",
        help="issue 29: decode configs (split counts, tiles, fp8 widenings) over bf16 and fp8_e4m3 "
        "caches at 1x4096, 8x2048, 64x2048, 256x512, 1x32768, from CUDA graphs; best per shape",
    )
    p.add_argument(
        "--sweep-budget",
        type=float,
        default=SWEEP_BUDGET_S,
        metavar="SECONDS",
        help="with --decode-sweep: start no candidate after this many seconds",
    )
    p.add_argument(
        "--sweep-shapes",
        type=sweep_shapes,
        metavar="BxC,...",
        help="with --decode-sweep: these (batch x context) shapes instead of "
        + ",".join(f"{b}x{c}" for b, c in SWEEP_SHAPES),
    )
    p.add_argument("--verbose", action="store_true", help="with --decode-sweep: every config")
    p.add_argument("--jobs", type=int, default=1, help="with --tune: compile in N processes first")
    p.add_argument("--rep", type=int, default=100, help="with --tune: ms of timed runs per shape")
    p.add_argument("--warm-only", action="store_true", help="with --tune --jobs: only compile")
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    p.add_argument(
        "--use-winners", action="store_true", help="--tune then --suite with the winners"
    )
    p.add_argument("--json", help="write every measured line (and the winners) to this file")
    p.add_argument("--commit", default=os.environ.get("PITSTOP_COMMIT", "unknown"))
    p.add_argument("--dry-run", type=int, metavar="SCALE", help=argparse.SUPPRESS)
    args = p.parse_args()
    global COMPILE_ONLY
    COMPILE_ONLY = args.compile_only
    if args.dry_run:
        global DEVICE, DRY_SCALE
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
        DEVICE, DRY_SCALE = "cpu", args.dry_run
    elif not torch.cuda.is_available():
        raise SystemExit("kernels_bench needs a CUDA device")
    import triton

    from pitstop.plugin_system.plugin_manager import get_plugin_manager

    header = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "commit": args.commit,
    }
    if not args.compile_only:
        print(json.dumps(header), flush=True)
        if args.json:
            JSON_OUT.update(path=args.json, header=header)
    dtype = torch.bfloat16
    winners: dict[str, Any] = {}
    with torch.inference_mode():
        if args.decode_sweep:
            winners["decode_sweep"] = run_decode_sweep(args)
            if args.compile_only:
                return
            save_json(winners)
        if args.tune:
            winners.update(run_tune(args))
            if args.compile_only or args.warm_only:
                return
            save_json(winners)
        if args.suite or args.use_winners:
            tiles: dict[str, Any] = {}
            if args.use_winners and "prefill" in winners:
                from pitstop.plugins.kernels.triton_ops.paged_attention import (
                    DecodeTiles,
                    PrefillTiles,
                )

                key = f"{args.head_size}/{args.heads // args.kv_heads}"
                tiles["prefill"] = PrefillTiles(*winners["prefill"][key])
                tiles["decode"] = DecodeTiles(*winners["decode"])
            print("\nsuite:", flush=True)
            run_suite(args, tiles)
        if args.decode_suite:
            from pitstop.plugins.kernels.triton_ops.paged_attention import DecodeTiles

            variants: list[dict[str, Any]] = [{}] + [
                {"decode": DecodeTiles(*(int(x) for x in t.split(",")))}
                for t in args.decode_tiles or []
            ]
            for kv_cache_dtype in args.decode_suite:
                for tiles in variants:
                    which = f"tiles {tuple(tiles['decode'])}" if tiles else "the tiles in code"
                    print(f"\ndecode suite, KV cache {kv_cache_dtype}, {which}:", flush=True)
                    run_decode_suite(args, tiles, kv_cache_dtype)
        if not (
            args.tune or args.suite or args.use_winners or args.decode_suite or args.decode_sweep
        ):
            config = engine_config(max_model_len=args.max_model_len, fused_precision=args.precision)
            kernels = get_plugin_manager().create(
                "kernels", "fused", config, torch.device("cuda"), dtype
            )
            print(f"{torch.cuda.get_device_name()}; {kernels.describe()}")
            only = set(args.only or ["decode", "prefill", "norm"])
            if "decode" in only:
                bench_decode(kernels, args, dtype)
            if "prefill" in only:
                bench_prefill(kernels, args, dtype)
            if "norm" in only:
                bench_norm_silu(kernels, args, dtype)


if __name__ == "__main__":
    main()
