"""Drawing one token per row from probabilities without a host sync: the exponential race.

Shared by the samplers' side of the plugins: the ``standard`` sampler, the ``rejection``
verifier and the ``draft`` proposer draw with it, each row from its own seeded
generator when it has one (:func:`pitstop.plugin_system.sampler.make_generator`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
