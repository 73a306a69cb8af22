"""`pitstop bench --peer vllm` on a CPU: the generated model files, the arguments, and the
whole pipeline (spawn, parse, table, cleanup, error paths) against a stand-in vLLM.

``tests/apps/bench/fake_vllm`` is put on the peer's ``PYTHONPATH`` (``PITSTOP_VLLM_PYTHONPATH``), as
``/tmp/vsite`` is on the H200: its ``LLM`` records the arguments it was given and
generates zeros, its ``vllm serve`` speaks the OpenAI completions API. The pitstop side
runs a tiny random checkpoint on the CPU.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
from helpers.models import (
    make_tiny_checkpoint,
    transformers_smollm2,
    transformers_smollm2_tokenizer,
)

from pitstop.bench import vllm_peer
from pitstop.bench.peers import PeerRun, run_peer
from pitstop.bench.report import RunResult, repeat_summary
from pitstop.bench.vllm_model import hf_config_dict, vllm_model, write_dummy_folder
from pitstop.bench.vllm_server import serve_flags
from pitstop.bench.workloads import BenchRequest, Workload, build_workload
from pitstop.config import EngineConfig
from pitstop.entrypoints.cli import main
from pitstop.entrypoints.engine_args import engine_config
from pitstop.plugin_system.plugin_manager import get_plugin_manager

FAKE_VLLM = Path(__file__).parent / "fake_vllm"
PRESETS = get_plugin_manager().presets()
REQUESTS = [(12, 6), (20, 9), (7, 5), (30, 4), (9, 8)]  # (prompt tokens, output tokens)
ENGINE = ["--device", "cpu", "--kv-cache-gib", "0.02", "--max-model-len", "128"]


# ---------------------------------------------------------------------- the model files
def _rope(hf: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, the other rope parameters or None) of a transformers 4 or 5 config."""
    params = getattr(hf, "rope_parameters", None)
    if params is None:
        params = {"rope_theta": hf.rope_theta, **(hf.rope_scaling or {})}
    params = dict(params)
    theta = params.pop("rope_theta")
    if params.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), params


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_dummy_config_json_is_the_preset_for_transformers_and_pitstop(
    preset: str, tmp_path: Path
) -> None:
    from transformers import AutoConfig

    from pitstop.plugins.model_sources.huggingface.checkpoint import read_hf_config

    mc = PRESETS[preset]
    folder = write_dummy_folder(mc, tmp_path / preset)
    hf = AutoConfig.from_pretrained(str(folder))
    assert hf.architectures == [mc.architecture]
    assert hf.hidden_size == mc.hidden_size
    assert hf.intermediate_size == mc.intermediate_size
    assert hf.num_hidden_layers == mc.num_layers
    assert hf.num_attention_heads == mc.num_heads
    assert hf.num_key_value_heads == mc.num_kv_heads
    assert hf.head_dim == mc.head_size
    assert hf.vocab_size == mc.vocab_size
    assert hf.max_position_embeddings == mc.max_position_embeddings
    assert hf.tie_word_embeddings == mc.tie_word_embeddings
    assert hf.rms_norm_eps == mc.rms_norm_eps
    assert hf.hidden_act == "silu"
    theta, scaling = _rope(hf)
    assert theta == mc.rope_theta
    assert scaling == (dict(mc.rope_scaling) if mc.rope_scaling else None)
    # and pitstop's own reader gives back exactly the preset
    assert read_hf_config(folder) == mc


def test_dummy_preset_is_random_weights_without_a_tokenizer(tmp_path: Path) -> None:
    mc = PRESETS["qwen3-0.6b"]
    vm = vllm_model("dummy:qwen3-0.6b", mc, tmp_path)
    assert vm.load_format == "dummy" and vm.skip_tokenizer_init and vm.tokenizer is None
    assert json.loads((Path(vm.model) / "config.json").read_text()) == hf_config_dict(mc)
    args = vm.engine_args()
    assert args == {"model": vm.model, "load_format": "dummy", "skip_tokenizer_init": True}
    tok = tmp_path / "tok"
    tok.mkdir()
    with_tok = vllm_model("dummy:qwen3-0.6b", mc, tmp_path, tokenizer=str(tok))
    assert not with_tok.skip_tokenizer_init and with_tok.tokenizer == str(tok.resolve())


