"""Speculative decoding: exact verification, both proposers, and the allocator after rejections."""

from __future__ import annotations

import pytest
import torch
from conftest_models import make_tiny_checkpoint, smollm2_gguf

from pitstop import LLM, SamplingParams
from pitstop.sampling import make_sampling_batch
from pitstop.sequence import Sequence, SequenceStatus
from pitstop.speculative import draft_room, verify

# Prompts with repetition, so that prompt lookup finds drafts; of mixed lengths.
PROMPTS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Hello",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


# ---------------------------------------------------------------- greedy equals plain decoding
@pytest.fixture(scope="module")
def plain_greedy() -> list[list[int]]:
    smollm2_gguf()
    llm = LLM("smollm2-135m", device="cpu", kv_cache_gib=0.25)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), "llama", seed=3))


def _spec_greedy(**kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM("smollm2-135m", device="cpu", kv_cache_gib=0.25, **kwargs)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)], llm


@pytest.mark.slow
def test_ngram_greedy_equals_plain(plain_greedy):
    # prefix + chunked (a small chunk mixes prompt chunks with verification steps)
    out, llm = _spec_greedy(
        speculative="ngram", allocator="prefix", scheduler="chunked", chunk_size=32
    )
    assert out == plain_greedy
    stats = llm.engine.stats
    assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0


@pytest.mark.slow
def test_draft_self_accepts_everything(plain_greedy):
    out, llm = _spec_greedy(speculative="draft", speculative_model="smollm2-135m")
    assert out == plain_greedy
    stats = llm.engine.stats
    assert stats.spec_proposed_tokens > 0
    assert stats.spec_acceptance_rate == 1.0
    assert not llm.engine.proposer._kv_ids  # every draft sequence was released
    assert llm.engine.proposer.allocator.stats().tokens_held == 0


@pytest.mark.slow
def test_tiny_draft_accepts_little_and_stays_exact(plain_greedy, tiny_draft):
    # preallocated + fcfs: truncation inside a reserved region, static batches
    out, llm = _spec_greedy(
        speculative="draft",
        speculative_model=tiny_draft,
        allocator="preallocated",
        scheduler="fcfs",
        max_model_len=256,
        num_speculative_tokens=3,
    )
    assert out == plain_greedy
    stats = llm.engine.stats
    assert stats.spec_proposed_tokens > 0
    assert stats.spec_acceptance_rate < 0.5


