"""The default configuration bounds every step by a token budget (issue 22, point 2).

With the default scheduler (``chunked``) a prompt near ``max_model_len`` is
prefilled over several steps, none computing more than
``max_num_batched_tokens`` tokens, and an abort issued between two of those
steps takes effect at the next step boundary: no further step computes the
aborted prompt and its pages are free again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.models import make_tiny_checkpoint

from pitstop import LLM, SamplingParams

BUDGET = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bounded"), "llama", with_tokenizer=False)


def _llm(folder: Path, **settings) -> LLM:
    return LLM(
        str(folder),
        device="cpu",
        dtype="float32",
        max_model_len=256,
        page_size=4,
        max_num_pages=128,
        max_num_batched_tokens=BUDGET,
        **settings,
    )


def _record_step_tokens(llm: LLM) -> list[dict[str, int]]:
    """Wrap the runner's launch to record, per step, the tokens each request computes."""
    runner, steps = llm.engine.runner, []
    launch = runner.launch
    ids = {}

    def recording(step):
        live = llm.engine.live_sequences()
        ids.update({sid: seq.request_id for sid, seq in live.items()})
        steps.append({ids[s.seq_id]: len(s.token_ids) for s in step.seqs})
        return launch(step)

    runner.launch = recording
    return steps


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(10, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_long_prompt_is_prefilled_within_the_budget(tiny: Path, overlap: str) -> None:
    llm = _llm(tiny, overlap=overlap)
    assert llm.engine.config.scheduler == "chunked"  # nothing above sets it: the default
    steps = _record_step_tokens(llm)
    short, long = _prompt(9, seed=1), _prompt(240)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[short, long], sampling_params=params, use_tqdm=False)
    assert all(sum(step.values()) <= BUDGET for step in steps)
    short_id, long_id = outs[0].request_id, outs[1].request_id
    chunk_steps = [st for st in steps if st.get(long_id, 0) > 1]
    assert len(chunk_steps) >= 240 // BUDGET
    # the running request keeps decoding while the long prompt is prefilled beside it
    assert sum(1 for st in chunk_steps if st.get(short_id) == 1) >= 3
    # the same tokens as an unbounded run (the old default: continuous, prompt in one step)
    ref = _llm(tiny, overlap=overlap, scheduler="continuous").generate(
        prompt_token_ids=[short, long], sampling_params=params, use_tqdm=False
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_an_abort_takes_effect_at_the_next_step_boundary(tiny: Path) -> None:
    llm = _llm(tiny, overlap="on")
    steps = _record_step_tokens(llm)
    engine = llm.engine
    rid = engine.add_request(None, SamplingParams(max_tokens=8), prompt_token_ids=_prompt(240))
    engine.step()
    engine.step()
    assert all(step.get(rid, 0) <= BUDGET for step in steps) and len(steps) == 2
    engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    for _ in range(2):  # drain whatever was in flight
        engine.step()
    assert all(rid not in step for step in steps[2:])
    stats = engine.allocator.stats()
    assert stats.tokens_held == 0 and stats.pages_free == stats.num_pages
