"""The ``mp`` executor: tensor parallelism over ``torch.distributed``, registered.

``distributed_executor_backend="mp"`` (the default) at ``tensor_parallel_size > 1``:
rank 0 is the engine's process; it spawns the other ranks (one per GPU, or CPU processes
over gloo), or joins ``torchrun``'s when launched by it
(:mod:`~pitstop.plugins.executors.tensor_parallel.launch`). This module imports none of
that until an engine starts one, so loading the plugin costs nothing at
``tensor_parallel_size = 1``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pitstop.plugin_system.hookspecs import hookimpl

if TYPE_CHECKING:
    from pitstop.config import EngineConfig
    from pitstop.ground.model_config import ModelConfig
    from pitstop.plugin_system.executor import ExecutorContext
    from pitstop.plugins.executors.tensor_parallel.rank0 import TensorParallelRunner


class TensorParallelExecutor:
    """Splits the model over ``config.tensor_parallel_size`` ranks, Megatron-style."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.tensor_parallel_size

    def rank_model_config(self, model_config: ModelConfig) -> ModelConfig:
        """One rank's heads, KV heads, MLP rows and vocabulary rows (a size the model does not
        split into is a ConfigError naming the sizes that work)."""
        from pitstop.plugins.executors.tensor_parallel.sharding import shard_model_config

        return shard_model_config(model_config, self.size)

    def start(self, context: ExecutorContext) -> TensorParallelRunner:
        """Start (or join) the ranks; rank 0's runner, which sends each call to every rank."""
        from pitstop.plugins.executors.tensor_parallel.launch import start_tensor_parallel

        return start_tensor_parallel(context)


@hookimpl
def register_executors(register: Any) -> None:
    """Register the ``mp`` executor."""
    register(
        "mp",
        TensorParallelExecutor,
        description="Tensor parallelism over torch.distributed: spawned ranks, or torchrun's.",
    )
