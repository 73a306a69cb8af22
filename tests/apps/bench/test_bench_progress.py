"""A logged bench run is never silent for long; its plot's axes read as plain milliseconds."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from pitstop.bench import progress as progress_mod
from pitstop.bench.drivers import run_workload
from pitstop.bench.progress import LogProgress, progress
from pitstop.bench.report import RequestRecord, RunResult, figures
from pitstop.bench.workloads import BenchRequest, Workload


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_at_least_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    caplog.set_level(logging.INFO, logger="pitstop.bench")
    with LogProgress(50, "longtail", interval_s=10.0, clock=clock) as bar:
        for _ in range(50):
            clock.now += 1.5  # a request every 1.5 s: a line every 7th (10.5 s)
            bar.update(1)
        for _ in range(30):  # a long wait with nothing done still logs
            clock.now += 1.0
            bar.update(0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "longtail: 7/50 requests, 0.67 req/s, 10 s elapsed"
    assert lines[-1] == "longtail: 50/50 requests, 0.48 req/s, 105 s elapsed"
    assert len(lines) == 11  # 105 s: one line per 10 s, and the last
    assert all(" requests, " in line for line in lines)


def test_no_terminal_means_log_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    assert isinstance(progress(3, "x"), LogProgress)


class _Backend:
    """Finishes one request per poll, 20 ms apart."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, float]] = []

    def begin_run(self) -> None:
        pass

    def submit(self, request_id: str, request: BenchRequest, arrival: float) -> None:
        self.pending.append((request_id, arrival))

    def poll(self, timeout: float = 0.0) -> list[RequestRecord]:
        time.sleep(0.02)
        if not self.pending:
            return []
        rid, arrival = self.pending.pop(0)
        now = time.perf_counter()
        return [RequestRecord(rid, 4, 1, arrival, now, now, (now,))]

    def has_work(self) -> bool:
        return bool(self.pending)

    def run_stats(self) -> dict[str, Any]:
        return {}


def test_a_logged_run_reports_its_progress(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(progress_mod, "LOG_INTERVAL_S", 0.05)
    caplog.set_level(logging.INFO, logger="pitstop.bench")
    workload = Workload(
        name="tiny",
        requests=[BenchRequest(output_len=1, prompt="hi") for _ in range(12)],
    )
    run_workload(_Backend(), workload, concurrency=2)  # pytest's stderr is not a terminal
    lines = [r.getMessage() for r in caplog.records if r.name == "pitstop.bench"]
    assert len(lines) >= 3, lines
    assert lines[-1].startswith("tiny: 12/12 requests")


def test_plot_axes_show_plain_milliseconds() -> None:
    pytest.importorskip("matplotlib")
    from pitstop.bench.plot import figure

    # TTFTs within a ms of 13 s: matplotlib's default labels them 0.2, 0.4 beside +1.2991e4
    ttfts = [12991.0 + k / 10 for k in range(10)]
    recs = [
        RequestRecord(f"r{k}", 10, 2, 0.0, t / 1e3, t / 1e3 + 0.1, (t / 1e3, t / 1e3 + 0.1))
        for k, t in enumerate(ttfts)
    ]
    f = figures(RunResult(recs, start=0.0, end=13.2))
    fig = figure([{"name": "a", "figures": f, "ttfts_ms": ttfts}])
    fig.canvas.draw()
    for ax, axis in zip(fig.axes, ("x", "y", "y"), strict=True):
        ticks = getattr(ax, f"get_{axis}ticklabels")()
        offset = getattr(ax, f"{axis}axis").get_major_formatter().get_offset()
        labels = [t.get_text() for t in ticks if t.get_text()]
        assert offset == "", (ax.get_title(), offset)
        assert labels and all("e" not in x and "+" not in x for x in labels), labels
    cdf = [float(t.get_text().replace("\u2212", "-")) for t in fig.axes[0].get_xticklabels()]
    assert min(cdf) > 12990 and max(cdf) < 12993  # milliseconds as they are
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_plot_on_a_log_axis_has_plain_labels_too() -> None:
    pytest.importorskip("matplotlib")
    from pitstop.bench.plot import figure

    cols = []
    for name, scale in (("fast", 1.0), ("slow", 500.0)):
        ttfts = [scale * (10 + k) for k in range(10)]
        recs = [
            RequestRecord(f"r{k}", 10, 2, 0.0, t / 1e3, t / 1e3 + 0.1, (t / 1e3, t / 1e3 + 0.1))
            for k, t in enumerate(ttfts)
        ]
        cols.append(
            {"name": name, "figures": figures(RunResult(recs, 0.0, 10.0)), "ttfts_ms": ttfts}
        )
    fig = figure(cols)
    fig.canvas.draw()
    assert fig.axes[0].get_xscale() == "log"
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_text()]
    assert labels and all("^" not in x and "e" not in x for x in labels), labels
    import matplotlib.pyplot as plt

    plt.close(fig)
