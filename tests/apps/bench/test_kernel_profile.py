"""The kernel profile of issue 29 (``benchmarks/kernel_profile.py``) on CPU.

The trace arithmetic (kernel times, per-step differences, categories, the
ceiling fractions) on made-up traces; pitstop's side end to end on a tiny
checkpoint (CPU operators stand in for kernels); vLLM's side through the fake
vLLM of ``tests/apps/bench/fake_vllm`` (its made-up kernels have known per-step times) and,
without vLLM, the clear error.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from helpers.models import make_tiny_checkpoint

from pitstop.bench import vllm_peer
from pitstop.bench.kernel_profile import (
    SCENARIOS,
    Scenario,
    category,
    category_table,
    kernel_times,
    markdown,
    per_step,
    profile_pitstop,
    profile_vllm,
    read_trace,
    roofline,
)
from pitstop.plugin_system.plugin_manager import get_plugin_manager

FAKE_VLLM = Path(__file__).parent / "fake_vllm"
SMALL = Scenario("small-decode", batch=2, prompt_len=16, decode_steps=4)


def _event(name: str, dur: float, ts: float, cat: str = "kernel", tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_kernel_names_fall_into_categories() -> None:
    assert category("nvjet_tst_128x64_64x5_1x2_h_bz_NNT") == "gemm"
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert category("_paged_decode_attention_kernel") == "attention"
    assert category("flash_fwd_splitkv_kernel") == "attention"
    # pitstop's own paged kernels (measured on the H200: a prefill once fell into "copy")
    assert category("_prefill_kernel") == "attention"
    assert category("_decode_reduce_kernel") == "attention"
    assert category("_rope_store_kernel") == "rotary"
    assert category("reshape_and_cache_flash_kernel") == "kv store"
    assert category("_fused_add_rmsnorm_kernel") == "norm"
    assert category("rotary_embedding_kernel") == "rotary"
    assert category("act_and_mul_kernel<silu>") == "activation"
    assert category("radixSortKVInPlace") == "sampler"
    assert category("Memcpy HtoD (Pinned -> Device)") == "copy, index, elementwise"
    assert category("something_new") == "other"


def test_gpu_events_are_summed_and_cpu_ops_only_when_there_are_none() -> None:
    gpu = [_event("k1", 10, 0), _event("k1", 5, 20), _event("k2", 7, 30, cat="gpu_memcpy")]
    cpu = [_event("aten::mm", 100, 0, cat="cpu_op"), _event("aten::mm", 40, 10, cat="cpu_op")]
    assert kernel_times(gpu + cpu) == {"k1": (15.0, 2), "k2": (7.0, 1)}
    # no GPU: the outermost CPU operators (the nested mm inside the first is not counted twice)
    assert kernel_times(cpu) == {"aten::mm": (100.0, 1)}


def test_per_step_is_the_difference_over_the_steps() -> None:
    longer = {"gemm": (500.0, 5), "prefill": (50.0, 1), "decode": (80.0, 4)}
    shorter = {"gemm": (100.0, 1), "prefill": (50.0, 1)}
    assert per_step(longer, shorter, 4) == {"gemm": (100.0, 1.0), "decode": (20.0, 1.0)}
    with pytest.raises(ValueError, match="steps must be >= 1"):
        per_step(longer, shorter, 0)


def test_roofline_fractions_use_the_model_shape() -> None:
    mc = get_plugin_manager().presets()["llama3-8b"]
    scenario = SCENARIOS["single-decode"]
    moved, frac = roofline("gemm", 4000.0, mc, scenario)  # 4 ms for the weights of an 8B model
    assert moved.endswith("GB weights") and 0.8 < frac < 1.0  # ~16 GB at 4.23 TB/s is ~3.8 ms
    assert roofline("norm", 10.0, mc, scenario) == ("", None)
    # one 2,048-token prompt's causal attention: 1.1 TFLOP; in 5 ms, 220 TFLOP/s of 792
    moved, frac = roofline("attention", 5000.0, mc, SCENARIOS["prefill-2048"])
    assert moved == "1.10 TFLOP" and frac == pytest.approx(0.278, abs=0.01)


def test_trace_files_read_plain_and_gzipped(tmp_path: Path) -> None:
    import gzip

    data = {"traceEvents": [_event("k", 3, 0)]}
    (tmp_path / "a.json").write_text(json.dumps(data))
    with gzip.open(tmp_path / "b.json.gz", "wt") as f:
        json.dump(data, f)
    assert read_trace(tmp_path / "a.json") == read_trace(tmp_path / "b.json.gz")


def test_pitstop_side_profiles_a_tiny_model_on_cpu(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path, "llama")
    kernels, mc = profile_pitstop(
        str(folder), SMALL, tmp_path / "traces", device="cpu", kernels="reference"
    )
    assert mc.vocab_size > 0 and kernels
    assert all(us > 0 for us, _ in kernels.values())
    assert (tmp_path / "traces" / "pitstop-1.json").exists()
    assert (tmp_path / "traces" / "pitstop-5.json").exists()
    table = markdown(category_table({"pitstop": kernels}, mc, SMALL), ["pitstop"], "µs per step")
    assert table.splitlines()[-1].startswith("| total |")


def test_pitstop_side_with_lora_adapters_profiles_their_work(tmp_path: Path) -> None:
    """``--lora-adapters N`` (issue 47): the requests take random adapters, so a step runs the
    adapters' shrink and expand on top of the base model's ops."""
    folder = make_tiny_checkpoint(tmp_path, "llama")
    run = functools.partial(profile_pitstop, str(folder), SMALL, device="cpu", kernels="reference")
    base, _ = run(tmp_path / "base")
    adapted, _ = run(tmp_path / "lora", lora_adapters=2)
    launches = {
        name: sum(n for _, n in k.values()) for name, k in (("base", base), ("lora", adapted))
    }
    assert launches["lora"] > launches["base"]


def test_warm_prompts_profile_decode_steps_from_cached_prompts(tmp_path: Path) -> None:
    """``--warm-prompts``: the prompts run once before the profile with the prefix allocator,
    and both profiled runs serve every prompt's full pages from the cache; a cache that cannot
    hold the batch's prompts, a prefill scenario or another allocator is refused by name."""
    folder = make_tiny_checkpoint(tmp_path, "llama")
    scenario = Scenario("warm-decode", batch=4, prompt_len=40, decode_steps=4)
    run = functools.partial(
        profile_pitstop, str(folder), scenario, device="cpu", kernels="reference"
    )
    kernels, _ = run(tmp_path / "warm", warm_prompts=True)
    assert kernels and all(us > 0 for us, _ in kernels.values())
    with pytest.raises(ValueError, match="does not hold 4 prompts of 40 tokens"):
        run(tmp_path / "small", warm_prompts=True, max_num_pages=8)
    prefill = Scenario("warm-prefill", batch=2, prompt_len=40, decode_steps=0)
    with pytest.raises(ValueError, match="apply to a decode scenario"):
        profile_pitstop(str(folder), prefill, tmp_path / "p", warm_prompts=True, device="cpu")
    with pytest.raises(ValueError, match="need the prefix allocator, not 'paged'"):
        run(tmp_path / "paged", warm_prompts=True, allocator="paged")


