"""A tensor-parallel worker (ranks 1..N-1): build this rank's runner, then make the calls rank 0 makes.

A worker never plans, samples or detokenizes: rank 0's engine does. Each
runner call rank 0 makes (load the weights, size and allocate the KV cache,
capture CUDA graphs, launch a step, save/restore/adopt samples, place an
adapter ahead of its step) reaches the worker as one message on the control
group (:meth:`TensorParallelGroup.send_call`), and the worker makes the same
call on its own shard; their collectives meet inside it. ``stop`` ends the loop.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

import torch
import torch.distributed as dist

from pitstop.config import EngineConfig
from pitstop.plugins.executors.tensor_parallel.group import COLLECTIVE_TIMEOUT, TensorParallelGroup

log = logging.getLogger(__name__)

# Calls a worker makes with rank 0's arguments as they are.
_PLAIN_CALLS = frozenset({"init_kv_cache", "maybe_capture_graphs", "launch", "adopt_samples"})


def rank_device(device_type: str, local_rank: int) -> torch.device:
    """The device of a rank: ``cuda:<local rank>`` on CUDA, else the CPU."""
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device_type: str) -> str:
    """The data group's backend: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def serve_calls(runner: Any, group: TensorParallelGroup, weights: Any) -> None:
    """Make every runner call rank 0 sends, until it sends ``stop``.

    ``weights`` is this worker's own weight source (its shard is read from
    the file here, never sent); samples saved by ``save_samples`` stay here
    for the ``restore_samples`` that follows.
    """
    saved = None
    while True:
        name, args = group.receive_call()
        if name == "stop":
            return
        if name == "load_weights":
            runner.load_weights(weights)
            group.barrier()
        elif name == "plan_num_pages":
            group.min_over_ranks(runner.plan_num_pages())
        elif name == "save_samples":
            saved = runner.save_samples()
        elif name == "restore_samples":
            runner.restore_samples(saved)
        elif name == "sync":
            group.barrier()
        elif name == "place_adapter":
            place_adapter(runner, *args)
        elif name in _PLAIN_CALLS:
            getattr(runner, name)(*args)
        else:
            raise RuntimeError(f"rank 0 sent an unknown runner call {name!r}")


def place_adapter(runner: Any, request: Any, busy: list[int]) -> None:
    """Read ``request``'s adapter into this rank's host cache and place it in its slots ahead
    of its step, as rank 0's plugin just was (its ``check``, then its ``ready``; rank 0's
    answers are the ones the engine uses). A failure here is logged and left to the step
    that runs the adapter, which loads it itself."""
    adapters = runner.adapters
    ready = getattr(adapters, "ready", None)
    try:
        adapters.check(request)
        if ready is not None:
            ready(request, set(busy))
    except Exception:  # noqa: BLE001 - the step that runs it loads it (and fails that request alone)
        log.exception("placing adapter %r ahead of its step failed on this rank", request)


def worker_main(
    rank: int,
    size: int,
    init_method: str,
    config: EngineConfig,
    device_type: str,
    dtype: torch.dtype,
    resolved: Any,
    status: Any,
) -> None:
    """Entry point of a spawned worker: join the group, load this rank's shard, serve rank 0.

    ``resolved``: the config as rank 0's engine resolved it (it is not resolved again).

    ``status`` (a multiprocessing queue) gets ``("ready", rank, None)`` before
    joining and ``("error", rank, traceback)`` if anything fails, so rank 0
    can name this rank and its error.
    """
    from pitstop.loading.weights import load_model_source
    from pitstop.plugin_system.plugin_manager import get_plugin_manager
    from pitstop.plugins.executors.tensor_parallel.rank import TensorParallelRank
    from pitstop.runner.model_runner import ModelRunner

    group = None
    try:
        if config.threads is not None:  # rank 0's engine sets its own
            torch.set_num_threads(config.threads)
        status.put(("ready", rank, None))
        device = rank_device(device_type, rank)
        dist.init_process_group(
            backend_for(device_type),
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        source = load_model_source(config.model, tokenizer=config.tokenizer)
        group = TensorParallelGroup(rank, size, device, source.model_config)
        runner = ModelRunner(
            config,
            source.model_config,
            get_plugin_manager(),
            device,
            dtype,
            TensorParallelRank(group),
            resolved=resolved,
        )
        serve_calls(runner, group, source.weights)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        status.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        if group is not None:
            group.close()
