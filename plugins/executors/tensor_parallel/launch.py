"""Start a tensor-parallel engine: spawn the workers (or join ``torchrun``'s ranks), build rank 0's runner.

Two ways in:

- **spawned** (one machine; ``LLM(..., tensor_parallel_size=N)``,
  ``pitstop generate --tensor-parallel-size N``): rank 0 is this process;
  it starts N-1 worker processes (``torch.multiprocessing``, spawn), one per
  GPU (or CPU processes over gloo), and meets them on a free local port;
- **torchrun** (one or several machines): every process runs the same
  command; ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` come from the environment. Rank 0 goes on to run the
  engine; every other rank serves rank 0's calls and exits when it stops.

Rank 0's engine talks to :class:`TensorParallelRunner`, which sends each
runner call to the workers before making it itself.
"""

from __future__ import annotations

import logging
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pitstop.errors import ConfigError
from pitstop.plugin_system.executor import ExecutorContext
from pitstop.plugins.executors.tensor_parallel.group import COLLECTIVE_TIMEOUT, TensorParallelGroup
from pitstop.plugins.executors.tensor_parallel.rank import TensorParallelRank
from pitstop.plugins.executors.tensor_parallel.rank0 import TensorParallelRunner
from pitstop.plugins.executors.tensor_parallel.sharding import check_tensor_parallel_size
from pitstop.plugins.executors.tensor_parallel.watch import WorkerWatch
from pitstop.plugins.executors.tensor_parallel.worker import (
    backend_for,
    rank_device,
    serve_calls,
    worker_main,
)
from pitstop.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)

# How long spawned workers may take to import torch and pitstop before joining.
START_TIMEOUT_S = 300.0


def launched_world_size() -> int:
    """``WORLD_SIZE`` from ``torchrun`` (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def start_tensor_parallel(context: ExecutorContext) -> TensorParallelRunner:
    """Rank 0's runner of a ``config.tensor_parallel_size``-way engine, workers started and joined.

    Every refusal comes before a process starts: sizes the model does not
    split into, more ranks than GPUs, a second engine in one process, a
    ``torchrun`` world of another size. On a ``torchrun`` rank other than 0
    this serves rank 0 and then exits the process (``SystemExit(0)``).
    """
    size, device = context.config.tensor_parallel_size, context.device
    check_tensor_parallel_size(context.model_config, size)
    world = launched_world_size()
    if world > 1 and world != size:
        raise ConfigError(
            f"torchrun started {world} processes (WORLD_SIZE={world}) but "
            f"tensor_parallel_size={size}; pass --tensor-parallel-size {world}"
        )
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", size)) if world > 1 else size
        count = torch.cuda.device_count()
        if local > count:
            raise ConfigError(
                f"tensor_parallel_size={size} needs {local} GPUs on this machine, it has {count} "
                "visible; use at most that many ranks per machine (torchrun --nproc-per-node), "
                "or device='cpu' to run the ranks as CPU processes over gloo"
            )
    if dist.is_initialized():
        raise ConfigError(
            "this process already belongs to a torch.distributed group (another tensor-parallel "
            "engine?); close it (LLM.close()) before building another"
        )
    if world > 1:
        return _join_torchrun(context)
    return _spawn(context)


def rank_runner(context: ExecutorContext, group: TensorParallelGroup) -> ModelRunner:
    """This process's rank's runner: its part of the model, with the config as the engine
    resolved it."""
    return ModelRunner(
        context.config,
        context.model_config,
        context.plugins,
        group.device,
        context.dtype,
        TensorParallelRank(group),
        resolved=context.resolved,
    )


def _join_torchrun(context: ExecutorContext) -> TensorParallelRunner:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device_type = context.device.type
    device = rank_device(device_type, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend_for(device_type), timeout=COLLECTIVE_TIMEOUT)
    group = TensorParallelGroup(rank, size, device, context.model_config)
    runner = rank_runner(context, group)
    if rank > 0:
        try:
            serve_calls(runner, group, context.weights)
        finally:
            group.close()
        raise SystemExit(0)
    return TensorParallelRunner(runner, group)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(context: ExecutorContext) -> TensorParallelRunner:
    config, device_type = context.config, context.device.type
    size = config.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    status = ctx.Queue()
    workers = [
        ctx.Process(
            target=worker_main,
            args=(
                rank,
                size,
                init_method,
                config,
                device_type,
                context.dtype,
                context.resolved,
                status,
            ),
            name=f"pitstop-tp-rank{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for w in workers:
        w.start()
    watch = WorkerWatch(workers, status)
    try:
        watch.wait_ready(START_TIMEOUT_S)
        device = rank_device(device_type, 0)
        dist.init_process_group(
            backend_for(device_type),
            init_method=init_method,
            rank=0,
            world_size=size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        group = TensorParallelGroup(0, size, device, context.model_config)
        runner = rank_runner(context, group)
    except BaseException:
        if dist.is_initialized():  # first: the joined workers then fail at once and exit
            dist.destroy_process_group()
        watch.stop()
        raise
    if device_type == "cuda":  # NCCL does not notice a dead peer by itself: abort its collectives
        watch.watch_in_background(_abort_collectives)
    log.info("tensor parallelism: %d ranks over %s", size, backend_for(device_type))
    return TensorParallelRunner(runner, group, watch)


def _abort_collectives(problem: str) -> None:
    """Abort the data group's (NCCL) collectives, so a step waiting for a dead rank raises."""
    log.error("%s; aborting the collectives so the engine raises instead of waiting", problem)
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort()
