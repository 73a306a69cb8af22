"""Speculative decoding in the core: what a proposer is given, and exact verification.

A step that verifies drafts runs the target model over ``[last token] + k
drafts`` of a sequence and takes logits at all k + 1 positions. Verification
is the rejection sampling of Leviathan et al. (2023) and Chen et al. (2023):
with target probabilities ``p`` (the sampler's processed distribution, after
temperature, top-k, top-p and min-p) and draft probabilities ``q``,

- draft ``d_i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``,
  in order, stopping at the first rejection;
- at the first rejection the next token is drawn from
  ``normalize(max(0, p_i - q_i))``;
- when all k drafts are accepted a bonus token is drawn from ``p_{k+1}``.

The emitted tokens then follow the target distribution exactly. A proposer
without probabilities (``ngram``) proposes point masses: ``q_i`` is one-hot
on ``d_i``, so ``d_i`` is kept with probability ``p_i(d_i)`` and a rejection
draws from ``p_i`` with ``d_i`` removed. Greedy rows keep drafts while they
equal the argmax and then emit the argmax: token for token what plain greedy
decoding gives.

Every sequence of a step goes through :func:`verify` together (a sequence
with no drafts is the k = 0 case: one token drawn from ``p``), with one
device-to-host copy for the whole step.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import attrs
import torch

from pitstop.sampling import exponential_race, is_greedy, make_generator, make_sampling_batch

if TYPE_CHECKING:
    from pitstop.plugin_manager import PluginManager
    from pitstop.protocols import Sampler
    from pitstop.runner import SeqInput
    from pitstop.sequence import Sequence


@attrs.frozen
class ProposerContext:
    """What the engine hands a proposer's factory, besides the config."""

    plugins: PluginManager  # to build a draft model's kernels, sampler, allocator
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # the target model's vocabulary (a draft must share its tokenizer)
    page_size: int
    num_pages: int  # pages of the target's KV cache (a draft cache may follow it)
    tokenizer: Any = None  # the target's tokenizer (pitstop.tokenizer.Tokenizer) or None


