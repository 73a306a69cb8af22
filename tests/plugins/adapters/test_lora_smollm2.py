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
import torch
from helpers.models import smollm2_gguf

from pitstop import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")

MAX_TOKENS = 8
TEXTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")


def _greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.slow
def test_smollm2_rows_match_peft_merged(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    base = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "o_proj", "up_proj"],
        init_lora_weights=False,
    )
    trained = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.mul_(5)
    trained.save_pretrained(tmp_path / "adapter")
    del trained
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
        expected = _greedy(base if request is None else merged, prompt)
        assert out.token_ids == expected, f"{request} on {len(prompt)} tokens"
        changed += request is not None and expected != _greedy(base, prompt)
    assert changed >= 1, "the adapter should change the greedy tokens"
