"""The fp8 weight format's GEMMs at decode's shapes on the GPU, against bf16 (issue 33).

For each linear of the ``llama3-8b`` shape (qkv, o, gate+up, down) and each
batch of rows, the time of one linear with L2-cold weights: every timed launch
reads a different copy of the weight (copies worth 512 MB, replayed from a CUDA
graph so that launch gaps do not count), as the layers of a model do. Columns:
bf16 ``F.linear`` (cuBLAS); ``torch._scaled_mm`` after the one-launch Triton
quantization; the skinny weight-only Triton kernel at the tile ``skinny_tiles``
picks and, with ``--sweep``, at each tile of a grid (the best is printed). Each
time is also a fraction of the copy bandwidth (4.23 TB/s) for the weight bytes it
reads. ``--best-tiles FILE`` writes the tiles whose time summed over the four
linears is least (one row's; the largest batch's), as an ``fp8.skinny_tiles`` value.

    python benchmarks/fp8_gemm_bench.py [--sweep] [--rows 1,4,16] [--json OUT.json] [--best-tiles F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import attrs
import torch
import torch.nn.functional as F

COPY_BYTES_PER_S = 4.23e12  # the H200's measured device copy (docs/workloads.md)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROTATE_BYTES = 512 * 2**20
REPLAYS = 10


def time_per_call(fns: list) -> float:
    """Seconds per call of ``fns`` (one per weight copy), replayed in a CUDA graph."""
    for fn in fns:  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (REPLAYS * len(fns))


def _best_tiles(summed: dict, rows_list: list[int]) -> str:
    """The ``fp8.skinny_tiles`` value of the least summed times (one row; the largest batch)."""

    def best(rows: int) -> str:
        times = {t: sec for (r, t), sec in summed.items() if r == rows}
        if not times:
            return "auto"
        t = min(times, key=times.get)
        return f"{t.block_n},{t.block_k},{t.num_warps},{t.num_stages}"

    several = max((r for r in rows_list if 1 < r <= 16), default=0)
    if not summed:
        return ""
    return f"{best(1)};{best(several) if several else 'auto'}"


def main() -> int:
    """Print the table (and write ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--sweep", action="store_true", help="time the skinny kernel at a grid of tiles"
    )
    parser.add_argument("--rows", default="1,4,16", help="batches of rows, comma-separated")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--best-tiles", default=None, help="with --sweep: write the best fp8.skinny_tiles here"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fp8_gemm_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    from pitstop.plugins.weight_formats import fp8 as f8
    from pitstop.plugins.weight_formats import fp8_gemm as g

    dev = torch.device("cuda")
    rows_list = [int(r) for r in args.rows.split(",")]
    one_row = [  # CUDA cores: BLOCK_N from 8
        g.SkinnyTiles(bn, bk, warps, 3)
        for bn, bk, warps in itertools.product((8, 16, 32), (512, 1024), (4, 8))
    ]
    rows_grid = [  # tensor cores: BLOCK_N from 16
        g.SkinnyTiles(bn, bk, 4, stages)
        for bn, bk, stages in itertools.product((16, 32, 64), (128, 256), (3, 4))
    ]
    summed: dict[tuple[int, g.SkinnyTiles], float] = {}  # (rows, tile) -> seconds over linears
    results = []
    print(
        f"{'linear':8} {'rows':>4} {'bf16 us':>8} {'%bw':>4} {'qnt+smm':>8} {'%bw':>4} "
        f"{'skinny':>8} {'%bw':>4}  {'best tile (sweep)':28} {'us':>7} {'%bw':>4}"
    )
    for name, (n, k) in SHAPES.items():
        copies = max(2, ROTATE_BYTES // (n * k))
        dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        fp8w = [f8.quantize_rows(w) for w in dense]
        fp8w = [(q.contiguous(), s.reshape(1, -1).contiguous()) for q, s in fp8w]
        for rows in rows_list:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            t_bf16 = time_per_call([lambda w=w, x=x: F.linear(x, w) for w in dense])

            def smm(q, s, x=x):
                xq, xs = g.quantize_rows(x)
                return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s, out_dtype=torch.bfloat16)

            t_smm = time_per_call([lambda q=q, s=s: smm(q, s) for q, s in fp8w])
            row = {
                "linear": name,
                "N": n,
                "K": k,
                "rows": rows,
                "bf16_s": t_bf16,
                "scaled_mm_s": t_smm,
            }
            skinny = None
            if rows <= g.SKINNY_MAX_ROWS:
                tiles = g.skinny_tiles(rows, n, k)

                def sk(q, s, t=tiles, x=x):
                    return g.skinny_linear(x, q, s, None, out_dtype=torch.bfloat16, tiles=t)

                skinny = time_per_call([lambda q=q, s=s: sk(q, s) for q, s in fp8w])
                row |= {"skinny_s": skinny, "skinny_tiles": attrs.asdict(tiles)}
                best = None
                if args.sweep:
                    for t in one_row if rows == 1 else rows_grid:
                        if t.block_k > k:
                            continue
                        try:
                            s_t = time_per_call(
                                [lambda q=q, s=s, t=t: sk(q, s, t) for q, s in fp8w[:8]]
                            )
                        except Exception as exc:  # a tile the compiler refuses (shared memory)
                            print(
                                f"   {name} rows={rows} {t}: {type(exc).__name__}", file=sys.stderr
                            )
                            continue
                        summed[rows, t] = summed.get((rows, t), 0.0) + s_t
                        if best is None or s_t < best[1]:
                            best = (t, s_t)
                    if best:
                        row |= {"best_tiles": str(best[0]), "best_s": best[1]}
            results.append(row)
            fp8_bytes, bf16_bytes = n * k, 2 * n * k

            def pct(sec, nbytes):
                return f"{100 * nbytes / sec / COPY_BYTES_PER_S:4.0f}"

            line = (
                f"{name:8} {rows:4d} {t_bf16 * 1e6:8.1f} {pct(t_bf16, bf16_bytes)} "
                f"{t_smm * 1e6:8.1f} {pct(t_smm, fp8_bytes)} "
            )
            line += (
                f"{skinny * 1e6:8.1f} {pct(skinny, fp8_bytes)}" if skinny else f"{'-':>8} {'-':>4}"
            )
            if "best_s" in row:
                line += f"  {row['best_tiles'][:28]:28} {row['best_s'] * 1e6:7.1f} {pct(row['best_s'], fp8_bytes)}"
            print(line, flush=True)
        del dense, fp8w
        torch.cuda.empty_cache()
    best_tiles = _best_tiles(summed, rows_list)
    if best_tiles:
        print(f"best fp8.skinny_tiles over the four linears: {best_tiles}")
        if args.best_tiles:
            with open(args.best_tiles, "w") as fh:
                fh.write(best_tiles + "\n")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "results": results,
                    "best_tiles": best_tiles,
                },
                fh,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