def draft_room(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many drafts ``seq`` may verify this step: at most ``k``, and never past its limits.

    A step that verifies ``n`` drafts may emit ``n + 1`` tokens, so ``n`` stays
    below the tokens left before ``max_tokens`` and before ``max_model_len``.
    """
    left_output = seq.sampling_params.max_tokens - seq.num_output_tokens
    left_context = max_model_len - seq.num_tokens
    return max(0, min(k, left_output - 1, left_context - 1))


@attrs.frozen
class Verified:
    """What verification emitted for each sequence: its accepted drafts, then one more token."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[float]] | None = None


def _point_masses(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(rows).scatter_(1, tokens.unsqueeze(1), 1.0)


def verify(
    target_probs: torch.Tensor,
    draft_token_ids: Seq[Seq[int]],
    draft_probs: Seq[torch.Tensor | None],
    greedy: Seq[bool],
    generators: Seq[torch.Generator | None],
    shared_generator: torch.Generator | None = None,
    raw_logits: torch.Tensor | None = None,
) -> Verified:
    """Rejection-sample a batch of drafts against the target's probabilities.

    ``target_probs`` is ``[R, V]``: sequence ``i`` owns ``len(draft_token_ids[i]) + 1``
    consecutive rows (the distributions after its last token and after each
    draft). ``draft_probs[i]`` is ``[k_i, V]`` (the draft distribution each
    draft was sampled from) or None for point masses. Greedy rows accept by
    argmax. A seeded row draws only from ``generators[i]``; the others from
    ``shared_generator`` (None: torch's default). With ``raw_logits`` (the
    ``[R, V]`` logits) the log-probabilities of the emitted tokens come back too.
    """
    device = target_probs.device
    num_rows = target_probs.shape[0]
    ks = [len(d) for d in draft_token_ids]
    offsets: list[int] = []
    total = 0
    for k in ks:
        offsets.append(total)
        total += k + 1
    if total != num_rows:
        raise ValueError(f"{num_rows} target rows for drafts needing {total} (k + 1 per sequence)")
    num_seqs = len(ks)
    kmax = max(ks, default=0)
    p = target_probs.float()

    # The flat draft token of every row (the last row of a sequence has none: 0, masked).
    flat_drafts = [0] * num_rows
    has_draft = [False] * num_rows
    for off, d in zip(offsets, draft_token_ids, strict=True):
        flat_drafts[off : off + len(d)] = d
        has_draft[off : off + len(d)] = [True] * len(d)
    drafts = torch.tensor(flat_drafts, dtype=torch.int64, device=device)
    draft_mask = torch.tensor(has_draft, dtype=torch.bool, device=device)

    # q as rows aligned with p: a draft's distribution, a point mass, or zeros on a last row.
    q = _point_masses(p, drafts) * draft_mask.unsqueeze(1)
    for off, d, probs in zip(offsets, draft_token_ids, draft_probs, strict=True):
        if probs is not None and len(d):
            q[off : off + len(d)] = probs[: len(d)].to(device, torch.float32)

    greedy_rows = torch.tensor(
        [g for g, k in zip(greedy, ks, strict=True) for _ in range(k + 1)],
        dtype=torch.bool,
        device=device,
    )
    uniform = _uniform(num_rows, offsets, ks, generators, shared_generator, device)
    p_d = p.gather(1, drafts.unsqueeze(1)).squeeze(1)
    q_d = q.gather(1, drafts.unsqueeze(1)).squeeze(1)
    accept = torch.where(greedy_rows, drafts == p.argmax(dim=-1), uniform * q_d < p_d) & draft_mask

    # Accepted drafts per sequence: the leading run of accepts among its k rows.
    num_accepted = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    if kmax:
        index = torch.tensor(
            [
                off + j if j < k else num_rows
                for off, k in zip(offsets, ks, strict=True)
                for j in range(kmax)
            ],
            dtype=torch.int64,
            device=device,
        ).view(num_seqs, kmax)
        padded = torch.cat([accept, accept.new_zeros(1)])[index]
        num_accepted = padded.long().cumprod(dim=1).sum(dim=1)
    final_rows = torch.tensor(offsets, dtype=torch.int64, device=device) + num_accepted

    # The next token: from max(0, p - q) at a rejection, from p for the bonus (q is zero there).
    p_final = p[final_rows]
    residual = (p_final - q[final_rows]).clamp_(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_final)
    next_tokens = _draw(residual, generators, shared_generator)
    greedy_seqs = torch.tensor(list(greedy), dtype=torch.bool, device=device)
    next_tokens = torch.where(greedy_seqs, p_final.argmax(dim=-1), next_tokens)

    accepted_host = num_accepted.tolist()
    next_host = next_tokens.tolist()
    emitted = [
        list(d[:a]) + [t] for d, a, t in zip(draft_token_ids, accepted_host, next_host, strict=True)
    ]
    logprobs = None
    if raw_logits is not None:
        rows = [off + j for off, e in zip(offsets, emitted, strict=True) for j in range(len(e))]
        toks = [t for e in emitted for t in e]
        lp = torch.log_softmax(raw_logits.float()[torch.tensor(rows, device=device)], dim=-1)
        values = lp.gather(1, torch.tensor(toks, device=device).unsqueeze(1)).squeeze(1).tolist()
        logprobs = []
        i = 0
        for e in emitted:
            logprobs.append(values[i : i + len(e)])
            i += len(e)
    return Verified(emitted, accepted_host, logprobs)


def _uniform(
    num_rows: int,
    offsets: list[int],
    ks: list[int],
    generators: Seq[torch.Generator | None],
    shared: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """One U[0, 1) draw per row; a seeded sequence's rows from its own generator only."""
    u = torch.rand(num_rows, generator=shared, device=device)
    for off, k, gen in zip(offsets, ks, generators, strict=True):
        if gen is not None and k:
            u[off : off + k] = torch.rand(k, generator=gen, device=device)
    return u


def _draw(
    probs: torch.Tensor, generators: Seq[torch.Generator | None], shared: torch.Generator | None
) -> torch.Tensor:
    """One token per row by the exponential race (as the standard sampler draws)."""
    return exponential_race(probs, generators, shared)


class DraftVerifier:
    """Samples a runner step in which some sequences verify drafts (called by the runner)."""

    def __init__(self, sampler: Sampler, device: torch.device, seed: int = 0) -> None:
        self.sampler = sampler
        self.generator = make_generator(seed, device)
        self.device = device

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: Seq[SeqInput],
        generators: Seq[torch.Generator | None],
    ) -> Verified:
        """``logits`` has ``seq.num_logits`` rows per sequence in ``seqs`` (the sampled ones, in order)."""
        from pitstop.sampling_params import SamplingParams

        params = [s.params or SamplingParams() for s in seqs]
        row_params = [p for s, p in zip(seqs, params, strict=True) for _ in range(s.num_logits)]
        row_gens = [g for s, g in zip(seqs, generators, strict=True) for _ in range(s.num_logits)]
        batch = make_sampling_batch(row_params, row_gens, self.device)
        probs = self.sampler.probabilities(logits, batch)
        return verify(
            probs,
            [s.token_ids[len(s.token_ids) - s.num_logits + 1 :] for s in seqs],
            [s.draft_probs for s in seqs],
            [is_greedy(p) for p in params],
            generators,
            self.generator,
            raw_logits=logits if batch.want_logprobs else None,
        )
