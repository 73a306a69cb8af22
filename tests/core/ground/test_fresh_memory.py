"""Issue 27: an engine's output depends on nothing a previous step, engine or process left behind.

The bug: on CUDA the runner profiles its memory with one made-up step before
the KV cache exists. That step's sequence had id 0 and default sampling
parameters (temperature 1), and the runner cached its sampling batch under
the key ``(0,)``; the first real request of a fresh process is also sequence
0, so it sampled with the profile's parameters and gave a wrong first token.
Whether the profile step had one sequence (and so collided) depended on the
step token budget. These tests run the same mechanism on the CPU, and check
the poisoned-memory mode (:mod:`pitstop.ground.poison`) that the whole suite runs
under.
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from helpers.models import make_tiny_checkpoint, smollm2_gguf

from pitstop import LLM, SamplingParams
from pitstop.config import EngineConfig
from pitstop.env_flags import poison_from_env
from pitstop.ground.poison import (
    INT_SENTINEL,
    FreshPageTracker,
    PoisonedReadError,
    poison_,
)
from pitstop.ground.step import SeqInput, StepInput

RIVERS = [
    {"role": "user", "content": "Name three rivers in South America and one fact about each."}
]
GREEDY6 = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", num_hidden_layers=2)


def _tiny_llm(folder, **settings) -> LLM:
    return LLM(str(folder), device="cpu", kv_cache_gib=0.02, max_model_len=128, **settings)


def test_the_suite_runs_with_poisoned_memory() -> None:
    """conftest turns the mode on for every engine of the suite (and its subprocesses)."""
    assert poison_from_env()
    assert EngineConfig().poison_memory is True
    assert EngineConfig(poison_memory=False).poison_memory is False


def test_smollm2_after_the_profile_step_gives_transformers_tokens() -> None:
    """The issue's prompt: a fresh engine that ran the memory-profile step first (as every CUDA
    engine does) still answers 33, 30, 9860, 3992, 42, 378 (transformers, float32)."""
    smollm2_gguf()
    llm = LLM(
        "smollm2-135m", device="cpu", dtype="float32", kernels="reference", chunk_size=16,
        kv_cache_gib=0.05, max_model_len=512,
    )  # fmt: skip
    runner = llm.engine.runner
    runner.init_kv_cache(4)  # the profile's own small cache, as plan_num_pages does on CUDA
    runner.run_synthetic_step(1, 64, 4)
    runner.init_kv_cache(llm.engine.allocator.num_pages)
    out = llm.chat(RIVERS, GREEDY6)
    assert out[0].outputs[0].token_ids == [33, 30, 9860, 3992, 42, 378]


def test_a_synthetic_step_leaves_no_per_sequence_state(tiny) -> None:
    llm = _tiny_llm(tiny)
    runner = llm.engine.runner
    before = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=GREEDY6)[0].token_ids
    runner.run_synthetic_step(2, 32, 2)
    assert runner.sampling.batch_cache is None or all(
        i >= 0 for i in runner.sampling.batch_cache[0]
    )
    assert all(i >= 0 for i in runner.sampling.last_rows)
    after = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=GREEDY6)[0].token_ids
    assert after == before


def test_a_finished_sequence_id_takes_none_of_its_sampling_state_along(tiny) -> None:
    """The runner's sampling-batch cache is keyed by sequence ids: a sequence that finished
    must not lend its (temperature 1) batch to a later sequence of the same id."""
    llm = _tiny_llm(tiny)
    runner = llm.engine.runner
    seed_one = SamplingParams(temperature=1.0, seed=3)
    hot = StepInput([SeqInput(0, [5, 6, 7, 8], 0, [0], True, seed_one)])
    greedy = SamplingParams(temperature=0)
    cold_step = StepInput([SeqInput(0, [5, 6, 7, 8], 0, [0], True, greedy)], finished_seq_ids=[0])
    runner.execute(hot)
    got = runner.execute(cold_step).results[0].token_ids
    runner.forget_sequences([0])
    fresh = _tiny_llm(tiny).engine.runner
    want = fresh.execute(StepInput([SeqInput(0, [5, 6, 7, 8], 0, [0], True, greedy)]))
    assert got == want.results[0].token_ids


def test_every_engine_numbers_its_sequences_from_zero(tiny) -> None:
    """Sequence ids are per engine: an engine built after others behaves as in a fresh process."""
    for _ in range(2):
        llm = _tiny_llm(tiny)
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY6)
        assert llm.engine.requests.new_seq_id() == 1


def test_the_kv_cache_and_runner_buffers_start_poisoned(tiny) -> None:
    llm = _tiny_llm(tiny)
    runner = llm.engine.runner
    assert runner.kv_cache is not None and bool(torch.isnan(runner.kv_cache).all())
    assert bool((runner.last_sampled == INT_SENTINEL).all())
    off = _tiny_llm(tiny, poison_memory=False).engine.runner
    assert off.kv_cache is not None and not bool(torch.isnan(off.kv_cache).any())


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int32]
)
def test_poison_fills_every_dtype_with_something_unusable(dtype: torch.dtype) -> None:
    t = poison_(torch.zeros(8, dtype=dtype))
    if dtype.is_floating_point:
        assert all(math.isnan(x) for x in t.float().tolist())
    else:
        assert t.tolist() == [INT_SENTINEL] * 8


def test_pages_handed_out_again_are_poisoned_again(tiny) -> None:
    """A page freed by one request and given to the next is NaN before the next writes it;
    pages served from the prefix cache keep their contents."""
    llm = _tiny_llm(tiny, allocator="prefix")
    runner = llm.engine.runner
    poisoned: list[list[int]] = []
    original = runner.poison_pages
    runner.poison_pages = lambda pages: (poisoned.append(list(pages)), original(pages))[1]
    prompt = list(range(3, 3 + 40))  # two full pages and a partial one at page_size 16
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY6)[0].token_ids
    handed_first = sorted(p for step in poisoned for p in step)
    assert len(handed_first) == 3
    poisoned.clear()
    second = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY6)[0].token_ids
    handed_second = sorted(p for step in poisoned for p in step)
    # the two full prompt pages are prefix hits, kept; the partial one and the output's are new
    assert len(handed_second) == 1
    assert second == first


def test_fresh_page_tracker_reports_pages_past_the_cached_prefix() -> None:
    class Allocator:
        page_size = 4
        num_pages = 10

        def __init__(self) -> None:
            self.tables: dict[int, list[int]] = {}

        def allocate(self, seq) -> int:
            self.tables[seq] = [7, 8, 9]
            return 5  # one full page and one token of the next are cached

        def append(self, seq, n: int) -> None:
            self.tables[seq].append(2)

        def block_table(self, seq) -> list[int]:
            return self.tables.get(seq, [])

        def stats(self) -> str:
            return "forwarded"

    seen: list[int] = []
    tracker = FreshPageTracker(Allocator(), seen.extend)
    assert tracker.allocate(1) == 5
    assert seen == [9]  # page 8 holds a cached token: kept
    tracker.append(1, 4)
    assert seen == [9, 2]
    assert tracker.stats() == "forwarded"


def test_a_read_of_unwritten_kv_is_an_error_not_a_token(tiny) -> None:
    """A step whose attention reaches past what was written (here: a context longer than the
    tokens stored) gives NaN logits under poison, and the runner flags its sequence."""
    llm = _tiny_llm(tiny)
    runner = llm.engine.runner
    greedy = SamplingParams(temperature=0)
    # positions 0..3 were never stored: a decode at position 4 attends to them
    step = StepInput([SeqInput(0, [9], 4, [0], True, greedy)])
    assert runner.execute(step).poisoned_seq_ids == {0}
    assert "never wrote" in str(PoisonedReadError(0))


def test_a_poisoned_read_fails_its_request_with_an_error(tiny, monkeypatch) -> None:
    """Through the engine: the request finishes with reason "error", never with a token."""
    llm = _tiny_llm(tiny)
    runner = llm.engine.runner
    model_forward = runner.model.forward

    def leaky(ids, rotary, kv_cache, meta):
        # a broken kernel set: attends to one key slot more than the context has
        longer = [c + 1 for c in meta.context_lens_list]
        meta = attrs.evolve(meta, context_lens=meta.context_lens + 1, context_lens_list=longer)
        return model_forward(ids, rotary, kv_cache, meta)

    monkeypatch.setattr(runner.model, "forward", leaky)
    out = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=GREEDY6)[0]
    assert out.outputs[0].finish_reason == "error"
