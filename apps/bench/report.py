"""Per-request records, the figures computed from them, the tables and the JSON.

Every time is ``time.perf_counter`` seconds. TTFT counts from the request's
*scheduled* arrival (so queueing delay counts), TPOT is a request's mean gap
after its first token, ITL pools every gap of every request, E2E runs from
arrival to the last token.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from pitstop.requests.outputs import (
    end_to_end_latency,
    inter_token_latencies,
    time_per_output_token,
    time_to_first_token,
)

PERCENTILES = (50, 90, 99)


@attrs.frozen
class RequestRecord:
    """What one finished request did, whichever backend ran it."""

    request_id: str
    input_len: int
    output_len: int
    arrival: float
    first_token: float | None
    finish: float | None
    token_times: tuple[float, ...] = attrs.field(converter=tuple, default=())
    cached_prompt_tokens: int = 0
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return time_to_first_token(self.arrival, self.first_token)

    @property
    def e2e(self) -> float | None:
        """End-to-end latency, from arrival to the last token."""
        return end_to_end_latency(self.arrival, self.finish)

    @property
    def tpot(self) -> float | None:
        """Time per output token; over HTTP several tokens can share one streamed chunk, so
        it divides by the tokens produced (:func:`pitstop.requests.outputs.time_per_output_token`)."""
        return time_per_output_token(self.token_times, self.output_len)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive token arrivals."""
        return inter_token_latencies(self.token_times)

    def as_dict(self, t0: float) -> dict[str, Any]:
        """A JSON row, times relative to ``t0`` (the run's start)."""

        def rel(x: float | None) -> float | None:
            return None if x is None else round(x - t0, 6)

        return {
            "id": self.request_id,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "arrival": rel(self.arrival),
            "first_token": rel(self.first_token),
            "finish": rel(self.finish),
            "token_times": [rel(t) for t in self.token_times],
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "preemptions": self.preemptions,
        }


def record_from_output(output: Any, *, arrival: float | None = None) -> RequestRecord:
    """A record from a finished pitstop ``RequestOutput`` (``arrival`` overrides the engine's)."""
    m = output.metrics
    if m is None:
        raise ValueError(f"request {output.request_id} carries no metrics")
    return RequestRecord(
        request_id=output.request_id,
        input_len=m.num_prompt_tokens,
        output_len=len(output.token_ids),
        arrival=m.arrival if arrival is None else arrival,
        first_token=m.first_token,
        finish=m.finish,
        token_times=m.token_times,
        cached_prompt_tokens=m.num_cached_prompt_tokens,
        preemptions=m.num_preemptions,
    )


@attrs.define
class RunResult:
    """One timed run of a workload on one backend."""

    records: list[RequestRecord]
    start: float
    end: float
    kv_utilization: float | None = None
    prefix_hit_rate: float | None = None
    preemptions: int | None = None
    # Speculative decoding only: drafts accepted / drafts verified, and drafts accepted per verification.
    spec_acceptance_rate: float | None = None
    spec_mean_accepted: float | None = None
    spec_step_share: float | None = None  # steps that speculated (the adaptation rule let them)
    # the allocator's own counters over the run (AllocatorStats.counters; a host tier's)
    allocator_counters: dict[str, float] | None = None
    skipped: list[str] = attrs.Factory(list)
    per_request_counters: bool = True  # records carry cached-prompt and preemption counts
    failed: list[str] | None = None  # over HTTP: why each failed request failed (not in records)

    @property
    def wall_s(self) -> float:
        return self.end - self.start


