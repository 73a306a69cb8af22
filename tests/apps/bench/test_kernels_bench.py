"""The decode sweep of ``benchmarks/kernels_bench.py --decode-sweep`` (issue 29) on CPU.

Its candidates for the H200 (pure arithmetic), a whole sweep over a tiny
candidate set through Triton's interpreter (checks every code path, measures
nothing), and the clear failure without CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from helpers.scripts import benchmark_script  # noqa: E402

pytest.importorskip("triton")


def _fp8_widen() -> tuple[str, ...]:
    """Every fp8_widen mode: the sweep times each one over an fp8 cache."""
    from pitstop.plugins.kernels.triton_ops.paged_attention import FP8_WIDEN

    return FP8_WIDEN


@pytest.fixture(scope="module")
def kb():
    return benchmark_script("kernels_bench")


def _args(**kw) -> argparse.Namespace:
    base = dict(heads=32, kv_heads=8, head_size=128, page_size=16, jobs=1, compile_only=False)
    base.update(sweep_budget=130.0, verbose=False, shard="0/1", sweep_shapes=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_candidates_on_the_h200(kb) -> None:
    """The engine's config first (its split counts on 132 SMs), every split count and tile shape
    once, every widening (FP8_WIDEN) for fp8 only, the one-launch merge at every split count past 1, and a
    compile set that 14 processes get through."""
    plan = kb.sweep_plan(_args(), kb.H200_SMS)
    assert set(plan) == {(kv, b, c) for kv in kb.SWEEP_KV for b, c in kb.SWEEP_SHAPES}
    now = {key: [cfg for stage, cfg in c if stage == "current"] for key, c in plan.items()}
    splits = {(b, c): now[("bfloat16", b, c)][0].splits for b, c in kb.SWEEP_SHAPES}
    assert splits == {(1, 4096): 32, (8, 2048): 8, (64, 2048): 1, (256, 512): 1, (1, 32768): 64}
    for (kv, b, c), cands in plan.items():
        fp8 = kv != "bfloat16"
        assert [cfg.widen for cfg in now[(kv, b, c)]] == (list(_fp8_widen()) if fp8 else [None])
        cur = now[(kv, b, c)][0]
        assert cur.tiles == (64, 2, 4)  # DECODE_TILES[128], GQA 4
        cfgs = [cfg for _, cfg in cands]
        assert len(cfgs) == len(set(cfgs))
        timed_splits = {cfg.splits for cfg in cfgs if cfg.tiles == cur.tiles}
        assert timed_splits == set(kb.SWEEP_SPLITS)
        timed_tiles = {cfg.tiles for cfg in cfgs if cfg.splits == cur.splits}
        assert timed_tiles == set(kb.SWEEP_TILES) and len(kb.SWEEP_TILES) == 27
        widens = {cfg.widen for cfg in cfgs}
        assert widens == (set(_fp8_widen()) if fp8 else {None})
        last = [(stage, cfg) for stage, cfg in cands if cfg.merge == "last-program"]
        assert {stage for stage, _ in last} == {"merge"}
        assert sorted(cfg.splits for _, cfg in last) == [s for s in kb.SWEEP_SPLITS if s > 1]
        assert {(cfg.tiles, cfg.widen) for _, cfg in last} == {(cur.tiles, cur.widen)}
        assert all(cfg.merge == "separate" for stage, cfg in cands if stage != "merge")
    # 14 of them last-program (7 split counts x bf16, fp8 with fp16 operands)
    compiled = kb.sweep_compile_set(plan)
    assert sum(cfg.merge == "last-program" for cfg in compiled) == 14
    assert len(compiled) <= 260  # 254 with the three fp8 widenings (qk-fp8's split counts)


def test_a_tiny_sweep_runs_every_stage_on_cpu(kb, monkeypatch, tmp_path) -> None:
    """Every stage times, checks and records its configs; the table and the JSON name the best."""
    monkeypatch.setattr(kb, "DEVICE", "cpu")
    monkeypatch.setattr(kb, "H200_SMS", 4)  # 2 splits: the interpreter is slow
    monkeypatch.setattr(kb, "SWEEP_SHAPES", [(3, 40)])
    monkeypatch.setattr(kb, "SWEEP_SPLITS", [1, 4])
    monkeypatch.setattr(kb, "SWEEP_TILES", [(16, 1, 1), (32, 1, 1)])
    monkeypatch.setattr(kb, "ROWS", [])
    monkeypatch.setattr(kb, "JSON_OUT", {"path": str(tmp_path / "s.json"), "header": {}})
    args = _args(heads=8, kv_heads=2, head_size=64)
    with torch.inference_mode():
        winners = kb.run_decode_sweep(args)
    assert set(winners) == {"bfloat16 3x40", "fp8_e4m3 3x40"}
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    stages = {(r["kv_cache_dtype"], r["stage"]) for r in rows}
    assert {
        (kv, s) for kv in kb.SWEEP_KV for s in ("current", "splits", "merge", "tiles")
    } <= stages
    assert {(r["splits"], r["merge"]) for r in rows if r["stage"] == "merge"} == {
        (4, "last-program")
    }
    assert {r["widen"] for r in rows if r["kv_cache_dtype"] == "fp8_e4m3"} == set(_fp8_widen())
    assert all("frac_copy" in r and r["err"] <= 2e-2 for r in rows), rows
    assert len(rows) == len(
        {
            (
                r["kv_cache_dtype"],
                r["stage"],
                tuple(r["tiles"]),
                r["splits"],
                r["widen"],
                r["merge"],
            )
            for r in rows
        }
    )


def test_the_best_stage_pairs_the_best_tiles_with_the_best_split_count(kb) -> None:
    """Best tiles (at the engine's splits) x best splits (at the engine's tiles), if not yet timed."""

    def row(
        stage: str,
        tiles: tuple,
        splits: int,
        us: float,
        widen: str | None = "fp16",
        merge: str = "separate",
    ) -> dict:
        return dict(kind="decode-sweep", stage=stage, kv_cache_dtype="fp8_e4m3", shape=[8, 2048],
                    tiles=list(tiles), splits=splits, widen=widen, merge=merge, us=us,
                    frac_copy=1 / us)  # fmt: skip

    rows = [
        row("current", (64, 2, 4), 8, 10.0),
        row("current", (64, 2, 4), 8, 5.0, "query"),  # another widening: not a candidate here
        row("splits", (64, 2, 4), 16, 9.0),
        row("splits", (64, 2, 4), 4, 11.0),
        row("tiles", (32, 1, 3), 8, 8.0),
        row("tiles", (128, 4, 2), 8, 12.0),
        row("merge", (64, 2, 4), 32, 6.0, merge="last-program"),  # not a best-stage candidate
    ]
    key = ("fp8_e4m3", 8, 2048)
    assert kb.best_pair_config(key, rows) == kb.SweepConfig("fp8_e4m3", (32, 1, 3), 16, "fp16")
    rows.append(row("best", (32, 1, 3), 16, 7.0))
    assert kb.best_pair_config(key, rows) is None  # timed already
    assert kb.sweep_best(rows)[key]["widen"] == "query"  # the fastest of all rows
    table = kb.sweep_table(rows).splitlines()
    assert table[1].split()[:4] == ["fp8_e4m3", "8x2048", "best", "20.0%"], table
    assert [line.split()[0] for line in table[2:4]] == ["now", "now"], table
    # the fastest of each merge: last-program 6.0 us at 32 splits, separate 5.0 us
    assert table[-1].split()[:3] == ["merge", "last-program", "16.7%"], table
    assert "separate  20.0%" in table[-1] and "s=32 fp16 last-program" in table[-1], table


def test_the_sweep_stops_at_its_budget(kb, monkeypatch) -> None:
    """Past --sweep-budget no candidate starts; the run still ends with its (empty) table."""
    monkeypatch.setattr(kb, "DEVICE", "cpu")
    monkeypatch.setattr(kb, "SWEEP_SHAPES", [(1, 20)])
    monkeypatch.setattr(kb, "ROWS", [])
    with torch.inference_mode():
        assert kb.run_decode_sweep(_args(heads=4, kv_heads=2, head_size=64, sweep_budget=0)) == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_without_cuda_the_sweep_fails_clearly(kb, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["kernels_bench.py", "--decode-sweep"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        kb.main()


def test_sweep_shapes_are_parsed_and_replace_the_default(kb) -> None:
    """``--sweep-shapes 256x1024,128x2048`` plans those shapes; a malformed one names the form."""
    shapes = kb.sweep_shapes("256x1024, 128X2048")
    assert shapes == [(256, 1024), (128, 2048)]
    plan = kb.sweep_plan(_args(sweep_shapes=shapes), kb.H200_SMS)
    assert {(b, c) for _, b, c in plan} == set(shapes)
    for bad in ("256", "0x512", "ax512", "256x"):
        with pytest.raises(argparse.ArgumentTypeError, match="BATCHxCONTEXT"):
            kb.sweep_shapes(bad)
