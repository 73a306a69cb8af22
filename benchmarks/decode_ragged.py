"""Decode attention over ragged contexts: does the kernel lose bandwidth to imbalance?

    python benchmarks/decode_ragged.py [--batch 256] [--low 100] [--high 2048] [--splits 1 2 4]
                                       [--json OUT]

`nano` decodes 256 sequences whose contexts spread from about 100 to 2,048 tokens, and its
decode steps spend about three quarters of their kernel time in attention. With one
program per (sequence, KV head) and every program resident at once, a program's work is its
sequence's context, so the kernel lasts as long as the most loaded SMs take. This times the
engine's decode kernel (qwen3-0.6b's heads: 16 query, 8 KV, head size 128, pages of 16)
from CUDA graphs on:

- ``uniform``: every sequence at the mean context of the ragged batch (the same bytes);
- ``ragged``: contexts uniform in ``[--low, --high]``, in random order;
- ``ragged-sorted``: the same contexts, longest first (the order the block scheduler
  takes programs in);

over a bf16 and an e4m3 cache (``--kv``), each at the engine's split count, at each
``--splits`` forced and with contexts cut into pieces of each ``--split-tokens``
(``fused.decode_split_tokens``), with the bytes read (fp8 at one byte an element) over
the measured device-to-device copy rate. Every configuration is checked against the
reference first. Where ``ragged`` reads its bytes markedly slower than ``uniform``, the
kernel's work per program is unbalanced and a split by tokens (not by batch size) would pay.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

import torch

from pitstop.bench.floor import measure_ceilings
from pitstop.plugins.kernels import reference
from pitstop.plugins.kernels.triton_ops.paged_attention import PagedAttention
from pitstop.testing.kernels import paged_metadata
from pitstop.testing.timing import graph_seconds

HEADS, KV_HEADS, HEAD_SIZE, PAGE = 16, 8, 128, 16


KV_DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}


def inputs(contexts: list[int], device: str, kv: str = "bf16") -> tuple:
    """``(q, k_cache, v_cache, meta, kv_scale)`` of one decode step over ``contexts``; an
    ``e4m3`` cache holds the random values quantized with scales 0.05 (K) and 0.02 (V),
    ``kv_scale`` None for bf16."""
    pages = sum(-(-c // PAGE) for c in contexts)
    meta = paged_metadata(
        [1] * len(contexts), contexts, PAGE, pages, seed=len(contexts), device=device
    )
    q = torch.randn(len(contexts), HEADS, HEAD_SIZE, device=device, dtype=torch.bfloat16)
    k = torch.randn(pages, PAGE, KV_HEADS, HEAD_SIZE, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if kv == "bf16":
        return q, k, v, meta, None
    scales = torch.tensor([0.05, 0.02], device=device)
    k, v = (
        reference.quantize_kv(c * s, s, KV_DTYPES[kv]) for c, s in zip((k, v), scales, strict=True)
    )
    return q, k, v, meta, scales


def step_bytes(contexts: list[int], kv: str = "bf16") -> float:
    """What one step reads and writes: each K and V token once per KV head (one byte an
    element in fp8), q and out in bf16."""
    batch, elt = len(contexts), KV_DTYPES[kv].itemsize
    return 2 * sum(contexts) * KV_HEADS * HEAD_SIZE * elt + 2 * batch * HEADS * HEAD_SIZE * 2


def graph_us(attn: PagedAttention, made: list[tuple]) -> float:
    """Median µs a call of ``attn`` over the copies in ``made``, replayed from one CUDA graph
    (each copy its own buffers: a replay reads far more than the L2 holds)."""
    scale = HEAD_SIZE**-0.5
    return 1e6 * graph_seconds([lambda x=x: attn(*x[:4], scale, x[4]) for x in made])


def layouts(batch: int, low: int, high: int, seed: int) -> dict[str, list[int]]:
    """The three batches: ragged (random order), the same sorted longest first, and uniform
    at the ragged batch's mean context."""
    rng = random.Random(seed)
    ragged = [rng.randint(low, high) for _ in range(batch)]
    mean = round(sum(ragged) / batch)
    return {
        "uniform": [mean] * batch,
        "ragged": ragged,
        "ragged-sorted": sorted(ragged, reverse=True),
    }