def test_vllm_side_reads_vllms_own_traces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_peer.ENV_PYTHONPATH, str(FAKE_VLLM))
    mc = get_plugin_manager().presets()["qwen3-0.6b"]
    kernels, version = profile_vllm("dummy:qwen3-0.6b", mc, SMALL, tmp_path)
    assert version == "0.24.0+fake"
    # the fake's kernels: a 100 µs GEMM and a 20 µs decode attention per step, prefill cancels
    assert kernels == {"nvjet_gemm": (100.0, 1.0), "paged_decode_attention": (20.0, 1.0)}
    job = json.loads((tmp_path / "vllm_profile_worker-job.json").read_text())
    assert job["max_tokens"] == [1, 5] and job["llm_kwargs"]["enable_prefix_caching"] is False
    assert job["llm_kwargs"]["load_format"] == "dummy"
    rows = category_table({"pitstop": {"my_gemm": (150.0, 1.0)}, "vllm": kernels}, mc, SMALL)
    assert [r["category"] for r in rows] == ["gemm", "attention", "total"]
    assert rows[0]["pitstop"] == 150.0 and rows[0]["vllm"] == 100.0


def test_without_vllm_the_profile_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(vllm_peer.ENV_PYTHONPATH, raising=False)
    mc = get_plugin_manager().presets()["qwen3-0.6b"]
    with pytest.raises(vllm_peer.VllmPeerError, match="failed at import.*No module named 'vllm'"):
        profile_vllm("dummy:qwen3-0.6b", mc, SMALL, tmp_path)


def test_a_prefill_scenario_is_per_prompt_and_a_decode_one_per_step() -> None:
    prefill = Scenario("p", batch=4, prompt_len=16, decode_steps=0)
    assert prefill.max_tokens == (1,) and SMALL.max_tokens == (1, 5)
    assert prefill.per_unit([{"k": (400.0, 8)}]) == {"k": (100.0, 2.0)}
    assert SMALL.per_unit([{"k": (100.0, 1)}, {"k": (500.0, 5)}]) == {"k": (100.0, 1.0)}
