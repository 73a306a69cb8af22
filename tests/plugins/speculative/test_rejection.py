"""The ``rejection`` verifier: verified tokens follow the target distribution, greedy rows take
the argmax, and the packed result carries tokens and log-probabilities."""

from __future__ import annotations

import pytest
import torch

from pitstop import SamplingParams
from pitstop.plugins.samplers.batch import make_sampling_batch
from pitstop.plugins.speculative.rejection import verify, verify_on_device


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


def test_verify_on_device_packs_tokens_and_logprobs():
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(dim=-1).tolist()
    # sequence 0: two drafts, the first right and the second wrong; sequence 1: no drafts;
    # sequence 2: three drafts, all right (a bonus token follows)
    drafts = [[best[0], (best[1] + 1) % VOCAB], [], [best[4], best[5], best[6]]]
    with pytest.raises(ValueError, match="target rows"):
        verify_on_device(logits, drafts, [None] * 3, [True] * 3, [None] * 3)
    logits = torch.cat([logits, torch.randn(1, VOCAB)])
    best = logits.argmax(dim=-1).tolist()
    drafts = [[best[0], (best[1] + 1) % VOCAB], [], [best[4], best[5], best[6]]]
    out = verify_on_device(logits, drafts, [None] * 3, [True] * 3, [None] * 3, raw_logits=logits)
    got = out.to_host()
    assert got.num_accepted == [1, 0, 3]
    assert got.token_ids == [[best[0], best[1]], [best[3]], [best[4], best[5], best[6], best[7]]]
    lp = torch.log_softmax(logits, dim=-1)
    rows = [[0, 1], [3], [4, 5, 6, 7]]
    for toks, rs, lps in zip(got.token_ids, rows, got.logprobs, strict=True):
        assert lps == pytest.approx([lp[r, t].item() for r, t in zip(rs, toks, strict=True)])


def test_rejection_passes_the_verifier_check() -> None:
    from pitstop.config import EngineConfig
    from pitstop.plugin_system.plugin_manager import get_plugin_manager
    from pitstop.testing.verifiers import check_verifier

    plugins = get_plugin_manager()
    sampler = plugins.create("sampler", "standard", EngineConfig(), "cpu")
    check_verifier(plugins.create("verifier", "rejection", EngineConfig(), sampler, "cpu"))
