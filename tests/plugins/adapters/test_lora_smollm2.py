"""The ``lora`` plugin on the real SmolLM2-135M: rows with and without an adapter in one batch
give PEFT's ``merge_and_unload()`` tokens (fp32, greedy).

The adapter is made at test time with ``peft`` on transformers' own load of the shipped GGUF
(dequantized to fp32: the same tensors pitstop loads, tests/core/loading/test_weights.py),
rank 8 on q, v, o and up of every layer. Slow (about 30 s on two cores).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from helpers.checkpoints import greedy_continuation, save_random_lora
from helpers.models import smollm2_gguf, transformers_smollm2

from pitstop import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")

MAX_TOKENS = 8
TEXTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")


@pytest.mark.slow
def test_smollm2_rows_match_peft_merged(tmp_path: Path) -> None:
    gguf = smollm2_gguf()
    base = transformers_smollm2()  # shared: PEFT wraps a deep copy of it below
    targets = ["q_proj", "v_proj", "o_proj", "up_proj"]
    save_random_lora(
        base, tmp_path / "adapter", rank=8, alpha=16, targets=targets, seed=0, b_scale=5
    )
    merged = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter"))
    merged = merged.merge_and_unload().eval()

    llm = LLM(
        str(gguf),
        device="cpu",
        dtype="float32",
        kv_cache_gib=0.05,
        max_model_len=256,
        poison_memory=True,
        enable_lora=True,
        max_lora_rank=8,
    )
    adapter = LoRARequest("smol", 1, str(tmp_path / "adapter"))
    prompts = [llm.engine.tokenizer.encode(t) for t in TEXTS]
    requests = [adapter, None, adapter]
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        lora_request=requests,
        use_tqdm=False,
    )
    changed = 0
    for prompt, request, out in zip(prompts, requests, outs, strict=True):
        expected = greedy_continuation(base if request is None else merged, prompt, MAX_TOKENS)
        assert out.token_ids == expected, f"{request} on {len(prompt)} tokens"
        changed += request is not None and expected != greedy_continuation(base, prompt, MAX_TOKENS)
    assert changed >= 1, "the adapter should change the greedy tokens"