# ---------------------------------------------------------------------- arithmetic
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (``numpy.percentile``, linear interpolation); NaN when empty."""
    if not values:
        return math.nan
    import numpy as np  # here, so that `pitstop --help` stays quick

    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def distribution(values: Iterable[float | None], scale: float = 1e3) -> dict[str, float]:
    """Mean, P50, P90, P99 of the non-None values, times ``scale`` (seconds -> ms by default)."""
    xs = [v * scale for v in values if v is not None]
    out = {"mean": sum(xs) / len(xs) if xs else math.nan}
    out.update({f"p{q}": percentile(xs, q) for q in PERCENTILES})
    return out


def fastest(runs: list[RunResult]) -> RunResult:
    """The run with the shortest wall time (the first of equals)."""
    return min(runs, key=lambda r: r.wall_s)


def figures(run: RunResult, *, floor_s: float | None = None) -> dict[str, Any]:
    """Every figure of one run: latency distributions (ms), rates, cache figures, floor fraction."""
    recs = run.records
    wall = run.wall_s
    out_tokens = sum(r.output_len for r in recs)
    in_tokens = sum(r.input_len for r in recs)
    itls = [g for r in recs for g in r.itls]
    prefix = run.prefix_hit_rate
    if prefix is None and in_tokens and run.per_request_counters:
        prefix = sum(r.cached_prompt_tokens for r in recs) / in_tokens
    preempt = run.preemptions
    if preempt is None and run.per_request_counters:
        preempt = sum(r.preemptions for r in recs)
    out: dict[str, Any] = {
        "ttft_ms": distribution(r.ttft for r in recs),
        "tpot_ms": distribution(r.tpot for r in recs),
        "itl_ms": distribution(itls),
        "e2e_ms": distribution(r.e2e for r in recs),
        "wall_s": wall,
        "num_requests": len(recs),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "req_per_s": len(recs) / wall if wall > 0 else math.nan,
        "output_tok_per_s": out_tokens / wall if wall > 0 else math.nan,
        "total_tok_per_s": (in_tokens + out_tokens) / wall if wall > 0 else math.nan,
        "kv_utilization": run.kv_utilization,
        "prefix_hit_rate": prefix,
        "preemptions": preempt,
        "floor_s": floor_s,
        "floor_fraction": floor_s / wall if floor_s is not None and wall > 0 else None,
        "skipped_requests": len(run.skipped),
    }
    if run.failed is not None:
        out["failed_requests"] = len(run.failed)
    if run.allocator_counters:
        out["tier"] = tier_figures(run.allocator_counters)
    if run.spec_acceptance_rate is not None or run.spec_mean_accepted is not None:
        out["spec_acceptance_rate"] = run.spec_acceptance_rate
        out["spec_mean_accepted"] = run.spec_mean_accepted
        out["spec_step_share"] = run.spec_step_share
    return out


def tier_figures(counters: dict[str, float]) -> dict[str, Any]:
    """A host tier's figures from its counters over a run: the prompt tokens each tier served
    (of those looked up), GiB moved each way, copy seconds hidden and exposed."""
    device = counters.get("device_hit_tokens", 0.0)
    host = counters.get("host_hit_tokens", 0.0)
    queried = device + host + counters.get("miss_tokens", 0.0)
    out: dict[str, Any] = {
        "device_hit_rate": device / queried if queried else None,
        "host_hit_rate": host / queried if queried else None,
        "gib_to_host": counters.get("bytes_to_host", 0.0) / 2**30,
        "gib_to_device": counters.get("bytes_to_device", 0.0) / 2**30,
        "copy_hidden_s": counters.get("copy_hidden_s", 0.0),
        "copy_exposed_s": counters.get("copy_exposed_s", 0.0),
    }
    return out


# The figures of which --repeats reports the median and the range over every timed run.
REPEAT_FIGURES: tuple[tuple[str, ...], ...] = (
    ("output_tok_per_s",),
    ("req_per_s",),
    ("ttft_ms", "p50"),
    ("ttft_ms", "p99"),
    ("tpot_ms", "p50"),
    ("wall_s",),
)


def repeat_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median, min, max and every value of :data:`REPEAT_FIGURES` over the figures of
    several timed runs (keys joined with ``.``: ``ttft_ms.p50``); ``runs`` their count."""
    out: dict[str, Any] = {"runs": len(runs)}
    for path in REPEAT_FIGURES:
        values = [_get(f, path) for f in runs]
        xs = [v for v in values if isinstance(v, int | float) and not math.isnan(v)]
        if not xs:
            continue
        out[".".join(path)] = {
            "median": percentile(xs, 50),
            "min": min(xs),
            "max": max(xs),
            "range": f"{min(xs):,.1f}–{max(xs):,.1f}",
            "values": values,
        }
    return out


# ---------------------------------------------------------------------- the table
# (label, key path, format, higher is better)
ROWS: list[tuple[str, tuple[str, ...], str]] = [
    *[
        (f"{name} {stat} (ms)", (key, stat), "{:.1f}")
        for name, key in (
            ("TTFT", "ttft_ms"),
            ("TPOT", "tpot_ms"),
            ("ITL", "itl_ms"),
            ("E2E", "e2e_ms"),
        )
        for stat in ("mean", "p50", "p90", "p99")
    ],
    ("requests/s", ("req_per_s",), "{:.2f}"),
    ("output tok/s", ("output_tok_per_s",), "{:.1f}"),
    ("total tok/s", ("total_tok_per_s",), "{:.1f}"),
    ("KV utilization", ("kv_utilization",), "{:.1%}"),
    ("prefix hit rate", ("prefix_hit_rate",), "{:.1%}"),
    ("preemptions", ("preemptions",), "{:d}"),
    ("wall time (s)", ("wall_s",), "{:.2f}"),
    ("fraction of floor", ("floor_fraction",), "{:.1%}"),
]


