"""Join the results of one matrix that ran in several parts (``pitstop bench ... --only``).

    python benchmarks/merge_results.py part1.json part2.json --output all.json --plot all.png

(a part may be gzipped: ``part1.json.gz``)

Every part must have run the same workload (name, request count, seed, clients)
on the same model; the configurations are joined in the order given, the
table (with the change against the first column) is printed, and the plot is
drawn from all of them. Each column keeps the commit and date of its part.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

from pitstop.bench.cli import publish

SAME = ("name", "num_requests", "seed", "concurrency", "request_rate", "input_tokens")


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One results document holding every part's configurations, in order."""
    first = docs[0]
    for doc in docs[1:]:
        diff = [k for k in SAME if doc["workload"].get(k) != first["workload"].get(k)]
        if diff or doc["model"]["name"] != first["model"]["name"]:
            raise SystemExit(
                f"cannot merge: the parts ran different workloads or models ({', '.join(diff) or 'model'})"
            )
    merged = dict(first)
    merged["configs"] = []
    for doc in docs:
        for col in doc["configs"]:
            merged["configs"].append({**col, "commit": doc["commit"], "date": doc["date"]})
    commits = sorted({d["commit"] or "unknown" for d in docs})
    merged["commit"] = ",".join(commits)
    merged["notes"] = [*first.get("notes", []), f"merged from {len(docs)} runs"]
    return merged


def _read(path: Path) -> dict[str, Any]:
    """A results document, ``.json`` or ``.json.gz``."""
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def main(argv: list[str] | None = None) -> int:
    """Merge, write the JSON and the plot, print the table (exit status as ``pitstop bench``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("parts", nargs="+", type=Path, help="results JSON files of pitstop bench")
    p.add_argument("--output", type=Path, help="write the merged JSON here")
    p.add_argument("--plot", type=Path, help="draw the merged PNG here")
    args = p.parse_args(argv)
    doc = merge([_read(path) for path in args.parts])
    return publish(doc, args.output, args.plot)


if __name__ == "__main__":
    sys.exit(main())
