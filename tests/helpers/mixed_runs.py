"""The engine's mixed run, shared by the strategy tests of the engine and of kv_cache_dtype:
nine prompts (three with a shared prefix) that make a small cache preempt, every allocator x
scheduler, and the check that a run gives the expected tokens and frees every page."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from pitstop import LLM, SamplingParams
from pitstop.plugin_system.plugin_manager import get_plugin_manager


def strategy_combinations() -> list[tuple[str, str]]:
    pm = get_plugin_manager()
    allocators = [a for a in ("preallocated", "paged", "prefix") if a in pm.names("allocator")]
    schedulers = [s for s in ("fcfs", "continuous", "chunked") if s in pm.names("scheduler")]
    return list(itertools.product(allocators, schedulers))


def mixed_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(
        3, 49152, (40,), generator=gen
    ).tolist()  # a shared prefix for the prefix cache
    prompts = [
        torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (3, 30, 70, 9, 120, 1)
    ]
    return prompts + [shared + [5, 6, 7], shared + [8, 9], shared]


def mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for n in (20, 5, 33, 1, 12, 25, 16, 16, 16)
    ]


def small_cache_llm(folder: Path, allocator: str, scheduler: str, **settings) -> LLM:
    """An engine whose small cache (24 pages of 16 tokens) makes the paged allocators preempt
    on the mixed prompts; preallocated holds one region of max_model_len at a time."""
    return LLM(
        str(folder),
        device="cpu",
        allocator=allocator,
        scheduler=scheduler,
        max_num_pages=24,
        max_model_len=256,
        max_batch_size=4,
        max_prefill_batch=2,
        chunk_size=48,
        **settings,
    )


def check_mixed_run(llm: LLM, expected: list[list[int]]) -> None:
    """The mixed prompts' greedy tokens are ``expected``, and no page is left held
    (with ``prefix``, freed pages may stay cached, so only ``tokens_held`` is checked)."""
    outs = llm.generate(
        prompt_token_ids=mixed_prompts(), sampling_params=mixed_params(), use_tqdm=False
    )
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.allocator.stats()
    assert stats.tokens_held == 0
    if llm.engine.config.allocator != "prefix":
        assert stats.pages_free == stats.num_pages
