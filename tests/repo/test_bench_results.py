"""The stored benchmark results: under 10 MB in git, gzipped, and readable by the floor."""

from __future__ import annotations

from pathlib import Path

import pytest

from pitstop.bench import floor as floors
from pitstop.bench import workloads as W
from pitstop.plugins.models.llama_presets import PRESETS

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"
LIMIT_BYTES = 10 * 10**6


def _files() -> list[Path]:
    return [p for p in RESULTS.rglob("*") if p.is_file()]


def test_benchmark_results_stay_under_10_mb() -> None:
    total = sum(p.stat().st_size for p in _files())
    assert total < LIMIT_BYTES, (
        f"benchmarks/results/ holds {total / 1e6:.1f} MB: keep the latest run of each table, "
        "gzipped, and leave superseded runs to git history (docs/benchmarks.md says where)"
    )


def test_benchmark_results_are_stored_gzipped() -> None:
    plain = [str(p.relative_to(RESULTS)) for p in _files() if p.suffix in {".json", ".log"}]
    assert plain == [], f"gzip these (gzip -9 -n): {plain}"


def test_a_stored_result_restates_against_the_floor_now() -> None:
    path = RESULTS / "h200" / "vllm-single-ec505a2.json.gz"
    doc = floors.read_result(str(path))
    now = floors.floor_of_result(doc)
    wl = W.single()
    assert now.seconds == pytest.approx(
        floors.floor(
            PRESETS["llama3-8b"], [(r.input_len, r.output_len) for r in wl.requests]
        ).seconds
    )
    rows = {r["column"]: r for r in floors.restate(doc)}
    assert set(rows) == {"pitstop", "peer:vllm"}
    # recorded with the bytes-only floor (0.9725 s); the floor now adds the prefill's
    # weight read (0.9740 s), so every fraction rises by the same factor
    for r in rows.values():
        assert r["floor_s_recorded"] == pytest.approx(0.97247, rel=1e-4)
        assert r["fraction_now"] == pytest.approx(
            r["fraction_recorded"] * now.seconds / r["floor_s_recorded"]
        )
    assert rows["pitstop"]["fraction_now"] == pytest.approx(0.769, abs=5e-4)
