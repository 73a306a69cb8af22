"""One rank's part in a tensor-parallel model: what its runner asks of the executor.

:class:`TensorParallelRank` is the :class:`~pitstop.runner.peers.RankParallel` each rank's
:class:`~pitstop.runner.model_runner.ModelRunner` is built with: the shape of the rank's
part (:func:`~pitstop.plugins.executors.tensor_parallel.sharding.shard_model_config`), the
weight cutter (:class:`~pitstop.plugins.executors.tensor_parallel.sharding.WeightShard`),
the kernel set with the collectives
(:class:`~pitstop.plugins.executors.tensor_parallel.kernels.TensorParallelKernels`) and
the step's peers (:mod:`pitstop.plugins.executors.tensor_parallel.peers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pitstop.ground.model_config import ModelConfig
from pitstop.plugins.executors.tensor_parallel.kernels import TensorParallelKernels
from pitstop.plugins.executors.tensor_parallel.peers import Rank0Peers, WorkerPeers, peers_of
from pitstop.plugins.executors.tensor_parallel.sharding import WeightShard, shard_model_config

if TYPE_CHECKING:
    from pitstop.plugins.executors.tensor_parallel.group import TensorParallelGroup
    from pitstop.runner.sampling import StepSampling


class TensorParallelRank:
    """Rank ``group.rank`` of ``group.size``: its part of the model and its collectives."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.shard = WeightShard(group.model_config, group.rank, group.size)

    def rank_model_config(self, model_config: ModelConfig) -> ModelConfig:
        """The shape of this rank's part of ``model_config``."""
        return shard_model_config(model_config, self.group.size)

    def wrap_kernels(self, kernels: Any) -> TensorParallelKernels:
        """``kernels`` plus the group's collectives."""
        return TensorParallelKernels(kernels, self.group)

    def peers(self, sampling: StepSampling) -> Rank0Peers | WorkerPeers:
        """Rank 0 samples and broadcasts; a worker takes its ids."""
        return peers_of(self.group, sampling)
