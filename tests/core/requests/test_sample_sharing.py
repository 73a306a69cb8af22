"""``n`` samples share the prompt's pages whatever finishes first (issue 32): sample 0
finishing on its first token used to free the pages before its siblings were admitted,
so each of them computed the whole prompt again."""

from __future__ import annotations

import pytest
from helpers.models import make_tiny_checkpoint

from pitstop import LLM, SamplingParams
from pitstop.plugins.allocators.paged import PagedAllocator
from pitstop.requests.sequence import Sequence

PROMPT = list(range(5, 105))  # 100 tokens: 6 full pages of 16 before the last prompt token


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("share"), "llama", with_tokenizer=False)
    return LLM(str(folder), device="cpu", max_model_len=256, max_num_pages=128, page_size=16)


@pytest.mark.parametrize("max_tokens", [1, 2, 8])
def test_siblings_compute_only_the_unshared_tail_of_the_prompt(llm: LLM, max_tokens: int) -> None:
    before = llm.engine.stats.prompt_tokens
    params = SamplingParams(n=8, max_tokens=max_tokens, temperature=1.0, seed=3, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    assert [len(o.token_ids) for o in out[0].outputs] == [max_tokens] * 8
    computed = llm.engine.stats.prompt_tokens - before
    assert computed == 100 + 7 * 4, computed  # not 8 x 100
    stats = llm.engine.allocator.stats()
    assert stats.pages_free == stats.num_pages and stats.tokens_shared == 0


def test_shared_samples_match_unshared_ones(llm: LLM) -> None:
    """Sharing changes what is computed, not what is sampled: each sample is the one its
    seed gives alone."""
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    together = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    alone = [
        llm.generate(
            prompt_token_ids=[PROMPT],
            sampling_params=SamplingParams(
                max_tokens=6, temperature=1.0, seed=11 + i, ignore_eos=True
            ),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
        for i in range(4)
    ]
    assert [o.token_ids for o in together[0].outputs] == alone


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams(), max_num_tokens=len(tokens) + 4)


def test_pinned_pages_outlive_the_parent_and_an_abort_releases_them() -> None:
    alloc = PagedAllocator(page_size=4, num_pages=10)
    parent, child, other = _seq(list(range(10))), _seq(list(range(10))), _seq(list(range(10)))
    alloc.allocate(parent)
    parent.num_computed_tokens = 10
    alloc.share_prompt(child, parent)
    alloc.share_prompt(other, parent)
    alloc.free(parent)  # finished on its first token, before the siblings were admitted
    assert alloc.stats().pages_free == 10 - 2  # 2 full prompt pages kept for the siblings
    assert alloc.allocate(child) == 8  # shares them: 8 tokens already computed
    alloc.free(other)  # aborted while waiting: its references go
    alloc.free(child)
    assert alloc.stats().pages_free == 10 and alloc.stats().tokens_shared == 0
