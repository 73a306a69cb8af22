"""Where an offline run's time went, step by step, from a `pitstop bench` JSON (issue 29).

    python benchmarks/step_timeline.py RESULTS.json[.gz] [--config NAME] [--gap-ms 50]

The bench keeps every request's token times. Tokens that arrive within
``--join-us`` of each other came from one engine step, so the distinct arrival
times are the step boundaries. For each configuration (and each timed pass in
it) this prints: the number of steps; the steps that emitted first tokens (the
prefill phase) and their mean length; the longest gaps between steps (a gap
above ``--gap-ms`` is a stall: a collection, a compile, a capture); and the
time spent at each batch size (requests decoding in the step), so the tail of
small batches shows beside the full ones.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def steps_of(requests: list[dict[str, Any]], join_s: float) -> list[tuple[float, int, int]]:
    """``(start, tokens, first_tokens)`` of each step, from the requests' token times."""
    firsts = {round(r["first_token"], 6) for r in requests if r.get("first_token") is not None}
    times = sorted(t for r in requests for t in r.get("token_times") or ())
    steps: list[list[float]] = []
    for t in times:
        if steps and t - steps[-1][-1] < join_s:
            steps[-1].append(t)
        else:
            steps.append([t])
    return [(s[0], len(s), sum(1 for t in s if round(t, 6) in firsts)) for s in steps]


def summary(requests: list[dict[str, Any]], join_s: float, gap_s: float) -> dict[str, Any]:
    """The timeline of one timed pass: steps, prefill phase, stalls, time by batch size."""
    steps = steps_of(requests, join_s)
    lengths = [(b[0] - a[0], b[1], b[2]) for a, b in zip(steps, steps[1:], strict=False)]
    prefill = [dt for dt, _, first in lengths if first]
    by_batch: dict[int, list[float]] = defaultdict(list)
    for dt, tokens, _ in lengths:
        by_batch[min(tokens, 256) // 32 * 32].append(dt)
    stalls = sorted(((dt, steps[i][0]) for i, (dt, _, _) in enumerate(lengths)), reverse=True)
    return {
        "steps": len(steps),
        "wall_s": max(r["finish"] for r in requests),
        "prefill_steps": len(prefill),
        "prefill_ms_mean": 1e3 * sum(prefill) / max(1, len(prefill)),
        "longest_gaps_ms": [(round(1e3 * dt, 1), round(at, 3)) for dt, at in stalls[:5]],
        "stalls_over_gap": sum(1 for dt, _ in stalls if dt > gap_s),
        "by_batch": {
            f"{k}-{k + 31}": {
                "steps": len(v),
                "s": round(sum(v), 3),
                "ms_median": round(1e3 * sorted(v)[len(v) // 2], 2),
            }
            for k, v in sorted(by_batch.items())
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Print each configuration's timeline; 1 if the file holds no token times."""
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    p.add_argument("results", type=Path)
    p.add_argument("--config", action="append", help="only this configuration (repeatable)")
    p.add_argument("--gap-ms", type=float, default=50.0, help="a gap above this is a stall")
    p.add_argument("--join-us", type=float, default=400.0, help="tokens this close: one step")
    args = p.parse_args(argv)
    raw = args.results.read_bytes()
    data = json.loads(gzip.decompress(raw) if args.results.suffix == ".gz" else raw)
    found = False
    for config in data.get("configs", []):
        if args.config and config["name"] not in args.config:
            continue
        requests = [r for r in config.get("requests") or () if r.get("token_times")]
        passes: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in requests:  # ids "r<pass>-<n>" when the run repeated
            passes[r["id"].split("-")[0] if "-" in r["id"] else "r0"].append(r)
        for name, reqs in sorted(passes.items()):
            found = True
            s = summary(reqs, args.join_us * 1e-6, args.gap_ms * 1e-3)
            print(
                f"{config['name']} {name}: {s['steps']} steps in {s['wall_s']:.3f} s; "
                f"{s['prefill_steps']} with first tokens, {s['prefill_ms_mean']:.1f} ms each; "
                f"{s['stalls_over_gap']} gaps over {args.gap_ms:g} ms; longest "
                + ", ".join(f"{ms} ms at {at} s" for ms, at in s["longest_gaps_ms"][:3])
            )
            print(
                "   by batch: "
                + "; ".join(
                    f"{k}: {v['steps']} steps, {v['s']} s, {v['ms_median']} ms"
                    for k, v in s["by_batch"].items()
                )
            )
    if not found:
        print(f"{args.results}: no request with token times", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
