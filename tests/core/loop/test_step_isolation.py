"""One request's failure inside a step never fails its neighbours (issue 22, in the engine loop).

A step whose launch raises is rerun one sequence at a time; the sequence that
fails alone is finished with reason ``"error"`` (and the error's text), its
pages freed, and every other request's tokens are those of a run without it,
under the serial and the overlapped loop alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.models import make_tiny_checkpoint

from pitstop import LLM, SamplingParams

POISON_SEED = 4242  # the request whose sampling raises (a stand-in for any per-request fault)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("isolation"), "llama", with_tokenizer=False)


def _llm(folder: Path, overlap: str) -> LLM:
    return LLM(
        str(folder),
        device="cpu",
        dtype="float32",
        max_model_len=96,
        page_size=4,
        max_num_pages=64,
        max_batch_size=4,
        max_prefill_batch=4,
        overlap=overlap,
    )


def _poison(llm: LLM) -> None:
    runner = llm.engine.runner
    original = runner._generator

    def generator(seq_id, params):
        if params.seed == POISON_SEED:
            raise ValueError("poisoned request")
        return original(seq_id, params)

    runner._generator = generator


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(10, 40000, (n,), generator=gen).tolist() for n in (5, 12, 30, 7)]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_failing_request_fails_alone(tiny: Path, overlap: str) -> None:
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) for _ in range(4)]
    clean = _llm(tiny, overlap).generate(
        prompt_token_ids=_prompts(), sampling_params=params, use_tqdm=False
    )
    params[2] = SamplingParams(temperature=0.7, seed=POISON_SEED, max_tokens=10, ignore_eos=True)
    llm = _llm(tiny, overlap)
    _poison(llm)
    outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=params, use_tqdm=False)
    assert outs[2].finish_reason == "error"
    assert "poisoned request" in (outs[2].error or "")
    for i in (0, 1, 3):
        assert outs[i].finish_reason == "length"
        assert outs[i].token_ids == clean[i].token_ids
    stats = llm.engine.allocator.stats()
    assert stats.tokens_held == 0 and stats.pages_free == stats.num_pages
    assert llm.engine.stats.step_failures >= 1 and llm.engine.stats.requests_failed == 1


def test_a_request_failing_mid_decode_keeps_the_others_streaming(tiny: Path) -> None:
    """The failure comes at the 4th step (the request is already decoding), under lag."""
    llm = _llm(tiny, "on")
    engine = llm.engine
    for i, ids in enumerate(_prompts()):
        engine.add_request(
            params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            prompt_token_ids=ids,
            request_id=f"r{i}",
        )
    runner = engine.runner
    original = runner.launch
    victim = engine.requests.get("r1").samples[0].seq.seq_id
    calls = {"n": 0}

    def launch(step):
        calls["n"] += 1
        if calls["n"] >= 4 and any(s.seq_id == victim for s in step.seqs):
            raise RuntimeError("device fault for r1")
        return original(step)

    runner.launch = launch
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["r1"].finish_reason == "error"
    assert all(final[r].finish_reason == "length" for r in ("r0", "r2", "r3"))
    assert all(len(final[r].token_ids) == 12 for r in ("r0", "r2", "r3"))
    stats = engine.allocator.stats()
    assert stats.tokens_held == 0 and stats.pages_free == stats.num_pages
