"""The executor kind: how the engine runs a model split over several ranks.

At ``tensor_parallel_size = 1`` the engine builds its
:class:`~pitstop.runner.model_runner.ModelRunner` in its own process and no executor is
involved. Above it, the config's ``distributed_executor_backend`` names an executor
plugin (``mp``: spawned processes, or ``torchrun``'s ranks, over ``torch.distributed``):

1. built from the config (``factory(config) -> Executor``), before any weight loads;
2. asked for one rank's part of the model (:meth:`Executor.rank_model_config`), so that
   the engine sizes memory and refuses a size the model does not split into before any
   process starts;
3. started with what the engine has (:class:`ExecutorContext`); it returns the runner
   the engine drives in place of a ``ModelRunner``: the same calls and attributes (rank
   0's), each call made on every rank, plus ``close()``.

Each rank's ``ModelRunner`` takes the executor's
:class:`~pitstop.runner.peers.RankParallel` (its part of the model, its kernel set with
the collectives, the peers a step ends with), so the runner imports no executor's code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import torch

from pitstop.ground.model_config import ModelConfig

if TYPE_CHECKING:
    from pitstop.config import EngineConfig
    from pitstop.plugin_system.settings import ResolvedConfig


@attrs.frozen
class ExecutorContext:
    """What the engine has when the ranks start: the executor builds every rank's runner
    from it (rank 0's with ``resolved``, so the config is resolved once)."""

    config: EngineConfig  # max_model_len and kernels resolved by the engine
    model_config: ModelConfig  # the whole model's shape
    plugins: Any  # the engine's PluginManager (pitstop.plugin_system.plugin_manager)
    device: torch.device  # the engine's device (rank r runs on its own one of that type)
    dtype: torch.dtype
    weights: Any  # the model source's weights: a callable taking shard=, or None (dummy)
    resolved: ResolvedConfig  # every selected strategy's typed settings


@runtime_checkable
class Executor(Protocol):
    """Runs one engine's model over ``config.tensor_parallel_size`` ranks."""

    def rank_model_config(self, model_config: ModelConfig) -> ModelConfig:
        """The shape of the part of ``model_config`` one rank holds (its heads, KV heads, MLP
        rows, vocabulary rows): the engine sizes the KV cache and checks memory with it.

        Raises :class:`~pitstop.errors.ConfigError` for a size the model does not split into,
        before any process starts."""
        ...

    def start(self, context: ExecutorContext) -> Any:
        """Start the ranks and return rank 0's runner, weights not loaded yet.

        The engine drives it as it drives a ``ModelRunner`` (``load_weights``,
        ``plan_num_pages``, ``init_kv_cache``, ``maybe_capture_graphs``, ``launch``,
        ``execute``, ``save_samples``, ``restore_samples``, ``adopt_samples``; ``model``,
        ``sampler``, ``kv_cache_dtype``, ``bytes_per_page``, ``logits_observer``, …) and
        calls its ``close()`` when the engine closes (stop every other rank)."""
        ...
