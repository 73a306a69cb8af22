"""``benchmarks/moe_bench.py --device cpu`` (issue 48): the script end to end on tiny shapes
through Triton's interpreter (checks every code path, measures nothing)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton


import pytest  # noqa: E402
from helpers.scripts import benchmark_script  # noqa: E402

pytest.importorskip("triton")


def test_moe_bench_runs_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter run is for CPU-only machines")
    mod = benchmark_script("moe_bench")
    rows = mod.main(["--device", "cpu", "--batch", "1", "--batch", "5", "--split", "3"])
    # top-2: the default (grouped) five launches, four for one token (its down sums the
    # slots); the engine's call: one token three (the one-launch router), five tokens the
    # norm and torch's router projection before the five; the fewest: batch 1 three, 5 (10
    # flat rows) four; a split keeps all five; one token's early down the same launches as the
    # tuned and engine rows
    assert [(r["batch"], r["config"], r["launches"]) for r in rows] == [
        (1, "tuned", 4),
        (1, "engine", 3),
        (1, "early", 4),
        (1, "engine-early", 3),
        (1, "fewest", 3),
        (1, "split3", 5),
        (5, "tuned", 5),
        (5, "engine", 7),
        (5, "fewest", 4),
        (5, "split3", 5),
    ]
    assert all(r["us"] > 0 and r["of_copy"] > 0 for r in rows)
    assert all(r["diff"] == 0 if r["config"] == "tuned" else r["diff"] < 3e-2 for r in rows)
    assert all(r["experts_hit"] <= 2 * r["batch"] for r in rows)
    out = capsys.readouterr().out
    assert "of copy" in out and "GB/s" in out
    fp8 = mod.main(["--device", "cpu", "--batch", "2", "--fp8", "--split", "2"])
    assert [r["config"] for r in fp8] == ["tuned", "engine", "fewest", "split2"]
    assert all(r["diff"] < 3e-2 for r in fp8)
