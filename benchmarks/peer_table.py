"""The short table of ``pitstop bench ... --peer vllm`` results: one row per results file.

    python benchmarks/peer_table.py OUT/vllm-*.json

Each row: the workload (and clients), pitstop's and the peer's output tok/s (the
median of the timed runs, with their range, when there were several), the
ratio pitstop / peer, and online the TTFT P50 / P99 of both; a side that
failed shows its error.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path
from typing import Any


def _rate(figs: dict[str, Any] | None) -> tuple[float | None, str]:
    """(output tok/s, its text): the median and range of the runs, else the one run's."""
    if not figs:
        return None, "failed"
    rep = (figs.get("repeats") or {}).get("output_tok_per_s")
    if rep:
        runs = figs["repeats"]["runs"]
        return rep["median"], f"{rep['median']:,.0f} ({rep['range']}, {runs} runs)"
    value = figs.get("output_tok_per_s")
    return value, f"{value:,.0f}" if value is not None else "n/a"


def _ttft(figs: dict[str, Any] | None) -> str:
    ttft = (figs or {}).get("ttft_ms") or {}
    p50, p99 = ttft.get("p50"), ttft.get("p99")
    if p50 is None or (isinstance(p50, float) and math.isnan(p50)):
        return "n/a"
    return f"{p50:,.0f} / {p99:,.0f}"


def rows(paths: list[Path]) -> list[list[str]]:
    """One table row per results document."""
    out = []
    for path in paths:
        try:
            raw = path.read_bytes()
            doc = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
        except (OSError, ValueError) as exc:
            out.append(
                [
                    path.name.removesuffix(".gz").removesuffix(".json"),
                    f"unreadable: {exc}",
                    "",
                    "",
                    "",
                    "",
                ]
            )
            continue
        wl = doc["workload"]
        name = wl["name"] + (f", {wl['concurrency']} clients" if wl.get("concurrency") else "")
        mine = next((c for c in doc["configs"] if c.get("figures")), doc["configs"][0])
        peer = doc.get("peer") or {}
        a, a_text = _rate(mine.get("figures"))
        b, b_text = _rate(peer.get("figures"))
        ratio = f"{a / b:.2f}x" if a and b else "n/a"
        online = doc["mode"] == "online"
        out.append(
            [
                f"{path.name.removesuffix('.gz').removesuffix('.json')}: {name}",
                a_text if not mine.get("error") else f"failed: {mine['error'][:80]}",
                b_text if not peer.get("error") else f"failed: {peer['error'][:120]}",
                ratio,
                f"{_ttft(mine.get('figures'))} vs {_ttft(peer.get('figures'))}" if online else "",
                str(peer.get("version") or ""),
            ]
        )
    return out


def main() -> None:
    """Print the table of the files given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("results", nargs="+", type=Path)
    args = parser.parse_args()
    header = [
        "run",
        "pitstop output tok/s",
        "vLLM output tok/s",
        "ratio",
        "TTFT P50 / P99 ms",
        "vLLM",
    ]
    table = [header, *rows(args.results)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for k, r in enumerate(table):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
        if k == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


if __name__ == "__main__":
    main()
