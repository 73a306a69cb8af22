"""Rank 0's runner of a tensor-parallel engine: each runner call goes to the workers, then runs here."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any

import attrs
import torch.distributed as dist

from pitstop.errors import WorkerDiedError
from pitstop.plugins.executors.tensor_parallel.group import TensorParallelGroup
from pitstop.plugins.executors.tensor_parallel.watch import WorkerWatch

log = logging.getLogger(__name__)

# After a collective fails, how long to wait for the dead worker's exit to be seen.
DEATH_GRACE_S = 5.0


class TensorParallelRunner:
    """Rank 0's runner at ``tensor_parallel_size > 1``: each call goes to the workers, then runs here.

    Everything else (``model``, ``kernels``, ``bytes_per_page``, …) is rank 0's
    :class:`~pitstop.runner.model_runner.ModelRunner`'s. A failed collective or a dead
    worker raises :class:`~pitstop.errors.WorkerDiedError` naming the rank;
    the engine does not go on after it.
    """

    def __init__(self, runner: Any, group: TensorParallelGroup, watch: WorkerWatch | None = None):
        self.runner, self.group, self.watch = runner, group, watch
        self._closed = False
        self._adapters: EveryRankAdapters | None = None  # built on first use (adapters)
        self._broken: list[bool] = []  # non-empty once a rank is lost or out of step
        self._finalizer = weakref.finalize(self, _shutdown, group, watch, self._broken)

    def __getattr__(self, name: str) -> Any:
        if name == "runner":  # not set yet (during unpickling or a failed __init__)
            raise AttributeError(name)
        return getattr(self.runner, name)

    @property
    def adapters(self) -> Any:
        """Rank 0's adapter plugin (None: adapters are off), its ``ready`` asked of every rank
        (:class:`EveryRankAdapters`) where it has one."""
        local = self.runner.adapters
        if local is None or getattr(local, "ready", None) is None:
            return local
        if self._adapters is None:  # one wrapper for the runner's life
            self._adapters = EveryRankAdapters(local, self)
        return self._adapters

    def place_adapter(self, request: Any, busy: Collection[int]) -> None:
        """Tell every worker to place ``request``'s adapter ahead of its step, as rank 0's
        plugin just was asked to (``ready(request, busy)``); nothing runs here."""
        self._call("place_adapter", (request, sorted(busy)), lambda: None)

    def sync(self) -> None:
        """Return once every worker has made every runner call sent before this one (calls
        such as :meth:`place_adapter` send without waiting)."""
        self._call("sync", (), self.group.barrier)

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

    def maybe_capture_graphs(self, extra: Callable[[Any], None] | None = None) -> None:
        """Capture CUDA graphs on every rank (the all-reduces inside them).

        ``extra`` (a module-level function, such as
        :func:`pitstop.runner.verify_graphs.capture_verify_graphs`) goes to the workers
        by reference and captures the same extra graphs on every rank.
        """
        self._call(
            "maybe_capture_graphs", (extra,), lambda: self.runner.maybe_capture_graphs(extra)
        )

    def launch(self, step: Any) -> Any:
        """Launch a step on every rank; rank 0 samples and returns the handle."""
        from pitstop.ground.step import StepInput

        # workers neither sample nor verify: the step goes without what only sampling reads
        sent = StepInput(
            [_for_workers(s) for s in step.seqs],
            list(step.finished_seq_ids),
            list(step.reset_seq_ids),
            list(step.poison_pages),
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


class EveryRankAdapters:
    """Rank 0's adapter plugin as the engine sees it under tensor parallelism: every call is
    rank 0's plugin's, and ``ready`` (place an adapter ahead of the step that runs it, its
    copy beside the running steps) is asked of every worker too, after rank 0.

    The engine asks ``ready`` on its own thread as a request arrives and before each step
    while the request waits for its copy; each worker starts its own copy of its part of the
    adapter (reading the folder if its host cache lacks it) when the message reaches it,
    between the steps it runs, so that no rank's step waits for a copy or a read. Rank 0's
    answer decides when the request joins; a worker whose copy is not done by then makes
    that step wait on its device (as one rank alone does), and a worker whose placement
    fails leaves it to that step, which loads the adapter itself."""

    def __init__(self, local: Any, runner: TensorParallelRunner) -> None:
        self._local, self._runner = local, runner

    def __getattr__(self, name: str) -> Any:
        if name == "_local":  # not set yet (during unpickling)
            raise AttributeError(name)
        return getattr(self._local, name)

    def ready(self, request: Any, busy: Collection[int]) -> bool:
        """Rank 0's plugin's ``ready(request, busy)``; then every worker is asked the same."""
        placed = bool(self._local.ready(request, busy))
        self._runner.place_adapter(request, busy)
        return placed


def _for_workers(s: Any) -> Any:
    """A step's sequence as the workers get it: without what only sampling reads.

    Drafts still on rank 0's device (``draft_ids``) go as host ids in
    ``token_ids`` (a worker cannot read rank 0's device memory).
    """
    token_ids = s.token_ids
    if s.draft_ids is not None and len(s.draft_ids):
        k = len(s.draft_ids)
        token_ids = list(token_ids[:-k]) + [int(t) for t in s.draft_ids.tolist()]
    return attrs.evolve(
        s, token_ids=token_ids, params=None, draft_probs=None, draft_ids=None, row_inputs=None
    )


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