def test_a_checkpoint_or_gguf_is_passed_as_it_is(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    mc = PRESETS["qwen3-0.6b"]
    assert vllm_model(str(gguf), mc, tmp_path).engine_args() == {"model": str(gguf.resolve())}
    assert vllm_model(str(tmp_path), mc, tmp_path).engine_args() == {"model": str(tmp_path)}


@pytest.mark.slow
def test_a_gguf_with_speculation_becomes_the_same_checkpoint(tmp_path: Path) -> None:
    """vLLM 0.24 reads a GGUF's config without its GGUF reader once a speculative_config is
    set: the peer then hands it transformers' checkpoint of the same weights, written once."""
    import torch
    import transformers

    from pitstop.plugins.model_sources.gguf.source import smollm2_path

    gguf = smollm2_path()
    mc = PRESETS["qwen3-0.6b"]  # the shape is not used for a file
    vm = vllm_model(str(gguf), mc, tmp_path, as_checkpoint=True, dtype="float32")
    folder = Path(vm.model)
    assert vm.engine_args() == {"model": str(folder)} and folder.parent == tmp_path
    assert "written by transformers" in vm.description and str(gguf.resolve()) in vm.description
    assert transformers.AutoConfig.from_pretrained(folder).model_type == "llama"
    ids = transformers.AutoTokenizer.from_pretrained(folder)("The capital of France is")
    want = transformers_smollm2_tokenizer(gguf)  # transformers' own reads of the GGUF (shared)
    assert ids["input_ids"] == want("The capital of France is")["input_ids"]
    x = torch.tensor([ids["input_ids"]])
    ref = transformers_smollm2(gguf)
    got = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(ref(x).logits, got(x).logits)
    stamp = (folder / "config.json").stat().st_mtime_ns
    again = vllm_model(str(gguf), mc, tmp_path, as_checkpoint=True, dtype="float32")
    assert again.model == vm.model and (folder / "config.json").stat().st_mtime_ns == stamp
    # without speculation the file is passed as it is
    assert vllm_model(str(gguf), mc, tmp_path).engine_args() == {"model": str(gguf.resolve())}


# ---------------------------------------------------------------------- the arguments
def _config(**kw: Any) -> EngineConfig:
    return engine_config(model="dummy:qwen3-8b", **kw)


def test_engine_args_share_pitstops_limits_and_prefix_caching_follows_the_workload() -> None:
    longtail = build_workload("longtail", num_requests=4)
    prefix = build_workload("prefix", num_requests=4)
    cfg = _config(max_batch_size=64, gpu_memory_utilization=0.85, kv_cache_dtype="fp8_e4m3", seed=3)
    args = vllm_peer.engine_args(
        {"model": "m"}, cfg, longtail, dtype="bfloat16", max_model_len=4352
    )
    assert args == {
        "model": "m",
        "dtype": "bfloat16",
        "max_model_len": 4352,
        "max_num_seqs": 64,
        "gpu_memory_utilization": 0.85,
        "kv_cache_dtype": "fp8_e4m3",
        "seed": 3,
        "enable_prefix_caching": False,  # the timed passes repeat the warm-up's prompts
    }
    on = vllm_peer.engine_args({"model": "m"}, _config(), prefix, dtype="bfloat16", max_model_len=9)
    assert on["enable_prefix_caching"] is True and on["kv_cache_dtype"] == "auto"
    extra = vllm_peer.parse_peer_args(["enforce-eager=true", "enable_prefix_caching=true", "x=abc"])
    assert extra == {"enforce_eager": True, "enable_prefix_caching": True, "x": "abc"}
    both = vllm_peer.engine_args(
        {"model": "m"}, _config(), longtail, dtype="f", max_model_len=9, extra=extra
    )
    assert both["enable_prefix_caching"] is True and both["enforce_eager"] is True
    with pytest.raises(vllm_peer.VllmPeerError, match="KEY=VALUE"):
        vllm_peer.parse_peer_args(["no-value"])
    assert "quantization" not in both  # dense weights: vLLM's default
    fp8 = vllm_peer.engine_args(
        {"model": "m"}, _config(weights="fp8"), longtail, dtype="bfloat16", max_model_len=9
    )
    assert fp8["quantization"] == "fp8"  # weights=fp8 is vLLM's --quantization fp8


def test_serve_flags() -> None:
    args = {
        "model": "/m",
        "max_num_seqs": 64,
        "skip_tokenizer_init": True,
        "enable_prefix_caching": False,
        "speculative_config": {"method": "ngram"},
        "tokenizer": None,
    }
    assert serve_flags(args) == [
        "--max-num-seqs",
        "64",
        "--skip-tokenizer-init",
        "--no-enable-prefix-caching",
        "--speculative-config",
        '{"method": "ngram"}',
    ]


def test_repeat_summary_gives_median_and_range() -> None:
    runs = [{"output_tok_per_s": v, "ttft_ms": {"p50": math.nan}} for v in (3.0, 1.0, 2.0)]
    summary = repeat_summary(runs)
    assert summary["runs"] == 3
    assert summary["output_tok_per_s"]["median"] == 2.0
    assert (summary["output_tok_per_s"]["min"], summary["output_tok_per_s"]["max"]) == (1.0, 3.0)
    assert "ttft_ms.p50" not in summary  # every value NaN: no figure


# ---------------------------------------------------------------------- the pipeline
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3", with_tokenizer=False)


@pytest.fixture
def workload_file(tmp_path: Path) -> Path:
    path = tmp_path / "wl.jsonl"
    path.write_text(
        "".join(json.dumps({"input_len": i, "output_len": o}) + "\n" for i, o in REQUESTS)
    )
    return path


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in vLLM on the peer's PYTHONPATH; returns the file it records calls to."""
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv(vllm_peer.ENV_PYTHONPATH, str(FAKE_VLLM))
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    monkeypatch.setenv("FAKE_VLLM_PIDS", str(tmp_path / "pids"))
    monkeypatch.delenv("FAKE_VLLM_FAIL", raising=False)
    monkeypatch.delenv(vllm_peer.ENV_PYTHON, raising=False)
    return record


def _records(path: Path, kind: str) -> list[Any]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [r["value"] for r in map(json.loads, lines) if r["kind"] == kind]


def _bench(mode: str, model: Path, wl: Path, out: Path, *extra: str) -> tuple[int, dict]:
    code = main(
        [
            "bench",
            mode,
            "--workload",
            str(wl),
            "--model",
            str(model),
            *ENGINE,
            "--peer",
            "vllm",
            "--output",
            str(out),
            *extra,
        ]
    )
    return code, json.loads(out.read_text())


def _gone(pids_file: Path, timeout: float = 10.0) -> bool:
    """Whether every process whose pid the fake server wrote has exited (or is a zombie)."""
    pids = [int(p) for p in pids_file.read_text().split()]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_without_vllm_the_peer_fails_clearly_and_pitstop_still_runs(
    tiny: Path, workload_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    monkeypatch.delenv(vllm_peer.ENV_PYTHONPATH, raising=False)
    monkeypatch.delenv(vllm_peer.ENV_PYTHON, raising=False)
    code, doc = _bench("offline", tiny, workload_file, tmp_path / "r.json", "--no-warmup")
    assert code == 3  # the peer asked for failed; the pitstop column is still there
    assert doc["configs"][0]["figures"]["output_tokens"] == sum(o for _, o in REQUESTS)
    error = doc["peer"]["error"]
    assert "vLLM is not installed" in error and "pip install vllm" in error
    assert vllm_peer.ENV_PYTHONPATH in error and "vllm_setup.sh" in error
    out = capsys.readouterr()
    assert "peer:vllm" in out.out and "failed" in out.out


@pytest.mark.slow
def test_offline_peer_runs_the_same_requests_in_its_own_process(
    tiny: Path, workload_file: Path, tmp_path: Path, fake_vllm: Path, capsys: Any
) -> None:
    code, doc = _bench("offline", tiny, workload_file, tmp_path / "r.json", "--repeats", "2")
    assert code == 0, doc["peer"]
    peer = doc["peer"]
    assert peer["backend"] == "vllm" and peer["version"] == "0.24.0+fake"
    assert peer["config"]["model"] == str(tiny) and peer["config"]["enable_prefix_caching"] is False
    assert peer["config"]["max_model_len"] == 128 and peer["config"]["dtype"] == "float32"
    assert peer["resolved_config"].startswith("FakeVllmConfig")
    figs = peer["figures"]
    assert figs["output_tokens"] == sum(o for _, o in REQUESTS) and figs["num_requests"] == 5
    assert figs["repeats"]["runs"] == 2 and figs["output_tok_per_s"] > 0
    assert doc["configs"][0]["figures"]["repeats"]["runs"] == 2
    assert set(peer["ratio"]["pitstop"]) >= {"output_tok_per_s", "output_tok_per_s_median"}
    (llm_args,) = _records(fake_vllm, "llm")
    assert llm_args == peer["config"]
    calls = _records(fake_vllm, "generate")
    assert len(calls) == 3  # the warm-up, then 2 timed passes
    assert [n for n, _ in calls[1]] == [i for i, _ in REQUESTS]  # the very same prompts
    assert [p["max_tokens"] for _, p in calls[1]] == [o for _, o in REQUESTS]
    assert all(p["ignore_eos"] and p["temperature"] == 0.0 for _, p in calls[1])
    assert [p["max_tokens"] for _, p in calls[0]] == [min(o, 8) for _, o in REQUESTS[:4]]
    assert Path(peer["log"]).is_file()
    out = capsys.readouterr().out
    assert any(line.startswith("| output tok/s ") for line in out.splitlines())
    assert "pitstop[pitstop] / peer:vllm" in out and "vllm 0.24.0+fake" in out


@pytest.mark.slow
def test_offline_peer_takes_the_same_lora_adapters_in_turn(
    tiny: Path, workload_file: Path, tmp_path: Path, fake_vllm: Path
) -> None:
    """``--lora-adapters 2 --peer vllm`` (issue 47): vLLM gets ``enable_lora`` with room for
    both adapters at their rank, and the requests take the very adapter folders pitstop's
    column read, in the same turn (request k the k mod 2-th)."""
    code, doc = _bench(
        "offline", tiny, workload_file, tmp_path / "r.json", "--no-warmup", "--lora-adapters", "2"
    )
    assert code == 0, doc["peer"]
    peer = doc["peer"]
    assert peer["lora_adapters"] == 2 and doc["configs"][0]["lora_adapters"] == 2
    (llm_args,) = _records(fake_vllm, "llm")
    assert llm_args["enable_lora"] is True
    assert llm_args["max_loras"] == 2 and llm_args["max_lora_rank"] == 16
    (given,) = _records(fake_vllm, "lora")
    assert [lora_id for _, lora_id, _ in given] == [1, 2, 1, 2, 1]
    for _, _, path in given:
        assert (Path(path) / "adapter_config.json").is_file()
        assert (Path(path) / "adapter_model.safetensors").is_file()


def test_lora_adapters_with_an_online_peer_are_refused(
    tiny: Path, workload_file: Path, tmp_path: Path, capsys: Any
) -> None:
    """Only the offline vLLM peer takes adapters: online, it would serve the base model."""
    argv = ["bench", "online", "--workload", str(workload_file), "--model", str(tiny), *ENGINE]
    code = main([*argv, "--peer", "vllm", "--lora-adapters", "1"])
    assert code == 2
    assert "only the offline vLLM peer takes them" in capsys.readouterr().err


def _peer_run(workload: Workload, model: str, tmp_path: Path) -> PeerRun:
    import argparse

    args = argparse.Namespace(bench_mode="offline", output=str(tmp_path / "r.json"), peer_arg=None)
    return PeerRun(
        args=args,
        config=EngineConfig(model=model),
        workload=workload,
        model_config=PRESETS[model.removeprefix("dummy:")],
        device="cpu",
        max_model_len=4096,
        concurrency=None,
        request_rate=None,
        repeats=1,
        warmup=False,
        floor=None,
        skipped=[],
    )


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_dummy_preset_reaches_vllm_as_a_config_json_and_dummy_weights(
    preset: str, tmp_path: Path, fake_vllm: Path
) -> None:
    wl = Workload(name="t", requests=[BenchRequest(3, [1, 2, 3]), BenchRequest(2, [4, 5])])
    col, notes = run_peer("vllm", _peer_run(wl, f"dummy:{preset}", tmp_path))
    assert "error" not in col, col.get("error")
    (llm_args,) = _records(fake_vllm, "llm")
    assert llm_args["load_format"] == "dummy" and llm_args["skip_tokenizer_init"] is True
    config = json.loads((Path(llm_args["model"]) / "config.json").read_text())
    assert config == hf_config_dict(PRESETS[preset], dtype="float32")
    assert col["figures"]["output_tokens"] == 5
    assert any("no per-token times" in n for n in notes)


@pytest.mark.parametrize(
    ("fail", "message"),
    [
        ("load", "cannot load the model"),
        ("crash", "exited with status 9 before it reported anything"),
    ],
)
def test_offline_failures_name_the_cause_and_the_log(
    fail: str, message: str, tmp_path: Path, fake_vllm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_FAIL", fail)
    wl = Workload(name="t", requests=[BenchRequest(3, [1, 2, 3])])
    col, _ = run_peer("vllm", _peer_run(wl, "dummy:qwen3-0.6b", tmp_path))
    assert message in col["error"] and "vllm-offline.log" in col["error"]
    assert "figures" not in col


@pytest.mark.slow
def test_online_peer_serves_on_a_loopback_port_and_stops_afterwards(
    tiny: Path, workload_file: Path, tmp_path: Path, fake_vllm: Path
) -> None:
    code, doc = _bench(
        "online", tiny, workload_file, tmp_path / "r.json", "--concurrency", "2", "--repeats", "2"
    )
    assert code == 0, doc["peer"]
    peer = doc["peer"]
    assert peer["url"].startswith("http://127.0.0.1:") and peer["startup_s"] >= 0
    figs = peer["figures"]
    assert figs["output_tokens"] == sum(o for _, o in REQUESTS) and figs["failed_requests"] == 0
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert figs[key]["p50"] > 0
    assert figs["prefix_hit_rate"] == pytest.approx(0.25)  # from the server's /metrics
    assert figs["repeats"]["runs"] == 2
    (argv,) = _records(fake_vllm, "serve")
    assert argv[:2] == ["serve", str(tiny)]
    flags = " ".join(argv)
    assert "--max-model-len 128" in flags and "--max-num-seqs 256" in flags
    assert "--no-enable-prefix-caching" in flags and "--host 127.0.0.1" in flags
    assert _gone(tmp_path / "pids"), "vllm serve (or a child of it) outlived the bench"


@pytest.mark.parametrize(
    ("fail", "message"),
    [
        ("serve", "exited with status 1 before it answered /health"),
        ("hang", "did not answer"),
    ],
)
def test_a_server_that_does_not_come_up_is_a_clear_error_and_is_stopped(
    fail: str,
    message: str,
    tmp_path: Path,
    fake_vllm: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAKE_VLLM_FAIL", fail)
    monkeypatch.setenv("PITSTOP_VLLM_START_TIMEOUT", "3")
    wl = Workload(name="t", requests=[BenchRequest(3, [1, 2, 3])], mode="online")
    run = _peer_run(wl, "dummy:qwen3-0.6b", tmp_path)
    run.args.bench_mode = "online"
    start = time.monotonic()
    col, _ = run_peer("vllm", attrs.evolve(run, concurrency=1))
    assert message in col["error"] and "vllm-online.log" in col["error"]
    if fail == "serve":
        assert "fake vLLM cannot serve this model" in col["error"]  # the log's tail is quoted
    assert time.monotonic() - start < 60
    assert _gone(tmp_path / "pids")


def test_run_results_of_the_worker_carry_counts_and_wall_time() -> None:
    from pitstop.bench.vllm_peer import _run_result

    run = _run_result(
        {
            "wall_s": 2.0,
            "input_lens": [3, 5],
            "output_lens": [4, 6],
            "cached_prompt_tokens": [0, 4],
        },
        0,
    )
    assert isinstance(run, RunResult) and run.wall_s == 2.0
    assert [r.output_len for r in run.records] == [4, 6]
    assert run.prefix_hit_rate == pytest.approx(0.5)


def test_the_worker_imports_nothing_of_pitstop() -> None:
    source = (Path(vllm_peer.__file__).with_name("vllm_worker.py")).read_text()
    assert "pitstop" not in "".join(
        line for line in source.splitlines() if line.startswith(("import", "from"))
    )
    assert os.access(vllm_peer.WORKER, os.R_OK)


def test_a_module_vllm_needs_is_named_with_its_fix() -> None:
    """vLLM 0.24's server imports ``model_hosting_container_standards``, which its offline path
    does not: the H200 run of 2026-12-02 stopped on it, and the error named vLLM instead."""
    from pitstop.bench.vllm_peer import INSTALL_HINT, missing_module_hint

    log = (
        'File "/tmp/vsite/vllm/entrypoints/serve/sagemaker/api_router.py", line 8\n'
        "ModuleNotFoundError: No module named 'model_hosting_container_standards'"
    )
    fix = missing_module_hint(log)
    assert "'model_hosting_container_standards'" in fix
    assert "pip install model-hosting-container-standards" in fix
    assert missing_module_hint("ModuleNotFoundError: No module named 'vllm'") == INSTALL_HINT
    assert missing_module_hint("RuntimeError: CUDA out of memory") == ""
