"""Whom a runner shares its model and its steps with: nobody, or the other ranks.

A :class:`~pitstop.runner.model_runner.ModelRunner` built without a
:class:`RankParallel` holds the whole model and ends each step :class:`Alone`. An
executor plugin (:mod:`pitstop.plugin_system.executor`) gives each rank's runner its
``RankParallel``: the runner then holds that rank's part of the model, runs the ops
through a kernel set with the collectives, and ends each step through the rank's
:class:`StepPeers`. So ``launch`` reads the same at every rank count, and the runner
imports no executor's code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pitstop.ground.model_config import ModelConfig
from pitstop.ground.step import SeqInput
from pitstop.runner.launched import LaunchedStep

if TYPE_CHECKING:
    from pitstop.plugin_system.protocols import KernelSet
    from pitstop.runner.sampling import StepSampling


class StepPeers(Protocol):
    """Who ends a step with this runner: nobody else, or the other ranks."""

    def conclude(
        self, seqs: list[SeqInput], verifies: bool, finish: Callable[[], LaunchedStep]
    ) -> LaunchedStep:
        """End a step whose logits are computed: ``finish()`` samples it here, or a worker
        takes rank 0's samples instead."""
        ...

    def share_samples(self, tokens: torch.Tensor) -> None:
        """Share the step's sampled ids with the other ranks (in place)."""
        ...


class Alone:
    """No other rank (``tensor_parallel_size = 1``): a step ends here and its samples stay here."""

    def conclude(
        self, seqs: list[SeqInput], verifies: bool, finish: Callable[[], LaunchedStep]
    ) -> LaunchedStep:
        """Sample (or verify) the step here."""
        return finish()

    def share_samples(self, tokens: torch.Tensor) -> None:
        """Nobody to share them with."""


class RankParallel(Protocol):
    """One rank's part in a model split over several: what its runner asks of the executor."""

    shard: Any
    """What cuts each weight to this rank's part: given as ``shard=`` to the model source's
    weights (a checkpoint reads only that part) and to the model's ``init_dummy``."""

    def rank_model_config(self, model_config: ModelConfig) -> ModelConfig:
        """The shape of this rank's part of ``model_config`` (the model built from it)."""
        ...

    def wrap_kernels(self, kernels: KernelSet) -> KernelSet:
        """The chosen kernel set plus the collectives the split model runs (``all_reduce``,
        ``embed``, ``gather_logits``)."""
        ...

    def peers(self, sampling: StepSampling) -> StepPeers:
        """Who this rank ends each step with (rank 0 samples; the others take its ids)."""
        ...
