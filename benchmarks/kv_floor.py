"""Each column of a ``pitstop bench`` result as a fraction of the bf16-KV and the fp8-KV floor.

The bench's floor (WORKLOADS.md) counts 2 bytes per cached K/V element; with
the KV cache in fp8 the same workload's floor reads 1 byte per element, so
its KV part halves (prefill FLOPs and weight reads are unchanged)::

    python benchmarks/kv_floor.py results/nano-fp8.json  # or .json.gz
"""

from __future__ import annotations

import gzip
import json
import sys


def main(path: str) -> None:
    """Print one line per column: throughput, speed-up over the first column, both floor fractions."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        doc = json.load(f)
    floor = doc.get("floor")
    if not floor:
        raise SystemExit(f"{path}: no floor (not measured on a GPU)")
    bf16_s = floor["seconds"]
    fp8_s = floor["prefill_s"] + floor["weights_s"] + floor["kv_s"] / 2
    print(f"floor: bf16 KV {bf16_s:.2f} s, fp8 KV {fp8_s:.2f} s ({doc['workload'].get('name')})")
    first = None
    for col in doc["configs"]:
        figs = col.get("figures")
        if not figs:
            print(f"{col['name']}: {col.get('error', 'no figures')}")
            continue
        wall, tok_s = figs["wall_s"], figs["output_tok_per_s"]
        first = first or tok_s
        print(
            f"{col['name']}: {tok_s:,.0f} output tok/s ({tok_s / first:.2f}x the first column), "
            f"{figs['req_per_s']:.2f} req/s, wall {wall:.2f} s; "
            f"{bf16_s / wall:.1%} of the bf16-KV floor, {fp8_s / wall:.1%} of the fp8-KV floor"
        )


if __name__ == "__main__":
    main(sys.argv[1])
