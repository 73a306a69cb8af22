"""The ``rejection`` verifier: exact verification of speculative drafts by rejection sampling.

With target probabilities ``p`` (the sampler's processed distribution, after
temperature, top-k, top-p and min-p) and draft probabilities ``q``
(Leviathan et al. 2023, Chen et al. 2023):

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

Every sequence of a step goes through :func:`verify_on_device` together (a
sequence with no drafts is the k = 0 case: one token drawn from ``p``): the
host's inputs go over in a few asynchronous copies, nothing is read back, and
the runner brings the packed result home in one copy for the whole step.
The protocol: :mod:`pitstop.plugin_system.verifier`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pitstop.ground.transfer import to_device
from pitstop.plugin_system.hookspecs import hookimpl
from pitstop.plugin_system.sampler import make_generator
from pitstop.plugin_system.verifier import DeviceVerified, Verified
from pitstop.plugins.samplers.batch import is_greedy
from pitstop.plugins.samplers.draws import exponential_race
from pitstop.requests.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pitstop.ground.step import SeqInput
    from pitstop.plugin_system.protocols import Sampler


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
    """Rejection-sample a batch of drafts against the target's probabilities; results on the host.

    The same as :func:`verify_on_device` followed by one copy to the host.
    """
    return verify_on_device(
        target_probs,
        draft_token_ids,
        draft_probs,
        greedy,
        generators,
        shared_generator,
        raw_logits,
    ).to_host()


def verify_on_device(
    target_probs: torch.Tensor,
    draft_token_ids: Seq[Seq[int]],
    draft_probs: Seq[torch.Tensor | None],
    greedy: Seq[bool],
    generators: Seq[torch.Generator | None],
    shared_generator: torch.Generator | None = None,
    raw_logits: torch.Tensor | None = None,
    device_drafts: Seq[torch.Tensor | None] | None = None,
) -> DeviceVerified:
    """Rejection-sample a batch of drafts against the target's probabilities, without a sync.

    ``target_probs`` is ``[R, V]``: sequence ``i`` owns ``len(draft_token_ids[i]) + 1``
    consecutive rows (the distributions after its last token and after each
    draft). ``draft_probs[i]`` is ``[k_i, V]`` (the draft distribution each
    draft was sampled from) or None for point masses. Greedy rows accept by
    argmax (for an all-greedy batch ``target_probs`` may be the raw logits:
    only their argmax is read). A seeded row draws only from ``generators[i]``; the others from
    ``shared_generator`` (None: torch's default). With ``raw_logits`` (the
    ``[R, V]`` logits) the log-probabilities of the emitted tokens come back too.
    ``device_drafts[i]``, when given, holds sequence ``i``'s drafts on the device
    (``draft_token_ids[i]`` are then placeholders that only give their count).
    The host's inputs travel in one host-to-device copy; nothing is read back.
    """
    device = target_probs.device
    num_rows = target_probs.shape[0]
    ks = np.fromiter((len(d) for d in draft_token_ids), dtype=np.int64, count=len(draft_token_ids))
    offsets = np.concatenate([[0], np.cumsum(ks + 1)[:-1]]).astype(np.int64) if len(ks) else ks
    total = int((ks + 1).sum())
    if total != num_rows:
        raise ValueError(f"{num_rows} target rows for drafts needing {total} (k + 1 per sequence)")
    num_seqs = len(ks)
    kmax = int(ks.max()) if num_seqs else 0
    p = target_probs.float()

    # Per sequence, its drafts padded to kmax ([S, kmax]) and which of them exist.
    padded = np.zeros((num_seqs, kmax + 1), dtype=np.int64)
    for i, d in enumerate(draft_token_ids):
        if len(d):
            padded[i, : len(d)] = d
    col = np.arange(kmax + 1)
    exists = col[None, :] < ks[:, None]  # [S, kmax + 1]; the last column never exists
    row_of = offsets[:, None] + col[None, :]  # [S, kmax + 1]
    has_draft = np.zeros(num_rows, dtype=bool)
    has_draft[row_of[exists]] = True
    greedy_np = np.asarray(list(greedy), dtype=bool)
    index = np.where(exists[:, :kmax], row_of[:, :kmax], num_rows)  # [S, kmax]; padding: 0 row
    # Every host array in one int64 buffer: one host-to-device copy for the step.
    parts = [
        row_of[exists],  # the rows that hold a draft
        np.flatnonzero(exists),  # and where it sits in ``padded``
        has_draft,
        np.repeat(greedy_np, ks + 1),
        greedy_np,
        offsets,
        index,
        padded,
    ]
    on_device = to_device(np.concatenate([a.ravel().astype(np.int64) for a in parts]), None, device)
    views = on_device.split([a.size for a in parts])
    draft_rows, draft_cells, offsets_d = views[0], views[1], views[5]
    draft_mask, greedy_rows, greedy_seqs = (v != 0 for v in views[2:5])
    index_d, padded_d = views[6].view(num_seqs, kmax), views[7].view(num_seqs, kmax + 1)
    if device_drafts is not None and any(d is not None for d in device_drafts):
        padded_d = padded_d.clone()
        for i, d in enumerate(device_drafts):
            if d is not None:
                padded_d[i, : len(d)].copy_(d)
    # The flat draft token of every row (a sequence's last row has none: 0, masked).
    drafts = torch.zeros(num_rows, dtype=torch.int64, device=device)
    drafts.index_copy_(0, draft_rows, padded_d.flatten()[draft_cells])

    all_greedy = bool(greedy_np.all())
    argmax = p.argmax(dim=-1)
    if all_greedy:  # argmax only: no draft distributions, no draws
        accept = (drafts == argmax) & draft_mask
    else:
        # q as rows aligned with p: a draft's distribution, a point mass, or zeros on a last row.
        q = _point_masses(p, drafts) * draft_mask.unsqueeze(1)
        for off, k, probs in zip(offsets.tolist(), ks.tolist(), draft_probs, strict=True):
            if probs is not None and k:
                q[off : off + k] = probs[:k].to(device, torch.float32)
        uniform = _uniform(
            num_rows, offsets.tolist(), ks.tolist(), generators, shared_generator, device
        )
        p_d = p.gather(1, drafts.unsqueeze(1)).squeeze(1)
        q_d = q.gather(1, drafts.unsqueeze(1)).squeeze(1)
        accept = torch.where(greedy_rows, drafts == argmax, uniform * q_d < p_d) & draft_mask

    # Accepted drafts per sequence: the leading run of accepts among its k rows.
    num_accepted = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    if kmax:
        accept_padded = torch.cat([accept, accept.new_zeros(1)])[index_d]
        num_accepted = accept_padded.long().cumprod(dim=1).sum(dim=1)
    final_rows = offsets_d + num_accepted

    # The next token: from max(0, p - q) at a rejection, from p for the bonus (q is zero there).
    next_tokens = argmax[final_rows]
    if not all_greedy:
        p_final = p[final_rows]
        residual = (p_final - q[final_rows]).clamp_(min=0)
        mass = residual.sum(dim=-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_final)
        drawn = _draw(residual, generators, shared_generator)
        next_tokens = torch.where(greedy_seqs, next_tokens, drawn)

    # Emitted: drafts[:a], then the next token at column a; column 0 of the packing holds a.
    cols = torch.arange(kmax + 1, device=device)
    emitted = padded_d
    emitted = torch.where(cols[None, :] == num_accepted[:, None], next_tokens[:, None], emitted)
    packed = torch.cat([num_accepted[:, None], emitted], dim=1)
    logprobs = None
    if raw_logits is not None:
        rows = (offsets_d[:, None] + cols[None, :]).clamp_(max=num_rows - 1)
        lp = torch.log_softmax(raw_logits.float(), dim=-1)
        logprobs = lp[rows.flatten(), emitted.flatten()].view(num_seqs, kmax + 1)
    return DeviceVerified(packed, logprobs)


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


class RejectionVerifier:
    """Verifies a runner step in which some sequences verify drafts (called by the runner)."""

    def __init__(self, sampler: Sampler, device: torch.device, seed: int = 0) -> None:
        self.sampler = sampler
        self.generator = make_generator(seed, device)
        self.device = device

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: Seq[SeqInput],
        generators: Seq[torch.Generator | None],
    ) -> DeviceVerified:
        """``logits`` has ``seq.num_logits`` rows per sequence in ``seqs`` (the sampled ones, in order).

        Nothing is read back: the caller copies the packed result to the host.
        """
        params = [s.params or SamplingParams() for s in seqs]
        greedy = [is_greedy(p) for p in params]
        if all(greedy):  # only the argmax is read, which the raw logits give: no sampling batch
            probs = logits
        else:
            row_params = [p for s, p in zip(seqs, params, strict=True) for _ in range(s.num_logits)]
            row_gens = [
                g for s, g in zip(seqs, generators, strict=True) for _ in range(s.num_logits)
            ]
            probs = self.sampler.probabilities(
                logits, self.sampler.make_batch(row_params, row_gens)
            )
        return verify_on_device(
            probs,
            [s.token_ids[len(s.token_ids) - s.num_logits + 1 :] for s in seqs],
            [s.draft_probs for s in seqs],
            greedy,
            generators,
            self.generator,
            raw_logits=logits if any(p.logprobs for p in params) else None,
            device_drafts=[s.draft_ids for s in seqs],
        )


def create_rejection_verifier(
    config: Any, sampler: Sampler, device: torch.device
) -> RejectionVerifier:
    """Exact verification by rejection sampling, reading ``sampler``'s processed distribution."""
    return RejectionVerifier(sampler, torch.device(device), seed=getattr(config, "seed", 0))


@hookimpl
def register_verifiers(register: Any) -> None:
    """Register the ``rejection`` verifier."""
    register("rejection", create_rejection_verifier)
