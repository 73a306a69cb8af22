"""Turning per-request sampling parameters into the tensors a sampler reads.

The engine keeps one :class:`torch.Generator` per seeded request (made with
:func:`make_generator` when the request arrives, and kept for its whole life so
that its draws continue where the previous step stopped), and each step calls
:func:`make_sampling_batch` with the rows' parameters and generators in the
order of the logits' rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pitstop.protocols import SamplingBatch
from pitstop.sampling_params import SAMPLING_EPS, SamplingParams  # noqa: F401  (re-exported)


def is_greedy(params: SamplingParams) -> bool:
    """Whether ``params`` reduce to argmax (:attr:`SamplingParams.greedy`)."""
    return params.greedy


def exponential_race(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator | None,
) -> torch.Tensor:
    """One token per row of ``probs`` ``[B, V]``: ``argmax(probs / q)``, ``q ~ Exp(1)``.

    That is an exact draw from each row's distribution (the exponential race,
    or Gumbel-max in another form) with no host sync. Row ``i`` draws from
    ``generators[i]`` when it has one, else from ``shared`` (None: torch's
    default generator), which is not advanced when every row has its own.
    """
    seeded = [i for i, g in enumerate(generators) if g is not None]
    q = torch.empty_like(probs)
    if len(seeded) < probs.shape[0]:
        q.exponential_(generator=shared)
    for i in seeded:  # each seeded row advances only its own generator
        q[i].exponential_(generator=generators[i])
    # Exp(1) can round to 0; keep q positive so excluded tokens stay at 0/q = 0.
    q.clamp_(min=torch.finfo(torch.float32).tiny)
    return (probs / q).argmax(dim=-1)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``: one per seeded request, kept across steps."""
    device = torch.device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return generator


def make_sampling_batch(
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    device: torch.device | str,
) -> SamplingBatch:
    """Build the per-row tensors and flags of one step's :class:`SamplingBatch`.

    Row ``i`` uses ``params[i]`` and ``generators[i]`` (None: the sampler's own
    shared generator). Greedy rows (temperature < 1e-5, or top_k 1) get
    temperature 0 and their filters switched off, so the ``needs_*`` flags
    only say whether some *sampled* row uses that filter.
    """
    if len(params) != len(generators):
        raise ValueError(
            f"{len(params)} sampling params but {len(generators)} generators; pass one per row"
        )
    device = torch.device(device)
    temperature: list[float] = []
    top_k: list[int] = []
    top_p: list[float] = []
    min_p: list[float] = []
    for p in params:
        if is_greedy(p):
            temperature.append(0.0)
            top_k.append(-1)
            top_p.append(1.0)
            min_p.append(0.0)
        else:
            temperature.append(float(p.temperature))
            top_k.append(int(p.top_k))
            top_p.append(float(p.top_p))
            min_p.append(float(p.min_p))

    def to_device(values: list, dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if device.type != "cuda":
            return host
        # pinned + non-blocking: building a batch never waits for the device
        return host.pin_memory().to(device, non_blocking=True)

    return SamplingBatch(
        temperature=to_device(temperature, torch.float32),
        top_k=to_device(top_k, torch.int64),
        top_p=to_device(top_p, torch.float32),
        min_p=to_device(min_p, torch.float32),
        generators=list(generators),
        all_greedy=all(t == 0.0 for t in temperature),
        needs_top_k=any(k != -1 for k in top_k),
        needs_top_p=any(v < 1.0 for v in top_p),
        needs_min_p=any(v > 0.0 for v in min_p),
        want_logprobs=any(p.logprobs for p in params),
        # -1 when some row keeps every token (its k becomes the vocabulary size)
        max_top_k=-1 if any(k < 1 for k in top_k) else max(top_k, default=-1),
    )
