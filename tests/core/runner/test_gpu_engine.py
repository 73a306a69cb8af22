"""The CUDA fast path: fused kernels + CUDA graphs give the reference's greedy tokens (H200)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.models import make_tiny_checkpoint

from pitstop import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [
        torch.randint(3, 49152, (n,), generator=gen).tolist()
        for n in (1, 7, 16, 17, 33, 100, 250, 5, 9)
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("gpu"),
        "qwen3",
        with_tokenizer=False,
        num_hidden_layers=3,
        head_dim=64,
    )


def _llm(folder: Path, **settings) -> LLM:
    return LLM(
        str(folder), device="cuda", dtype="float32", max_model_len=512, kv_cache_gib=0.5, **settings
    )


def _run(folder: Path, **settings) -> list[list[int]]:
    llm = _llm(folder, **settings)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for n in (40, 3, 20, 33, 12, 8, 25, 60, 1)
    ]
    outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=params, use_tqdm=False)
    stats = llm.engine.allocator.stats()
    assert stats.pages_free == stats.num_pages
    return [o.token_ids for o in outs]


def test_fused_with_cuda_graphs_matches_reference(tiny: Path) -> None:
    reference = _run(tiny, kernels="reference")
    graphs = _run(tiny, kernels="fused", fused_precision="fp32")
    eager = _run(tiny, kernels="fused", fused_precision="fp32", enforce_eager=True)
    assert eager == reference
    assert graphs == reference


def test_graphs_are_captured_and_used(tiny: Path) -> None:
    llm = _llm(tiny, kernels="fused")
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.sizes[:4] == [1, 2, 4, 8]
    replays = 0
    original = graphs.run

    def counting(seqs):
        nonlocal replays
        replays += 1
        return original(seqs)

    graphs.run = counting  # type: ignore[method-assign]
    llm.generate(
        prompt_token_ids=[[5, 6, 7]] * 3,
        sampling_params=SamplingParams(max_tokens=8, ignore_eos=True),
    )
    assert replays == 7


def test_chunked_prefix_fused_bf16_dummy_runs() -> None:
    llm = LLM(
        "dummy:qwen3-0.6b",
        device="cuda",
        dtype="bfloat16",
        kernels="fused",
        scheduler="chunked",
        chunk_size=256,  # a budget smaller than the batch: later prompts find the first ones' pages
        allocator="prefix",
        max_model_len=1024,
        kv_cache_gib=2,
    )
    shared = list(range(100, 400))
    outs = llm.generate(
        prompt_token_ids=[shared + [i] * (i + 1) for i in range(1, 9)],
        sampling_params=SamplingParams(
            temperature=0.8, top_k=50, max_tokens=32, ignore_eos=True, seed=1
        ),
        use_tqdm=False,
    )
    assert all(len(o.token_ids) == 32 for o in outs)
    assert llm.engine.allocator.stats().prefix_hit_tokens > 0


@pytest.mark.parametrize("speculative", ["ngram"])
def test_speculative_greedy_on_gpu_equals_plain(tiny: Path, speculative: str) -> None:
    repetitive = [[11, 12, 13, 14, 15] * 8, [7, 8, 9] * 20]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def run(**settings) -> list[list[int]]:
        llm = LLM(
            str(tiny),
            device="cuda",
            dtype="float32",
            max_model_len=512,
            kv_cache_gib=0.5,
            kernels="fused",
            **settings,
        )
        outs = llm.generate(
            prompt_token_ids=repetitive + _prompts()[:3], sampling_params=params, use_tqdm=False
        )
        assert llm.engine.allocator.stats().tokens_held == 0
        return [o.token_ids for o in outs]

    assert run(speculative=speculative, num_speculative_tokens=3) == run()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_with_cuda_graphs(tiny: Path, kv_cache_dtype: str) -> None:
    """An fp8 KV cache (issue 15) under fused kernels and CUDA graphs: every request runs to its
    length and every page comes back (``_run``), and each prompt's first token, computed in
    one prefill, is the reference kernels'. Later tokens are not compared: fp8 rounding
    amplifies the two kernel sets' last-bit differences, so greedy paths may part at near-ties
    (tests/plugins/kernels/test_fused_gpu.py compares the kernels on identical fp8 bytes)."""
    reference = _run(tiny, kernels="reference", kv_cache_dtype=kv_cache_dtype)
    graphs = _run(tiny, kernels="fused", fused_precision="fp32", kv_cache_dtype=kv_cache_dtype)
    assert [len(t) for t in graphs] == [len(t) for t in reference]
    assert [t[0] for t in graphs] == [t[0] for t in reference]
    llm = _llm(tiny, kernels="fused", kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.kv_cache.element_size() == 1
    assert llm.engine.runner.graphs is not None  # the fp8 cache ops are graph-safe
