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
import queue
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pitstop.config import EngineConfig
from pitstop.errors import ConfigError, WorkerDiedError
from pitstop.model_config import ModelConfig
from pitstop.parallel.group import COLLECTIVE_TIMEOUT, TensorParallelGroup
from pitstop.parallel.sharding import check_tensor_parallel_size
from pitstop.parallel.worker import backend_for, rank_device, serve_calls, worker_main

log = logging.getLogger(__name__)

# How long spawned workers may take to import torch and pitstop before joining.
START_TIMEOUT_S = 300.0
# After a collective fails, how long to wait for the dead worker's exit to be seen.
DEATH_GRACE_S = 5.0


def launched_world_size() -> int:
    """``WORLD_SIZE`` from ``torchrun`` (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def start_tensor_parallel(
    config: EngineConfig,
    model_config: ModelConfig,
    plugins: Any,
    device: torch.device,
    dtype: torch.dtype,
    weights: Any,
) -> TensorParallelRunner:
    """Rank 0's runner of a ``config.tensor_parallel_size``-way engine, workers started and joined.

    Every refusal comes before a process starts: sizes the model does not
    split into, more ranks than GPUs, a second engine in one process, a
    ``torchrun`` world of another size. On a ``torchrun`` rank other than 0
    this serves rank 0 and then exits the process (``SystemExit(0)``).
    """
    size = config.tensor_parallel_size
    check_tensor_parallel_size(model_config, size)
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
        return _join_torchrun(config, model_config, plugins, device.type, dtype, weights)
    return _spawn(config, model_config, plugins, device.type, dtype)


def _join_torchrun(
    config: EngineConfig,
    model_config: ModelConfig,
    plugins: Any,
    device_type: str,
    dtype: torch.dtype,
    weights: Any,
) -> TensorParallelRunner:
    from pitstop.runner import ModelRunner

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = rank_device(device_type, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend_for(device_type), timeout=COLLECTIVE_TIMEOUT)
    group = TensorParallelGroup(rank, size, device, model_config)
    runner = ModelRunner(config, model_config, plugins, device, dtype, tensor_parallel=group)
    if rank > 0:
        try:
            serve_calls(runner, group, weights)
        finally:
            group.close()
        raise SystemExit(0)
    return TensorParallelRunner(runner, group)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(
    config: EngineConfig,
    model_config: ModelConfig,
    plugins: Any,
    device_type: str,
    dtype: torch.dtype,
) -> TensorParallelRunner:
    from pitstop.runner import ModelRunner

    size = config.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    status = ctx.Queue()
    workers = [
        ctx.Process(
            target=worker_main,
            args=(rank, size, init_method, config, device_type, dtype, status),
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
        group = TensorParallelGroup(0, size, device, model_config)
        runner = ModelRunner(config, model_config, plugins, device, dtype, tensor_parallel=group)
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


class WorkerWatch:
    """Rank 0's view of its spawned workers: alive or not, and the errors they reported."""

    def __init__(self, workers: Sequence[Any], status: Any) -> None:
        self.workers = list(workers)  # rank r is workers[r - 1]
        self.status = status
        self.errors: dict[int, str] = {}
        self._ready: set[int] = set()
        self._stopping = threading.Event()

    def _drain(self, timeout: float = 0.0) -> None:
        try:
            while True:
                kind, rank, text = (
                    self.status.get(timeout=timeout) if timeout else self.status.get_nowait()
                )
                if kind == "ready":
                    self._ready.add(rank)
                else:
                    self.errors[rank] = text
                timeout = 0.0
        except queue.Empty:
            pass

    def wait_ready(self, timeout: float) -> None:
        """Wait until every worker is about to join the group; raise naming one that died first."""
        deadline = time.monotonic() + timeout
        while len(self._ready) < len(self.workers):
            self._drain(timeout=0.2)
            problem = self.problem()
            if problem is not None:
                raise WorkerDiedError(problem)
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, len(self.workers) + 1)) - self._ready)
                raise WorkerDiedError(
                    f"tensor-parallel worker rank(s) {missing} did not start within {timeout:.0f} s"
                )

    def problem(self, wait: float = 0.0) -> str | None:
        """What is wrong with a worker (its error, or how it died), waiting up to ``wait`` s to see it."""
        deadline = time.monotonic() + wait
        while True:
            self._drain()
            for rank, w in enumerate(self.workers, start=1):
                if rank in self.errors:
                    return f"tensor-parallel worker rank {rank} failed: {self.errors[rank]}"
                if w.exitcode is not None:
                    return f"tensor-parallel worker rank {rank} died ({_describe_exit(w.exitcode)})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def watch_in_background(self, on_death: Callable[[str], None], period: float = 0.2) -> None:
        """Call ``on_death(problem)`` once, from a daemon thread, if a worker dies before :meth:`stop`."""

        def loop() -> None:
            while not self._stopping.wait(period):
                if any(w.exitcode is not None for w in self.workers):
                    if not self._stopping.is_set():
                        on_death(self.problem() or "a tensor-parallel worker died")
                    return

        threading.Thread(target=loop, name="pitstop-tp-watch", daemon=True).start()

    def expect_exit(self) -> None:
        """The workers are about to be stopped: their exit is no death to report."""
        self._stopping.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the workers to leave (after ``stop``), then end any that did not."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for w in self.workers:
            w.join(max(0.0, deadline - time.monotonic()))
            if w.is_alive():
                w.terminate()
                w.join(1.0)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class TensorParallelRunner:
    """Rank 0's runner at ``tensor_parallel_size > 1``: each call goes to the workers, then runs here.

    Everything else (``model``, ``kernels``, ``bytes_per_page``, …) is rank 0's
    :class:`~pitstop.runner.ModelRunner`'s. A failed collective or a dead
    worker raises :class:`~pitstop.errors.WorkerDiedError` naming the rank;
    the engine does not go on after it.
    """

    def __init__(self, runner: Any, group: TensorParallelGroup, watch: WorkerWatch | None = None):
        self.runner, self.group, self.watch = runner, group, watch
        self._closed = False
        self._broken: list[bool] = []  # non-empty once a rank is lost or out of step
        self._finalizer = weakref.finalize(self, _shutdown, group, watch, self._broken)

    def __getattr__(self, name: str) -> Any:
        if name == "runner":  # not set yet (during unpickling or a failed __init__)
            raise AttributeError(name)
        return getattr(self.runner, name)

    @property
    def logits_observer(self) -> Any:
        """Rank 0's logits observer (:meth:`LLMEngine.observe_logits`): rank 0 has every logit."""
        return self.runner.logits_observer

    @logits_observer.setter
    def logits_observer(self, observer: Any) -> None:
        self.runner.logits_observer = observer

    def _call(self, name: str, args: tuple[Any, ...], local: Callable[[], Any]) -> Any:
        if self._closed:
            raise WorkerDiedError(
                "this tensor-parallel engine was closed (or lost a rank); build a new one"
            )
        try:
            self.group.send_call(name, args)
            return local()
        except Exception as exc:
            problem = self._problem(exc)
            if problem is None and self.group.step_open:
                problem = (
                    f"rank 0 failed inside the step's collectives ({type(exc).__name__}: {exc}), "
                    "so the ranks are out of step"
                )
            if problem is None:
                raise  # a request's own error: every rank ran the step, the engine isolates it
            self._closed = True
            self._broken.append(True)
            raise WorkerDiedError(f"{problem}; the engine stopped (during {name})") from exc

    def _problem(self, exc: Exception) -> str | None:
        comm = _is_communication_error(exc)
        if self.watch is not None:
            found = self.watch.problem(wait=DEATH_GRACE_S if comm else 0.0)
            if found is not None:
                return found
        return f"a tensor-parallel rank stopped answering ({exc})" if comm else None

    def load_weights(self, weights: Any) -> None:
        """Every rank reads its own shard from the same source."""

        def local() -> None:
            self.runner.load_weights(weights)
            self.group.barrier()

        self._call("load_weights", (), local)

    def plan_num_pages(self) -> int:
        """The KV pages every rank can hold (the least of the ranks' own plans)."""
        return self._call(
            "plan_num_pages", (), lambda: self.group.min_over_ranks(self.runner.plan_num_pages())
        )

    def init_kv_cache(self, num_pages: int) -> None:
        """Allocate each rank's KV cache (its KV heads) of ``num_pages`` pages."""
        self._call("init_kv_cache", (num_pages,), lambda: self.runner.init_kv_cache(num_pages))

    def maybe_capture_graphs(self) -> None:
        """Capture CUDA graphs on every rank (the all-reduces inside them)."""
        self._call("maybe_capture_graphs", (), self.runner.maybe_capture_graphs)

    def launch(self, step: Any) -> Any:
        """Launch a step on every rank; rank 0 samples and returns the handle."""
        from pitstop.runner import StepInput

        # workers neither sample nor verify: they get the step without params or drafts' probabilities
        sent = StepInput(
            [attrs.evolve(s, params=None, draft_probs=None) for s in step.seqs],
            list(step.finished_seq_ids),
            list(step.reset_seq_ids),
        )

        def local() -> Any:
            self.group.step_open = True
            handle = self.runner.launch(step)
            self.group.step_open = False
            return handle

        return self._call("launch", (sent,), local)

    def execute(self, step: Any) -> Any:
        """Run one step on every rank and wait for its tokens."""
        return self.launch(step).result()

    def save_samples(self) -> Any:
        """Each rank keeps a copy of its last samples (to rerun parts of a failed step)."""
        return self._call("save_samples", (), self.runner.save_samples)

    def restore_samples(self, saved: Any) -> None:
        """Each rank puts back its own saved copy."""
        self._call("restore_samples", (), lambda: self.runner.restore_samples(saved))

    def adopt_samples(self, sampled: Sequence[tuple[int, int]]) -> None:
        """The same ``(seq_id, token)`` pairs become every rank's last samples."""
        pairs = list(sampled)
        self._call("adopt_samples", (pairs,), lambda: self.runner.adopt_samples(pairs))

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent; also run at exit)."""
        self._closed = True
        self._finalizer()


def _shutdown(group: TensorParallelGroup, watch: WorkerWatch | None, broken: list[bool]) -> None:
    if watch is not None:
        watch.expect_exit()
    if not broken:  # a worker left inside a collective would not read it: leaving is enough
        try:
            group.send_call("stop", ())
        except Exception as exc:  # noqa: BLE001 - a dead worker needs no stop
            log.debug("stop not delivered to every worker: %s", exc)
    group.close()  # the workers' next (or pending) collective then fails, and they exit
    if watch is not None:
        watch.stop()


def _is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from a collective (gloo / NCCL / the store), not from the model."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc)
    return any(mark in text for mark in ("gloo", "Gloo", "NCCL", "Connection", "connection"))