# Rows shown only when some column has the figure (repeats, failures, speculative decoding).
OPTIONAL_ROWS: list[tuple[str, tuple[str, ...], str]] = [
    ("output tok/s, median of runs", ("repeats", "output_tok_per_s", "median"), "{:.1f}"),
    ("output tok/s, range of runs", ("repeats", "output_tok_per_s", "range"), "{}"),
    ("requests/s, median of runs", ("repeats", "req_per_s", "median"), "{:.2f}"),
    ("TTFT p50 (ms), median of runs", ("repeats", "ttft_ms.p50", "median"), "{:.1f}"),
    ("timed runs", ("repeats", "runs"), "{:d}"),
    ("failed requests", ("failed_requests",), "{:d}"),
    ("spec acceptance rate", ("spec_acceptance_rate",), "{:.1%}"),
    ("spec accepted / verify", ("spec_mean_accepted",), "{:.2f}"),
    ("steps that speculated", ("spec_step_share",), "{:.1%}"),
    ("device-cache hit rate", ("tier", "device_hit_rate"), "{:.1%}"),
    ("host-tier hit rate", ("tier", "host_hit_rate"), "{:.1%}"),
    ("GiB copied to host", ("tier", "gib_to_host"), "{:.2f}"),
    ("GiB copied to device", ("tier", "gib_to_device"), "{:.2f}"),
    ("copy time hidden (s)", ("tier", "copy_hidden_s"), "{:.3f}"),
    ("copy time exposed (s)", ("tier", "copy_exposed_s"), "{:.3f}"),
]


_NO_CHANGE = {("repeats", "runs")}  # rows where a change against the first column means nothing


def _get(figs: dict[str, Any] | None, path: tuple[str, ...]) -> Any:
    value: Any = figs
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _fmt(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def table(columns: Sequence[tuple[str, dict[str, Any] | None, str | None]]) -> str:
    """A markdown table: one row per figure, one column per configuration, the change vs the first.

    ``columns`` holds ``(name, figures or None, error or None)``; a failed
    column shows ``failed`` and its error is listed under the table.
    """
    header = ["figure"]
    for i, (name, _, _) in enumerate(columns):
        header.append(name)
        if i:
            header.append("Δ")
    rows = [header]
    first = columns[0][1] if columns else None
    optional = [
        r for r in OPTIONAL_ROWS if any(_get(figs, r[1]) is not None for _, figs, _ in columns)
    ]
    for label, path, fmt in ROWS + optional:
        row = [label]
        base = _get(first, path)
        for i, (_, figs, err) in enumerate(columns):
            value = _get(figs, path) if err is None else None
            row.append("failed" if err is not None else _fmt(value, fmt))
            if i:
                row.append("" if path in _NO_CHANGE else _change(base, value))
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    notes = [f"- {name}: {err}" for name, _, err in columns if err is not None]
    return "\n".join(lines + (["", "failed configurations:", *notes] if notes else []))


def _change(base: Any, value: Any) -> str:
    if not isinstance(base, int | float) or not isinstance(value, int | float):
        return ""
    if math.isnan(base) or math.isnan(value) or base == 0:
        return ""
    return f"{(value - base) / abs(base):+.0%}"


# ---------------------------------------------------------------------- provenance + JSON
COMMIT_ENV = "PITSTOP_COMMIT"


def git_commit(repo: str | Path | None = None) -> str | None:
    """The commit the results came from: ``$PITSTOP_COMMIT`` when set (a copy of the tree
    without ``.git``, as on the H200 machine), else ``git rev-parse HEAD`` of the source tree
    (with ``-dirty`` when it has changes), else None."""
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given:
        return given
    cwd = Path(repo) if repo else Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def device_name(device: str) -> str:
    """A human name of the device a run used."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def dumps(document: Any) -> str:
    """JSON of the results document: NaN (and infinity) becomes null, one key a line, and a
    list of plain numbers or strings (per-token times, TTFTs) on one line, so the raw timings
    stay compact."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    def scalar(x: Any) -> bool:
        return x is None or isinstance(x, str | int | float | bool)

    def dump(x: Any, indent: str) -> str:
        inner = indent + " "
        if isinstance(x, dict) and x:
            items = [f"{inner}{json.dumps(k)}: {dump(v, inner)}" for k, v in x.items()]
            return "{\n" + ",\n".join(items) + "\n" + indent + "}"
        if isinstance(x, list) and x and not all(scalar(v) for v in x):
            items = [inner + dump(v, inner) for v in x]
            return "[\n" + ",\n".join(items) + "\n" + indent + "]"
        return json.dumps(x, separators=(", ", ": "), allow_nan=False)

    return dump(clean(document), "") + "\n"


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    """Write the results document (see :func:`dumps`)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(dumps(document))
