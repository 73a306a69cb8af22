"""The engine end to end: token-for-token equal to transformers, and equal across strategies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.checkpoints import prefill_logits
from helpers.mixed_runs import (
    check_mixed_run,
    mixed_params,
    mixed_prompts,
    small_cache_llm,
    strategy_combinations,
)
from helpers.models import make_tiny_checkpoint, smollm2_gguf, transformers_smollm2

from pitstop import LLM, EngineConfig, SamplingParams

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers greater than ten, separated by commas:",
    "In 1905, Albert Einstein published four papers that changed physics. The first one explained",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n# Now a function that checks whether a number is prime:\n",
]


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    smollm2_gguf()
    return LLM("smollm2-135m", device="cpu", dtype="float32", kv_cache_gib=0.25)


@pytest.fixture(scope="module")
def hf_smollm2():
    return transformers_smollm2()  # shared, read only


def _hf_greedy(model, ids: list[int], n: int, eos: set[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )[0, len(ids) :].tolist()
    for i, t in enumerate(out):  # transformers pads after EOS; pitstop stops at it
        if t in eos:
            return out[: i + 1]
    return out


def test_smollm2_greedy_matches_transformers(smollm2: LLM, hf_smollm2) -> None:
    tok = smollm2.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(PROMPTS), "prompts should have different lengths"
    outs = smollm2.generate(
        prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=32)
    )
    eos = set(smollm2.engine.eos_token_ids)
    for prompt_ids, out in zip(ids, outs, strict=True):
        expected = _hf_greedy(hf_smollm2, prompt_ids, 32, eos)
        assert out.token_ids == expected, f"prompt {tok.decode(prompt_ids)!r}"
        assert len(out.token_ids) == 32 or out.finish_reason == "stop"


def test_smollm2_chat_is_coherent(smollm2: LLM) -> None:
    out = smollm2.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


# ---------------------------------------------------------------- tiny checkpoints


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_tiny_checkpoint_logits_and_greedy_match_transformers(
    tmp_path: Path, arch: str, tied: bool
) -> None:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_checkpoint(tmp_path, arch, tie_word_embeddings=tied)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    llm = LLM(str(folder), device="cpu", kv_cache_gib=0.01, max_model_len=256)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (1, 5, 17, 40)]

    # logits of every prompt position, all prompts prefilled in one step
    for p, mine in zip(prompts, prefill_logits(llm, prompts), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        rel = ((mine - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-4, f"{arch}: relative logit error {rel:.2e}"

    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
            )[0, len(p) :].tolist()
        assert out.token_ids == ref


# ---------------------------------------------------------------- every strategy, same tokens


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama), device="cpu", kv_cache_gib=0.05, max_model_len=256)
    return [
        o.token_ids
        for o in llm.generate(prompt_token_ids=mixed_prompts(), sampling_params=mixed_params())
    ]


@pytest.mark.parametrize(("allocator", "scheduler"), strategy_combinations())
def test_every_allocator_and_scheduler_gives_the_same_greedy_tokens(
    tiny_llama: Path, tiny_reference: list[list[int]], allocator: str, scheduler: str
) -> None:
    check_mixed_run(small_cache_llm(tiny_llama, allocator, scheduler), tiny_reference)


def test_preemption_is_logged_with_the_fix(tiny_llama: Path, caplog) -> None:
    """The first preemption warns, naming the settings that avoid it."""
    llm = LLM(
        str(tiny_llama),
        device="cpu",
        allocator="paged",
        scheduler="continuous",
        max_num_pages=17,
        max_model_len=256,
        max_batch_size=9,
        max_prefill_batch=2,
    )
    with caplog.at_level("WARNING", logger="pitstop.loop.engine"):
        llm.generate(
            prompt_token_ids=mixed_prompts(), sampling_params=mixed_params(), use_tqdm=False
        )
    assert llm.engine.stats.preemptions > 0
    warnings = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
    assert warnings and "gpu_memory_utilization" in warnings[0]
    assert len(warnings) <= 1 + llm.engine.stats.preemptions // 50


def test_engine_config_object_and_keywords_agree(tiny_llama: Path) -> None:
    a = LLM(config=EngineConfig(model=str(tiny_llama), device="cpu", kv_cache_gib=0.01))
    b = LLM(str(tiny_llama), device="cpu", kv_cache_gib=0.01)
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert (
        a.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=p)[0].token_ids
        == b.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=p)[0].token_ids
    )
