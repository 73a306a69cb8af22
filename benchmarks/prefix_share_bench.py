"""Decode attention with and without the shared-prefix pass (``fused.decode_prefix_share``).

One decode step's attention over a paged bf16 cache at ``qwen3-8b``'s heads (32 query, 8 KV,
head size 128, page 16), for groups of decodes that share a cached prefix (the ``prefix``
workload: 4 system prompts of 1,024 tokens, 32 clients), each row timed as the replay of a
CUDA graph (``tuning.cold_median_ms``, median, a 256 MB read before each run) of
``--layers`` calls (a step's layers; the groups are made at the first), per layer; the grouping kernel is also timed alone. Bytes are the K/V the step
must read: the plain decode reads every sequence's whole context, the shared pass each group's
prefix once; the rate is each row's own bytes over its time.

Usage::

    python benchmarks/prefix_share_bench.py                  # the prefix workload's shapes
    python benchmarks/prefix_share_bench.py --groups 1 --members 16 --shared 2048 --own 128
"""

from __future__ import annotations

import argparse
import sys

import torch


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--groups", type=int, action="append", help="default 4 and 1")
    p.add_argument("--members", type=int, default=8, help="decodes a group (default 8)")
    p.add_argument("--shared", type=int, default=1024, help="shared prefix tokens (1,024)")
    p.add_argument("--own", type=int, action="append", help="own tokens each (default 256, 1024)")
    p.add_argument("--min-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=8,
                   help="attention calls a step (graph); the groups are made once a step")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    args = parse(argv)
    from pitstop.ground.attention import AttentionMetadata
    from pitstop.plugins.kernels.triton_ops.paged_attention import PagedAttention
    from pitstop.plugins.kernels.triton_ops.tuning import cold_median_ms

    dev, dtype = torch.device("cuda"), torch.bfloat16
    hq, hkv, d, ps = 32, 8, 128, 16
    rows: list[dict[str, object]] = []
    print(f"decode attention, {hq}/{hkv} heads x {d}, page {ps}, bf16, one layer, CUDA graph")
    print(f"{'groups':>6} {'members':>7} {'shared':>6} {'own':>5} {'plain us':>9} {'share us':>9} "
          f"{'speedup':>7} {'plain GB/s':>10} {'share GB/s':>10}")  # fmt: skip
    for groups in args.groups or [4, 1]:
        for own in args.own or [256, 1024]:
            n = groups * args.members
            shared_pages, own_pages = args.shared // ps, -(-(own + 1) // ps)
            tables, ctxs, next_page = [], [], 0
            for _ in range(groups):
                common = list(range(next_page, next_page + shared_pages))
                next_page += shared_pages
                for _ in range(args.members):
                    tables.append(common + list(range(next_page, next_page + own_pages)))
                    next_page += own_pages
                    ctxs.append(args.shared + own + 1)
            perm = torch.randperm(next_page).tolist()
            width = max(len(t) for t in tables) + 1
            table = torch.tensor(
                [[perm[p] for p in t] + [-1] * (width - len(t)) for t in tables],
                dtype=torch.int32, device=dev,
            )  # fmt: skip
            meta = AttentionMetadata(
                positions=torch.tensor(ctxs, device=dev) - 1,
                slot_mapping=torch.zeros(n, dtype=torch.int64, device=dev),
                block_tables=table,
                context_lens=torch.tensor(ctxs, dtype=torch.int32, device=dev),
                cu_query_lens=torch.arange(n + 1, dtype=torch.int32, device=dev),
                num_prefills=0,
                num_prefill_tokens=0,
                num_decodes=n,
                max_query_len=1,
                max_context_len=max(ctxs),
                page_size=ps,
            )
            # each layer its own K/V (as a model's), so that no layer finds another's in L2
            kvs = [(torch.randn(next_page, ps, hkv, d, device=dev, dtype=dtype),
                    torch.randn(next_page, ps, hkv, d, device=dev, dtype=dtype))
                   for _ in range(args.layers)]  # fmt: skip
            k, v = kvs[0]
            q = torch.randn(n, hq, d, device=dev, dtype=dtype)
            times, outs = {}, {}
            for name, tokens in (("plain", 0), ("share", args.min_tokens)):
                attn = PagedAttention(dev, dtype, 4096, prefix_share_tokens=tokens)
                outs[name] = attn(q, k, v, meta, d**-0.5)  # compile outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for k_l, v_l in kvs:
                        attn(q, k_l, v_l, meta, d**-0.5)
                step = cold_median_ms(graph.replay, warmup=20, rep=200) * 1e-3
                times[name] = step / args.layers
            from pitstop.plugins.kernels.triton_ops import prefix_share

            layout_args = (table, meta.context_lens, 0, n, ps, args.min_tokens, 16, 64, 8)
            prefix_share.group_decodes(*layout_args)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                prefix_share.group_decodes(*layout_args)
            grouping = cold_median_ms(graph.replay, warmup=20, rep=200) * 1e-3
            diff = (outs["share"].float() - outs["plain"].float()).abs().max().item()
            token_bytes = 2 * hkv * d * 2
            plain_bytes = sum(ctxs) * token_bytes
            share_bytes = (groups * args.shared + n * (own + 1)) * token_bytes
            row = dict(groups=groups, members=args.members, shared=args.shared, own=own,
                       plain_us=times["plain"] * 1e6, share_us=times["share"] * 1e6,
                       speedup=times["plain"] / times["share"], max_diff=diff,
                       grouping_us=grouping * 1e6,
                       plain_gbps=plain_bytes / times["plain"] / 1e9,
                       share_gbps=share_bytes / times["share"] / 1e9)  # fmt: skip
            rows.append(row)
            print(f"{groups:>6} {args.members:>7} {args.shared:>6} {own:>5} "
                  f"{row['plain_us']:9.1f} {row['share_us']:9.1f} {row['speedup']:6.2f}x "
                  f"{row['plain_gbps']:10.0f} {row['share_gbps']:10.0f}   diff {diff:.2g}, "
                  f"grouping {grouping * 1e6:.1f} us a step")  # fmt: skip
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
