"""Join the results of one matrix that ran in several parts (``pitstop bench ... --only``).

    python benchmarks/merge_results.py part1.json part2.json --output all.json --plot all.png

Every part must have run the same workload (name, request count, seed, clients)
on the same model; the configurations are joined in the order given, the
table (with the change against the first column) is printed, and the plot is
drawn from all of them. Each column keeps the commit and date of its part.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pitstop.bench.cli import render
from pitstop.bench.report import write_json

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


def main(argv: list[str] | None = None) -> int:
    """Merge, print the table, write the JSON and the plot."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("parts", nargs="+", type=Path, help="results JSON files of pitstop bench")
    p.add_argument("--output", type=Path, help="write the merged JSON here")
    p.add_argument("--plot", type=Path, help="draw the merged PNG here")
    args = p.parse_args(argv)
    doc = merge([json.loads(path.read_text()) for path in args.parts])
    if args.output:
        write_json(args.output, doc)
    if args.plot:
        from pitstop.bench.plot import plot

        title = f"{doc['workload']['name']} on {doc['model']['name']}, {doc['device']}"
        plot(doc["configs"], args.plot, title=title)
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
