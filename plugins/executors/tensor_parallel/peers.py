"""How a runner's step ends among tensor-parallel ranks: rank 0 samples, the workers follow.

The runner ends every step through its peers
(:class:`pitstop.runner.peers.StepPeers`): at ``tensor_parallel_size = 1`` alone
(:class:`pitstop.runner.peers.Alone`), here rank 0 (which samples and broadcasts the ids)
or a worker (which takes rank 0's ids for its next step's pending tokens). So the runner's
``launch`` reads the same at every rank count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pitstop.ground.step import SeqInput
from pitstop.plugins.executors.tensor_parallel.group import TensorParallelGroup
from pitstop.runner.launched import LaunchedStep, ready_step

if TYPE_CHECKING:
    from pitstop.runner.sampling import StepSampling


class Rank0Peers:
    """Rank 0: it samples (or verifies), then sends the sampled ids to every worker."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group

    def conclude(
        self, seqs: list[SeqInput], verifies: bool, finish: Callable[[], LaunchedStep]
    ) -> LaunchedStep:
        """Past the step's last collective but the samples' broadcast: ``finish`` samples here."""
        self.group.step_open = False  # from here on the ranks stay in step
        return finish()

    def share_samples(self, tokens: torch.Tensor) -> None:
        """Broadcast rank 0's sampled ids (the workers' pending input tokens of the next step)."""
        self.group.share_samples(tokens)


class WorkerPeers:
    """A worker (rank > 0): rank 0 samples; the worker takes its ids."""

    def __init__(self, group: TensorParallelGroup, sampling: StepSampling) -> None:
        self.group, self.sampling = group, sampling

    def conclude(
        self, seqs: list[SeqInput], verifies: bool, finish: Callable[[], LaunchedStep]
    ) -> LaunchedStep:
        """A worker's end of a step: take rank 0's ids (for the next step's pending tokens).

        A verifying step runs serially: nothing is pending after it. ``finish``
        (rank 0's sampling) is not called here.
        """
        sampling = self.sampling
        n = sum(s.sample for s in seqs)
        if verifies:
            sampling.last_rows = {}
        else:
            self.group.share_samples(sampling.last_sampled[:n])
            sampling.last_rows = {s.seq_id: i for i, s in enumerate(s for s in seqs if s.sample)}
        return ready_step(seqs)

    def share_samples(self, tokens: torch.Tensor) -> None:
        """Receive rank 0's sampled ids into ``tokens``."""
        self.group.share_samples(tokens)


def peers_of(group: TensorParallelGroup, sampling: StepSampling) -> Rank0Peers | WorkerPeers:
    """The peers of this process's rank in ``group``."""
    return Rank0Peers(group) if group.rank == 0 else WorkerPeers(group, sampling)
