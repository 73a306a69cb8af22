"""The ``tiered`` allocator in the engine: the same greedy tokens with the host tier as without,
on the real SmolLM2 (fp32, CPU), with a device cache so small that histories are evicted to the
host and come back from it."""

from __future__ import annotations

import random

import pytest
from helpers.models import smollm2_gguf

from pitstop import LLM, SamplingParams

# 24 pages of 8 tokens: a conversation's history and the other traffic cannot both stay.
SMALL_CACHE = dict(device="cpu", dtype="float32", page_size=8, max_num_pages=24, max_model_len=192)


def _turns() -> list[list[int]]:
    """Three turns of one conversation, each after an unrelated long prompt that evicts it."""
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    a1 = ids(60)
    a2 = a1 + ids(20)
    return [a1, ids(180), a2, ids(180), a2 + ids(15)]


def _run(allocator: str, **options) -> tuple[list[list[int]], dict[str, float]]:
    llm = LLM("smollm2-135m", allocator=allocator, **SMALL_CACHE, **options)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = []
    for prompt in _turns():  # one at a time: each after the last one ended
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        outs.append(list(out[0].outputs[0].token_ids))
    return outs, dict(llm.engine.allocator.stats().counters)


@pytest.mark.slow
def test_greedy_tokens_are_the_same_with_the_host_tier_on_and_off() -> None:
    smollm2_gguf()
    off, _ = _run("prefix")
    # poisoned: a page the tier hands out and fails to fill reads as NaN, not as old KV
    on, counters = _run("tiered", kv_offloading_size=0.1, poison_memory=True)
    assert on == off
    # both later turns hit the host (the first pages of the last may still be on the device)
    assert counters["host_hit_tokens"] >= 56 + 64, counters
    assert counters["host_hit_tokens"] + counters["device_hit_tokens"] == 56 + 80, counters
    assert counters["bytes_to_device"] > 0 and counters["bytes_to_host"] > 0
