"""What both bench modes share: the flags turned into a workload and client counts,
the error type of a bad flag, and one results column.

``pitstop bench offline`` / ``online`` (:mod:`pitstop.bench.cli`) and the
HTTP driver of ``--url`` (:mod:`pitstop.bench.http`) both import from here,
so neither imports the other.
"""

from __future__ import annotations

import argparse
from typing import Any

from pitstop.bench import floor as floors
from pitstop.bench.report import RunResult, fastest, figures, repeat_summary
from pitstop.bench.workloads import TOKEN_ID_HIGH, Workload, build_workload
from pitstop.errors import PitstopError

SCHEMA = "pitstop.bench/1"


class BenchError(PitstopError, ValueError):
    """A ``pitstop bench`` argument is invalid."""


def workload_from_args(args: argparse.Namespace, token_high: int = TOKEN_ID_HIGH) -> Workload:
    """The workload ``--workload`` names (or the file it points to), sized by the flags."""
    return build_workload(
        args.workload,
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed or 0,  # the engine's --seed seeds the workload's draws too
        token_high=token_high,
        shared_prefix_len=getattr(args, "shared_prefix_len", None),
    )


def clients_from_args(
    args: argparse.Namespace, workload: Workload
) -> tuple[int | None, float | None]:
    """(closed-loop clients, Poisson rate) of an online run; (None, None) offline."""
    if args.bench_mode == "offline":
        return None, None
    rate = getattr(args, "request_rate", None)
    conc = getattr(args, "concurrency", None)
    if conc is not None and conc < 1:
        raise BenchError(f"--concurrency must be >= 1, got {conc}")
    if rate is not None and rate <= 0:
        raise BenchError(f"--request-rate must be > 0, got {rate}")
    if rate is not None and conc is not None:
        raise BenchError("give --concurrency (closed loop) or --request-rate (Poisson), not both")
    if rate is not None:
        return None, rate
    return conc or workload.concurrency or 32, None


def fill_column(
    col: dict[str, Any],
    run: RunResult | list[RunResult],
    floor: floors.Floor | None,
    skipped: list[str],
) -> None:
    """Put a run's figures, TTFTs and per-request records into its results column.

    Given several timed runs (``--repeats``), the fastest gives the figures and
    the records, and ``figures["repeats"]`` holds the median and range of each
    headline figure over all of them (:func:`~pitstop.bench.report.repeat_summary`).
    """
    runs = run if isinstance(run, list) else [run]
    best = fastest(runs)
    floor_s = floor.seconds if floor else None
    for r in runs:
        r.skipped = skipped
    col["figures"] = figures(best, floor_s=floor_s)
    if len(runs) > 1:
        col["figures"]["repeats"] = repeat_summary([figures(r, floor_s=floor_s) for r in runs])
    col["ttfts_ms"] = [1e3 * r.ttft for r in best.records if r.ttft is not None]
    col["requests"] = [r.as_dict(best.start) for r in best.records]