def main() -> None:
    """Time each layout at each split count; print a table, optionally save the rows."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--low", type=int, default=100)
    p.add_argument("--high", type=int, default=2048)
    p.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4])
    p.add_argument(
        "--split-tokens", type=int, nargs="*", default=[256, 512, 1024],
        help="also time fused.decode_split_tokens at each of these lengths",
    )  # fmt: skip
    p.add_argument("--kv", nargs="*", default=["bf16", "e4m3"], choices=sorted(KV_DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_ragged.py times CUDA graphs: it needs a CUDA device")
    device = "cuda"
    rate = measure_ceilings(device).copy_bytes_per_s  # the bench's own copy measurement
    print(f"device {torch.cuda.get_device_name()}; copy {rate / 1e12:.3f} TB/s")
    print("| cache | batch | split | us | bytes read at | of copy | max error |")
    print("|---|---|---|---|---|---|---|")
    rows: list[dict[str, Any]] = []
    cases = [
        (kv, name, contexts)
        for kv in args.kv
        for name, contexts in layouts(args.batch, args.low, args.high, args.seed).items()
    ]
    for kv, name, contexts in cases:
        torch.manual_seed(args.seed)
        nbytes = step_bytes(contexts, kv)
        copies = max(2, min(64, -(-int(512e6) // int(nbytes))))
        made = [inputs(contexts, device, kv) for _ in range(copies)]
        q, k, v, meta, kv_scale = made[0]
        truth = reference.paged_attention(q, k, v, meta, HEAD_SIZE**-0.5, kv_scale).float()
        # one untimed pass over the fresh inputs first: on an H100 (2026-12-07, fdc2797) the
        # first configuration timed after a case's inputs were made ran 9-17% longer than
        # the very same launch timed next
        graph_us(PagedAttention(torch.device(device), torch.bfloat16, max(4096, args.high)), made)
        runs = [(None, 0)] + [(s, 0) for s in args.splits] + [(None, t) for t in args.split_tokens]
        for splits, tokens in runs:
            attn = PagedAttention(
                torch.device(device), torch.bfloat16, max(4096, args.high), split_tokens=tokens
            )
            chosen = attn.num_splits(len(contexts), KV_HEADS)
            if splits is not None:
                attn.num_splits = lambda n, h, s=splits: s  # type: ignore[method-assign]
            out = attn(q, k, v, meta, HEAD_SIZE**-0.5, kv_scale).float()
            err = ((out - truth).abs().max() / truth.abs().max()).item()
            us = graph_us(attn, made) if err <= 2e-2 else float("nan")
            row = {
                "cache": kv,
                "batch": name,
                "contexts": [min(contexts), max(contexts), sum(contexts)],
                "splits": (
                    splits
                    if splits is not None
                    else f"pieces of {tokens} tokens"
                    if tokens
                    else f"engine ({chosen})"
                ),  # fmt: skip
                "us": round(us, 2),
                "tb_s": round(nbytes / (us * 1e-6) / 1e12, 3),
                "of_copy": round(nbytes / (us * 1e-6) / rate, 4),
                "err": round(err, 5),
            }
            rows.append(row)
            if args.json:  # after every row: a run cut by a time limit keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"copy_bytes_per_s": rate, "rows": rows, "args": vars(args)}, f)
            print(
                f"| {kv} | {name} | {row['splits']} | {row['us']} | {row['tb_s']} TB/s "
                f"| {100 * row['of_copy']:.1f}% | {err:.2g} |"
            )


if __name__ == "__main__":
    main()
