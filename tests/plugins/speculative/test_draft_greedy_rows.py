"""The ``draft`` proposer's greedy rows with any sampler: read off the
standard sampler's batch on the device, from the rows' parameters for a sampler whose batch
has no ``all_greedy`` or ``temperature`` (the protocol asks only that its own
``probabilities`` can read it)."""

from __future__ import annotations

import torch

from pitstop.plugins.samplers.standard import StandardSampler
from pitstop.plugins.speculative.draft import greedy_rows
from pitstop.requests.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.8, seed=3)


class OpaqueBatch:
    """A third-party sampler's batch: nothing the draft proposer may read."""

    __slots__ = ("payload",)

    def __init__(self, payload: object) -> None:
        self.payload = payload


def test_the_standard_batch_and_an_opaque_one_give_the_same_rows() -> None:
    sampler = StandardSampler(torch.device("cpu"))
    for params in ([GREEDY, GREEDY], [GREEDY, SAMPLED, GREEDY], [SAMPLED]):
        gens = [None] * len(params)
        standard = greedy_rows(sampler.make_batch(params, gens), params, torch.device("cpu"))
        opaque = greedy_rows(OpaqueBatch(params), params, torch.device("cpu"))
        if all(p.greedy for p in params):
            assert standard is None and opaque is None
        else:
            want = torch.tensor([p.greedy for p in params])
            assert torch.equal(standard, want) and torch.equal(opaque, want)
            assert opaque.dtype == torch.bool
