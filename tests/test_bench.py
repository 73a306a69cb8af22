"""`pitstop bench`: floors vs WORKLOADS.md, figure arithmetic, workloads, files, end-to-end runs."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from pitstop.bench import floor as floors
from pitstop.bench import workloads as W
from pitstop.bench.matrix import MatrixError, parse_matrix
from pitstop.bench.report import (
    RequestRecord,
    RunResult,
    distribution,
    figures,
    percentile,
    record_from_output,
    table,
)
from pitstop.presets import PRESETS


# ---------------------------------------------------------------------- floors
def _floor(wl: W.Workload, preset: str) -> floors.Floor:
    return floors.floor(
        PRESETS[preset],
        [(r.input_len, r.output_len) for r in wl.requests],
        concurrency=wl.concurrency,
    )


@pytest.mark.parametrize(
    ("workload", "preset", "seconds", "figure", "value"),
    [
        ("single", "llama3-8b", None, "output_tok_per_s", 263),
        ("nano", "qwen3-0.6b", 3.7, "output_tok_per_s", 35_800),
        ("nano", "qwen3-8b", 10.4, "output_tok_per_s", 12_900),
        ("longtail", "qwen3-8b", 15.5, "req_per_s", 32),
    ],
)
def test_floor_reproduces_workloads_md(workload, preset, seconds, figure, value):
    f = _floor(W.GENERATORS[workload](), preset)
    if seconds is not None:
        assert f.seconds == pytest.approx(seconds, rel=0.05)
    assert getattr(f, figure) == pytest.approx(value, rel=0.05)


def test_single_floor_per_token():
    f = _floor(W.single(), "llama3-8b")
    assert 1e3 * f.s_per_output_token == pytest.approx(3.8, rel=0.05)


def test_shared_prefix_lowers_the_prefill_floor():
    mc = PRESETS["qwen3-8b"]
    lengths = [(1024 + 100, 50)] * 8
    plain = floors.floor(mc, lengths)
    shared = floors.floor(mc, lengths, shared_prefix=(1024, 1))
    assert shared.prefill_s < plain.prefill_s / 4
    assert shared.kv_s == plain.kv_s


# ---------------------------------------------------------------------- arithmetic
def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    d = distribution([0.001, 0.002, None, 0.003])
    assert d["mean"] == pytest.approx(2.0) and d["p50"] == pytest.approx(2.0)


def _record(i: int, arrival: float, tokens: list[float], n_in: int = 10) -> RequestRecord:
    return RequestRecord(f"r{i}", n_in, len(tokens), arrival, tokens[0], tokens[-1], tuple(tokens))


def test_figures_on_a_hand_built_timeline():
    # r0 arrives at 0, tokens at 1, 2, 3; r1 arrives at 1, tokens at 2, 2.5 (times in s)
    recs = [_record(0, 0.0, [1.0, 2.0, 3.0]), _record(1, 1.0, [2.0, 2.5], n_in=30)]
    run = RunResult(recs, start=0.0, end=3.0, kv_utilization=0.5, preemptions=2)
    f = figures(run, floor_s=1.5)
    assert f["ttft_ms"]["mean"] == pytest.approx(1000.0)  # both wait 1 s
    assert f["tpot_ms"]["p50"] == pytest.approx(750.0)  # 1000 and 500
    assert f["itl_ms"]["mean"] == pytest.approx((1000 + 1000 + 500) / 3)
    assert f["e2e_ms"]["p99"] == pytest.approx(1000 * (1.5 + 0.99 * 1.5))  # e2e 3.0 and 1.5
    assert f["req_per_s"] == pytest.approx(2 / 3)
    assert f["output_tok_per_s"] == pytest.approx(5 / 3)
    assert f["total_tok_per_s"] == pytest.approx(45 / 3)
    assert f["kv_utilization"] == 0.5 and f["preemptions"] == 2
    assert f["floor_fraction"] == pytest.approx(0.5)
    assert f["prefix_hit_rate"] == 0.0


def test_record_from_a_request_output():
    from pitstop.outputs import RequestMetrics, RequestOutput

    m = RequestMetrics(
        arrival=10.0,
        first_scheduled=10.5,
        first_token=11.0,
        finish=13.0,
        token_times=(11.0, 12.0, 13.0),
        num_prompt_tokens=7,
        num_cached_prompt_tokens=4,
        num_preemptions=1,
    )
    out = RequestOutput("a", None, list(range(7)), "", [1, 2, 3], True, "length", metrics=m)
    rec = record_from_output(out)
    assert (rec.ttft, rec.tpot, rec.e2e, rec.itls) == (1.0, 1.0, 3.0, [1.0, 1.0])
    assert rec.ttft == m.ttft and rec.tpot == m.tpot and rec.itls == m.inter_token_latencies
    f = figures(RunResult([rec], start=10.0, end=13.0))
    assert f["prefix_hit_rate"] == pytest.approx(4 / 7) and f["preemptions"] == 1


def test_table_shows_change_and_failed_columns():
    base = figures(RunResult([_record(0, 0.0, [2.0, 3.0])], 0.0, 3.0))
    fast = figures(RunResult([_record(0, 0.0, [1.0, 2.0])], 0.0, 2.0))
    text = table(
        [
            ("baseline", base, None),
            ("+paged", fast, None),
            ("+fused", None, "unknown kernels 'fused'"),
        ]
    )
    assert "-50%" in text  # TTFT 2000 -> 1000 ms
    assert "failed" in text and "unknown kernels 'fused'" in text


# ---------------------------------------------------------------------- workloads
def test_nano_is_nano_vllms_draw():
    wl = W.nano()
    assert wl.num_requests == 256
    assert wl.total_output_tokens == 133_966  # nano-vllm's bench.py with random.seed(0)
    assert all(100 <= r.input_len <= 1024 and 100 <= r.output_len <= 1024 for r in wl.requests)
    assert all(0 <= t <= W.TOKEN_ID_HIGH for r in wl.requests for t in r.prompt_token_ids)


@pytest.mark.parametrize("name", list(W.GENERATORS))
def test_workloads_are_seeded(name):
    a, b, c = (W.build_workload(name, num_requests=40, seed=s) for s in (1, 1, 2))
    assert a.requests == b.requests
    assert a.requests != c.requests or name == "single"


def test_longtail_distribution():
    wl = W.longtail(num_requests=2000, seed=3)
    ins = [r.input_len for r in wl.requests]
    long = [n for n in ins if n >= 2048]
    assert all(128 <= n <= 512 or 2048 <= n <= 4096 for n in ins)
    assert len(long) / len(ins) == pytest.approx(0.1, abs=0.02)
    outs = [r.output_len for r in wl.requests]
    assert min(outs) >= 32 and max(outs) <= 256
    assert statistics.mean(outs) == pytest.approx(144, abs=6)
    assert wl.mode == "online" and wl.concurrency == 32


def test_prefix_workload_shares_four_system_prompts():
    wl = W.prefix(num_requests=200)
    heads = {r.prompt_token_ids[: W.PREFIX_LEN] for r in wl.requests}
    assert len(heads) == 4
    assert all(len(h) == 1024 for h in heads)
    assert all(r.input_len >= 1024 + 128 for r in wl.requests)


def test_length_overrides_and_ranges():
    wl = W.build_workload("cpu-smoke", num_requests=30, input_len=(5, 9), output_len=(4, 4))
    assert all(5 <= r.input_len <= 9 and r.output_len == 4 for r in wl.requests)
    assert W.parse_range("7") == (7, 7)
    for bad in ("0:3", "9:2", "x", "1:y"):
        with pytest.raises(W.WorkloadError):
            W.parse_range(bad)
    with pytest.raises(W.WorkloadError, match="unknown workload 'nope'.*nano"):
        W.build_workload("nope")


# ---------------------------------------------------------------------- JSONL files
def test_jsonl_file(tmp_path):
    path = tmp_path / "traffic.jsonl"
    path.write_text(
        '{"prompt": "hello", "output_len": 3}\n'
        "\n# a comment\n"
        '{"prompt_token_ids": [1, 2, 3], "max_tokens": 5}\n'
        '{"input_len": 12, "output_len": 2}\n'
    )
    wl = W.load_jsonl(path)
    assert [r.output_len for r in wl.requests] == [3, 5, 2]
    assert wl.requests[0].prompt == "hello"
    assert wl.requests[1].prompt_token_ids == (1, 2, 3)
    assert wl.requests[2].input_len == 12
    assert W.build_workload(str(path), num_requests=2).num_requests == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "jsonl:1: not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"prompt": "x"}', "needs output_len"),
        ('{"prompt": "x", "output_len": 0}', "needs output_len"),
        ('{"output_len": 3}', "exactly one of"),
        ('{"prompt": "x", "input_len": 3, "output_len": 3}', "exactly one of"),
        ('{"prompt_token_ids": [1, -2], "output_len": 3}', "prompt_token_ids must be"),
        ('{"input_len": 0, "output_len": 3}', "input_len must be"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(W.WorkloadError, match=message):
        W.load_jsonl(path)


def test_too_long_requests_are_skipped_and_counted(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_len": 10, "output_len": 5}\n{"input_len": 500, "output_len": 5}\n')
    wl, skipped = W.fit_to_model(W.load_jsonl(path), vocab_size=20000, max_model_len=64)
    assert wl.num_requests == 1 and len(skipped) == 1 and "max_model_len 64" in skipped[0]
    with pytest.raises(W.WorkloadError, match="no request"):
        W.fit_to_model(W.load_jsonl(path), vocab_size=20000, max_model_len=8)


# ---------------------------------------------------------------------- matrices
def test_matrix_steps_accumulate(tmp_path):
    cfgs = dict(parse_matrix("baseline,+paged,+continuous"))
    assert cfgs["baseline"] == {
        "allocator": "preallocated",
        "scheduler": "fcfs",
        "kernels": "reference",
    }
    assert cfgs["+continuous"] == {
        "allocator": "paged",
        "scheduler": "continuous",
        "kernels": "reference",
    }
    with pytest.raises(MatrixError, match="unknown configuration '\\+turbo'"):
        parse_matrix("baseline,+turbo")
    toml = tmp_path / "m.toml"
    toml.write_text("[small]\nmax_batch_size = 2\n[big]\nmax_batch_size = 8\n")
    assert parse_matrix(str(toml)) == [
        ("small", {"max_batch_size": 2}),
        ("big", {"max_batch_size": 8}),
    ]
    toml.write_text("x = 1\n")
    with pytest.raises(MatrixError, match="one table per configuration"):
        parse_matrix(str(toml))


# ---------------------------------------------------------------------- end to end (CPU)
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint (no tokenizer: the workloads are token ids)."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("tiny-llama")
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return str(folder)


def _bench(tmp_path, *argv: str) -> dict:
    from pitstop.cli import main

    out = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            *argv,
            "--output",
            str(out),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--kv-cache-gib",
            "0.05",
        ]
    )
    doc = json.loads(out.read_text())
    assert rc == 0, doc
    return doc


FIGURES = (
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
    "req_per_s",
    "output_tok_per_s",
    "total_tok_per_s",
)


def test_offline_end_to_end(tmp_path, tiny_model, capsys):
    doc = _bench(
        tmp_path, "offline", "--workload", "cpu-smoke", "--model", tiny_model,
        "--num-requests", "4", "--input-len", "8:32", "--output-len", "4:8",
    )  # fmt: skip
    (col,) = doc["configs"]
    f = col["figures"]
    assert all(k in f for k in FIGURES)
    assert f["num_requests"] == 4 and 16 <= f["output_tokens"] <= 32
    assert f["ttft_ms"]["p50"] > 0 and f["output_tok_per_s"] > 0
    assert 0 < f["kv_utilization"] <= 1
    assert (
        doc["floor"] is None
        and doc["schema"] == "pitstop.bench/1"
        and doc["device"].startswith("CPU")
    )
    assert len(col["requests"]) == 4
    assert "| TTFT p99 (ms)" in capsys.readouterr().out


def test_online_closed_loop_and_matrix_with_a_failing_column(tmp_path, tiny_model):
    toml = tmp_path / "m.toml"
    toml.write_text(
        '[two]\nmax_batch_size = 2\nmax_prefill_batch = 2\n[eight]\nmax_batch_size = 8\nmax_prefill_batch = 8\n[broken]\nallocator = "nope"\n'
    )
    doc = _bench(
        tmp_path, "online", "--workload", "longtail", "--model", tiny_model, "--concurrency", "2",
        "--num-requests", "6", "--input-len", "8:40", "--output-len", "3:6", "--matrix", str(toml), "--no-warmup",
    )  # fmt: skip
    two, eight, broken = doc["configs"]
    assert two["figures"]["num_requests"] == 6 and eight["figures"]["num_requests"] == 6
    assert "unknown allocator 'nope'" in broken["error"]
    assert doc["workload"]["concurrency"] == 2


def test_online_poisson(tmp_path, tiny_model):
    doc = _bench(
        tmp_path, "online", "--workload", "longtail", "--model", tiny_model, "--request-rate", "50",
        "--num-requests", "5", "--input-len", "8:16", "--output-len", "2:3", "--no-warmup",
    )  # fmt: skip
    recs = doc["configs"][0]["requests"]
    arrivals = sorted(r["arrival"] for r in recs)
    assert arrivals[0] > 0 and len(set(arrivals)) == 5  # Poisson: spread out, not all at the start


def _registered(kind: str, *names: str) -> bool:
    from pitstop.plugin_manager import get_plugin_manager

    have = get_plugin_manager().names(kind)
    return all(n in have for n in names)


@pytest.mark.skipif(
    not (_registered("allocator", "preallocated", "paged") and _registered("scheduler", "fcfs")),
    reason="the preallocated allocator / fcfs scheduler plugins are not registered yet",
)
def test_article_matrix_baseline_paged(tmp_path, tiny_model, capsys):
    doc = _bench(
        tmp_path, "offline", "--workload", "cpu-smoke", "--model", tiny_model, "--matrix", "baseline,+paged",
        "--num-requests", "4", "--input-len", "8:16", "--output-len", "2:4", "--max-model-len", "64",
    )  # fmt: skip
    assert [c["name"] for c in doc["configs"]] == ["baseline", "+paged"]
    assert all("figures" in c for c in doc["configs"])
    assert "| +paged" in capsys.readouterr().out


def test_bad_arguments(tmp_path, tiny_model, capsys):
    from pitstop.cli import main

    assert main(["bench", "offline", "--workload", "nope", "--model", tiny_model]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err
    assert (
        main(["bench", "online", "--concurrency", "0", "--model", tiny_model, "--device", "cpu"])
        == 2
    )
    assert "--concurrency must be >= 1" in capsys.readouterr().err
    assert (
        main(
            [
                "bench",
                "offline",
                "--workload",
                "cpu-smoke",
                "--matrix",
                "+turbo",
                "--model",
                tiny_model,
            ]
        )
        == 2
    )
    assert "unknown configuration '+turbo'" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main(["bench", "offline", "--workload", str(bad), "--model", tiny_model]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from pitstop.bench.plot import plot

    f = figures(RunResult([_record(0, 0.0, [1.0, 2.0]), _record(1, 0.0, [1.5, 2.0])], 0.0, 2.0))
    path = plot([{"name": "a", "figures": f, "ttfts_ms": [1000, 1500]}], tmp_path / "p.png")
    assert path.stat().st_size > 1000
