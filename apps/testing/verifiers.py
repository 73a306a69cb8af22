"""The verifier check: what any draft verifier must emit, on batches Hypothesis draws.

A verifier (``speculative_verifier=NAME``, :mod:`pitstop.plugin_system.verifier`) decides
which drafts a step keeps. Whatever its acceptance rule, :func:`check_verifier` holds it
to what the engine relies on, for a drawn batch of sequences with 0 to ``max_drafts``
drafts each, greedy and sampled rows mixed:

- each sequence emits its first ``a`` drafts (``0 <= a <= k``) and then one token, and
  the packed result says ``a``;
- a greedy row is exact: it keeps drafts while they equal the argmax of their row, then
  emits that row's argmax (token for token what plain greedy decoding gives);
- a sampled row never emits a token its target distribution excludes (here: outside its
  row's top-2, with ``top_k=2``);
- log-probabilities, when a row asks for them, are those of the emitted tokens under the
  raw logits.

How a third party runs it::

    from pitstop.testing.verifiers import check_verifier

    def test_my_verifier():
        plugins = get_plugin_manager()
        sampler = plugins.create("sampler", "standard", EngineConfig(), "cpu")
        check_verifier(plugins.create("verifier", "mine", EngineConfig(), sampler, "cpu"))
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

from pitstop.testing._hypothesis import suite_settings

__all__ = ["check_verifier"]


def check_verifier(
    verifier: Any, *, max_examples: int = 30, vocab_size: int = 12, max_drafts: int = 4
) -> None:
    """Draw batches of drafted sequences and check what ``verifier`` emits for each (CPU)."""
    from pitstop.entrypoints.sampling_params import SamplingParams
    from pitstop.ground.step import SeqInput

    greedy = SamplingParams(temperature=0, logprobs=0)
    sampled = SamplingParams(temperature=1.0, top_k=2)
    row = st.tuples(st.booleans(), st.lists(st.integers(0, vocab_size - 1), max_size=max_drafts))

    @suite_settings(max_examples)
    @given(st.lists(row, min_size=1, max_size=4), st.integers(0, 2**31 - 1))
    def run(rows: list[tuple[bool, list[int]]], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(sum(len(d) + 1 for _, d in rows), vocab_size, generator=gen)
        seqs = [
            SeqInput(
                seq_id=i,
                token_ids=[0, *drafts],
                start_pos=0,
                block_table=[],
                sample=True,
                params=greedy if is_greedy else sampled,
                num_logits=len(drafts) + 1,
            )
            for i, (is_greedy, drafts) in enumerate(rows)
        ]
        got = verifier(logits, seqs, [None] * len(seqs)).to_host()
        start = 0
        for (is_greedy, drafts), tokens, a in zip(
            rows, got.token_ids, got.num_accepted, strict=True
        ):
            own = logits[start : start + len(drafts) + 1]
            assert 0 <= a <= len(drafts) and len(tokens) == a + 1, (drafts, tokens, a)
            assert tokens[:a] == drafts[:a], (drafts, tokens)
            if is_greedy:
                best = own.argmax(dim=-1).tolist()
                kept = next((i for i, d in enumerate(drafts) if d != best[i]), len(drafts))
                assert (a, tokens[a]) == (kept, best[kept]), (drafts, best, tokens)
            else:
                top2 = own.topk(2, dim=-1).indices.tolist()
                assert all(t in top2[i] for i, t in enumerate(tokens)), (top2, tokens)
            start += len(drafts) + 1
        if got.logprobs is not None:
            start = 0
            for (_, drafts), tokens, lps in zip(rows, got.token_ids, got.logprobs, strict=True):
                lp = torch.log_softmax(logits[start : start + len(tokens)], dim=-1)
                want = [lp[i, t].item() for i, t in enumerate(tokens)]
                close = all(
                    math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-5)
                    for x, y in zip(lps, want, strict=True)
                )
                assert close, (lps, want)
                start += len(drafts) + 1

    run()
