"""Rank 0's watch over its spawned workers: alive or not, the errors they reported, how they died."""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pitstop.errors import WorkerDiedError


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