# ---------------------------------------------------------------- the distribution is the target's
def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs`` (cells with p = 0 must be empty)."""
    assert counts[probs == 0].sum() == 0, "a token the target excludes was emitted"
    keep = probs > 0
    n = counts.sum()
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2)
    )


VOCAB = 6
TARGET_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 1.5])
DRAFT_LOGITS = torch.tensor([0.0, 2.0, 1.0, 1.0, 0.0, -1.0])


def _processed(logits: torch.Tensor, params: SamplingParams, rows: int) -> torch.Tensor:
    from pitstop.plugins.samplers.standard import StandardSampler

    batch = make_sampling_batch([params] * rows, [None] * rows, "cpu")
    return StandardSampler("cpu").probabilities(logits.expand(rows, -1).clone(), batch)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.7)],
    ids=["temperature", "top-p"],
)
@pytest.mark.parametrize("proposer", ["draft-model", "point-mass"])
def test_verified_tokens_follow_the_target_distribution(params, proposer):
    n, k = 40_000, 2
    gen = torch.Generator().manual_seed(1234)
    p_row = _processed(TARGET_LOGITS, params, 1)[0]
    q_row = _processed(DRAFT_LOGITS, params, 1)[0]
    if proposer == "draft-model":
        drafts = torch.multinomial(q_row.expand(n, -1), k, replacement=True, generator=gen)
        draft_probs = [q_row.expand(k, -1)] * n
    else:  # prompt lookup: a fixed guess (one a top-p target may exclude), no probabilities
        drafts = torch.tensor([[1, 4]]).expand(n, -1)
        draft_probs = [None] * n
    target = p_row.expand(n * (k + 1), -1)
    out = verify(target, drafts.tolist(), draft_probs, [False] * n, [None] * n, gen)
    first = torch.tensor([e[0] for e in out.token_ids])
    counts = torch.bincount(first, minlength=VOCAB).double()
    assert _chi2_pvalue(counts, p_row.double()) > 1e-4
    assert 0 < sum(out.num_accepted) < n * k  # both accepts and rejections happened
    # The test has power: the unverified drafts do not pass it.
    if proposer == "draft-model":
        wrong = torch.bincount(drafts[:, 0], minlength=VOCAB).double()
        assert (p_row[wrong > 0] == 0).any() or _chi2_pvalue(wrong, p_row.double()) < 1e-6


def test_no_drafts_samples_the_target_and_seeded_rows_repeat():
    p_row = _processed(TARGET_LOGITS, SamplingParams(temperature=1.0), 1)[0]
    n = 20_000
    out = verify(
        p_row.expand(n, -1),
        [[]] * n,
        [None] * n,
        [False] * n,
        [None] * n,
        torch.Generator().manual_seed(5),
    )
    counts = torch.bincount(torch.tensor([e[0] for e in out.token_ids]), minlength=VOCAB).double()
    assert _chi2_pvalue(counts, p_row.double()) > 1e-4

    def seeded(other_rows: int) -> list[int]:
        rows = 1 + other_rows
        target = p_row.expand(3 * rows, -1)
        gens = [torch.Generator().manual_seed(7)] + [None] * other_rows
        got = verify(target, [[1, 2]] * rows, [None] * rows, [False] * rows, gens)
        return got.token_ids[0]

    assert seeded(0) == seeded(5)  # a seeded request does not depend on its batch


def test_greedy_verification_is_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), 3).float()  # what probabilities() gives
    out = verify(greedy, [[1, 0]], [None], [True], [None])
    assert out.token_ids == [[1, 0, 2]] and out.num_accepted == [2]
    out = verify(greedy, [[1, 2]], [None], [True], [None])
    assert out.token_ids == [[1, 0]] and out.num_accepted == [1]
    out = verify(greedy, [[2, 2]], [None], [True], [None])
    assert out.token_ids == [[1]] and out.num_accepted == [0]


# ---------------------------------------------------------------- the n-gram proposer
def test_ngram_lookup_cases():
    from pitstop.plugins.speculative.ngram import lookup

    assert lookup([1, 2, 3, 4], k=3, max_n=3) == []  # no earlier occurrence of 4
    assert lookup([5], k=3, max_n=3) == []
    # the most recent occurrence of the suffix wins
    assert lookup([7, 1, 8, 8, 1, 9, 9, 1], k=2, max_n=1) == [9, 9]
    # a longer match wins over a more recent shorter one
    assert lookup([3, 1, 5, 6, 0, 1, 7, 3, 1], k=2, max_n=2) == [5, 6]
    assert lookup([3, 1, 5, 6, 0, 1, 7, 3, 1], k=2, max_n=1) == [7, 3]
    # min_n: a shorter match is not enough
    assert lookup([0, 1, 7, 3, 1], k=2, max_n=3, min_n=2) == []
    # proposals stop at the end of the sequence, overlapping matches allowed
    assert lookup([4, 4, 4], k=5, max_n=2) == [4]


def test_ngram_proposals_respect_max_tokens_and_max_model_len():
    from pitstop.config import EngineConfig
    from pitstop.plugins.speculative.ngram import NgramProposer

    prop = NgramProposer(EngineConfig(model="x", max_model_len=20, prompt_lookup_max=2))
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    seq = Sequence("a", tokens, SamplingParams(max_tokens=100))
    assert prop.propose([seq], 4)[0].token_ids == [3, 4, 5, 6]
    seq = Sequence("b", tokens, SamplingParams(max_tokens=3))
    seq.token_ids += [3]  # one output token: 2 left, so at most one draft (plus the bonus)
    assert draft_room(seq, 4, 20) == 1
    assert prop.propose([seq], 4)[0].token_ids == [4]
    seq = Sequence("c", tokens * 2, SamplingParams(max_tokens=100))  # 18 of 20 tokens
    assert draft_room(seq, 4, 20) == 1
    assert len(prop.propose([seq], 4)[0].token_ids) == 1
    seq = Sequence("d", tokens * 2 + [3], SamplingParams(max_tokens=100))
    assert prop.propose([seq], 4)[0].token_ids == []


# ---------------------------------------------------------------- allocator state
@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=0))


def _run_checking_invariants(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> None:
    """Step the engine; after every step each running decoder holds exactly its computed tokens."""
    engine = llm.engine
    for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt_token_ids=ids, params=sp, request_id=f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.live_sequences().values():
            assert not seq.draft_token_ids
            if seq.status is SequenceStatus.RUNNING and not seq.is_prefill:
                # the invariant after a step (plain or verifying): held == computed == num_tokens - 1
                assert (
                    engine.allocator.num_held_tokens(seq)
                    == seq.num_computed_tokens
                    == seq.num_tokens - 1
                )
    stats = engine.allocator.stats()
    assert stats.tokens_held == 0
    assert stats.pages_free == stats.num_pages
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0


@pytest.mark.parametrize(
    ("allocator", "scheduler"),
    [
        ("paged", "continuous"),
        ("prefix", "chunked"),
        ("preallocated", "continuous"),
        ("paged", "fcfs"),
    ],
)
def test_allocator_state_after_many_accepts_and_rejects(tiny_target, allocator, scheduler):
    llm = LLM(
        tiny_target,
        device="cpu",
        allocator=allocator,
        scheduler=scheduler,
        speculative="ngram",
        num_speculative_tokens=5,
        page_size=4,
        max_num_pages=200,
        max_model_len=128,
        chunk_size=24,
        max_batch_size=6,
        max_prefill_batch=6,
    )
    gen = torch.Generator().manual_seed(0)
    prompts = []
    for i in range(10):
        base = torch.randint(0, 200, (3 + i % 4,), generator=gen).tolist()
        prompts.append(base * (2 + i % 3))  # repetition: drafts to find
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 1.0, max_tokens=20 + 3 * i, ignore_eos=True, seed=i
        )
        for i in range(10)
    ]
    _run_checking_invariants(llm, prompts, params)
    stats = llm.engine.stats
    assert stats.spec_accepted_tokens > 0
    assert stats.spec_accepted_tokens < stats.spec_proposed_tokens
    assert stats.generation_tokens == sum(p.max_tokens for p in params)


@pytest.mark.slow
def test_draft_proposer_state_after_rejections(tiny_target, tiny_draft):
    llm = LLM(
        tiny_target,
        device="cpu",
        speculative="draft",
        speculative_model=tiny_draft,
        num_speculative_tokens=3,
        page_size=4,
        max_num_pages=120,
        max_model_len=128,
        max_batch_size=4,
        max_prefill_batch=4,
    )
    prompts = [[5, 6, 7, 8] * (1 + i) for i in range(6)]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.9, max_tokens=15, ignore_eos=True)
        for i in range(6)
    ]
    _run_checking_invariants(llm, prompts, params)
    proposer = llm.engine.proposer
    assert not proposer._kv_ids
    assert proposer.allocator.stats().tokens_held == 0
    assert proposer.allocator.stats().pages_free == proposer.allocator.num_pages
