"""The simulated clients: everything at once (offline), a closed loop, or Poisson arrivals.

One loop in this thread adds the requests that are due between the backend's
steps. A request's arrival time is when it was *due* (the run's start, the
moment its client's previous request finished, or its Poisson time), not when
the loop got to it, so queueing delay counts in TTFT.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable

from pitstop.bench.backends import Backend
from pitstop.bench.progress import progress
from pitstop.bench.report import RequestRecord, RunResult
from pitstop.bench.workloads import Workload, WorkloadError


def run_workload(
    backend: Backend,
    workload: Workload,
    *,
    concurrency: int | None = None,
    request_rate: float | None = None,
    desc: str = "",
    id_prefix: str = "r",
) -> RunResult:
    """Run every request of ``workload`` once and time it.

    No ``concurrency`` and no ``request_rate``: every request is submitted at
    the start (offline). ``concurrency=N``: N clients, each sending its next
    request when its last one finished. ``request_rate=R``: Poisson arrivals,
    R requests per second on average (seeded by the workload's seed). A workload
    with ``streams`` (conversations) sends each stream's requests one after
    another, the next when the last completed; the modes above then start
    streams instead of requests.
    """
    if concurrency is not None and concurrency < 1:
        raise WorkloadError(f"--concurrency must be >= 1, got {concurrency}")
    if request_rate is not None and request_rate <= 0:
        raise WorkloadError(f"--request-rate must be > 0, got {request_rate}")
    reqs = list(workload.requests)
    n = len(reqs)
    # a stream is sent one request after another (a conversation's turns); by default one each
    streams = [list(s) for s in workload.streams] if workload.streams else [[i] for i in range(n)]
    queue = deque(range(len(streams)))  # streams no client has started
    place: dict[str, tuple[int, int]] = {}  # request id -> (its stream, its place in it)
    records: list[RequestRecord] = []
    backend.begin_run()
    start = time.perf_counter()

    def send(stream: int, arrival: float, turn: int = 0) -> None:
        i = streams[stream][turn]
        request_id = f"{id_prefix}{i}"
        place[request_id] = (stream, turn)
        backend.submit(request_id, reqs[i], arrival)

    schedule: deque[float] = deque()
    if request_rate is not None:
        rng = random.Random(workload.seed)
        t = 0.0
        for _ in range(len(streams)):
            t += rng.expovariate(request_rate)
            schedule.append(start + t)
    elif concurrency is not None:
        for _ in range(min(concurrency, len(streams))):
            send(queue.popleft(), start)
    else:
        while queue:
            send(queue.popleft(), start)

    with progress(n, desc or workload.name) as bar:
        while len(records) < n:
            now = time.perf_counter()
            while schedule and schedule[0] <= now:
                send(queue.popleft(), schedule.popleft())
            wait = 0.0
            if not backend.has_work() and schedule:
                wait = max(0.0, schedule[0] - time.perf_counter())
            done = backend.poll(wait)
            for rec in done:
                records.append(rec)
                # a client sends its next request the moment its last one completed
                finished = rec.finish if rec.finish is not None else time.perf_counter()
                stream, turn = place.get(rec.request_id, (-1, 0))
                if stream >= 0 and turn + 1 < len(streams[stream]):
                    send(stream, finished, turn + 1)  # the stream's next request
                elif concurrency is not None and request_rate is None and queue:
                    send(queue.popleft(), finished)
            bar.update(len(done))
            if (
                not done
                and not backend.has_work()
                and not schedule
                and not queue
                and len(records) < n
            ):
                raise RuntimeError(
                    f"{n - len(records)} request(s) were lost: the backend holds no work"
                )
    end = max((r.finish for r in records if r.finish is not None), default=time.perf_counter())
    stats = backend.run_stats()
    return RunResult(records=records, start=start, end=end, **stats)


def run_repeats(
    backend: Backend,
    workload: Workload,
    *,
    repeats: int,
    concurrency: int | None = None,
    request_rate: float | None = None,
    warmup: bool = True,
) -> list[RunResult]:
    """Warm up on a short copy of the workload, then run it ``repeats`` times; every run.

    The warm-up sends the first ``max(4, concurrency)`` requests (outputs cut
    to 8 tokens) through the same clients, so that the mixed prefill + decode
    batch shapes of the timed run have been seen once: kernel compilation and
    autotuning stay out of the figures.
    """
    import attrs

    if warmup:
        count = min(workload.num_requests, max(4, concurrency or 0))
        short = attrs.evolve(
            workload,
            streams=None,  # its own requests, each alone
            requests=[
                attrs.evolve(r, output_len=min(r.output_len, 8)) for r in workload.requests[:count]
            ],
        )
        run_workload(backend, short, concurrency=concurrency, desc="warm-up", id_prefix="warm")
    runs: list[RunResult] = []
    for k in range(max(1, repeats)):
        runs.append(
            run_workload(
                backend,
                workload,
                concurrency=concurrency,
                request_rate=request_rate,
                desc=f"{workload.name} run {k + 1}/{repeats}" if repeats > 1 else workload.name,
                id_prefix=f"r{k}-",
            )
        )
    return runs


def run_backend(
    open_backend: Callable[[], Backend],
    workload: Workload,
    *,
    repeats: int,
    concurrency: int | None = None,
    request_rate: float | None = None,
    warmup: bool = True,
    release: Callable[[], None] | None = None,
) -> list[RunResult]:
    """Open a backend, :func:`run_repeats` on it, and close it however that ends.

    ``release`` (for example :func:`~pitstop.bench.backends.release_memory`)
    runs last, once no reference to the backend is left, so that the next
    configuration finds the memory it held free.
    """
    backend = None
    try:
        backend = open_backend()
        return run_repeats(
            backend,
            workload,
            repeats=repeats,
            concurrency=concurrency,
            request_rate=request_rate,
            warmup=warmup,
        )
    finally:
        if backend is not None:
            backend.close()
        del backend
        if release is not None:
            release()
