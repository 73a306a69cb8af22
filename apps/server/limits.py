"""Who may start a request, and how open requests end when the server shuts down.

:class:`ServerState` is the server's bookkeeping of the generation requests
it holds (one :class:`Flight` each, from admission to the last byte of the
answer):

- **admission**: a new request is refused with 429 and ``Retry-After`` when
  ``max_queued_requests`` requests already wait for a place in the running
  batch, or when its client already has ``max_requests_per_client`` requests
  open (fair share); with 503 while the server drains. Beside those counts
  every request has a **cost** in tokens (:func:`request_cost`: its prompt
  tokens times ``n`` plus its output budget, ``max_tokens`` times ``n``):
  the waiting requests' costs together stay within ``max_queued_tokens``
  and a client's open requests' costs within ``max_tokens_per_client``
  (429 beyond). A request whose cost alone is over either budget could
  never be admitted: it is a 400 (``code: request_too_costly``) naming the
  numbers.
- **drain**: on the first SIGTERM/SIGINT the server keeps listening (so
  ``/health`` can answer 503 ``"draining"``), refuses new requests, and lets
  open ones finish for up to the drain time. Then it asks the engine to
  abort what still runs (the engine delivers ``finish_reason="abort"`` at its
  next step boundary) and, if that has not ended every open request within
  ``step_grace_s``, ends them itself: every open stream gets a final chunk
  and ``data: [DONE]``, every waiting non-streamed client a JSON error.
  Only then does uvicorn close the listener. A second signal does the same
  at once. So the server exits within drain + ``step_grace_s`` + a little,
  however long an engine step takes.

Everything here runs on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from pitstop.entrypoints.async_engine import AsyncLLM, RequestStream
from pitstop.requests.outputs import RequestOutput
from pitstop.server.api_errors import asleep_error
from pitstop.server.protocol import APIError

log = logging.getLogger(__name__)


class ServerCut(Exception):
    """The server ended this request itself while shutting down (the engine had not yet)."""


_END = object()  # the pump's last item: the engine's stream is exhausted


class Flight:
    """One admitted generation request: its outputs, and its place in the server's counts.

    Iterate it (after :meth:`follow`) for the request's outputs; the
    iterator raises :class:`ServerCut` when the server ends the request
    during shutdown, and whatever the engine's stream raises
    (:class:`~pitstop.entrypoints.async_engine.EngineStepError`). :meth:`release`
    (idempotent) gives the request's place back and aborts it in the
    engine if it has not finished.
    """

    def __init__(self, state: ServerState, client: str, cost: int = 0) -> None:
        self.state = state
        self.client = client
        self.cost = cost  # tokens (request_cost); counted while open, and while waiting
        self.started = False  # the engine produced its first output
        self.stream: RequestStream | None = None
        self.last: RequestOutput | None = None  # the latest output seen (usage on a cut)
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None
        self._released = False
        self.was_cut = asyncio.Event()

    def follow(self, stream: RequestStream) -> None:
        """Start forwarding the engine's outputs for this request."""
        self.stream = stream
        self._pump = asyncio.get_running_loop().create_task(self._forward(stream))

    async def _forward(self, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self.started = True
                self._queue.put_nowait(out)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, who answers it
            self._queue.put_nowait(exc)
        self._queue.put_nowait(_END)

    def cut(self) -> None:
        """End this request from the server's side (shutdown): the reader gets :class:`ServerCut`."""
        self.was_cut.set()
        self._queue.put_nowait(ServerCut())

    async def add(self, adding: Awaitable[RequestStream]) -> None:
        """Wait for the engine to accept the request, then follow it; :class:`ServerCut` if the
        server ends the request first (the engine may be stuck in a step during shutdown)."""
        task = asyncio.ensure_future(adding)
        cut = asyncio.ensure_future(self.was_cut.wait())
        try:
            await asyncio.wait({task, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut.cancel()
        if not task.done():
            task.cancel()  # AsyncLLM.add_request aborts the request when cancelled
            raise ServerCut()
        self.follow(task.result())

    def __aiter__(self) -> Flight:
        return self

    async def __anext__(self) -> RequestOutput:
        return self._unpack(await self._queue.get())

    def get_nowait(self) -> RequestOutput | None:
        """The next output if one is already here (to merge a burst), else None."""
        if self._queue.empty():
            return None
        return self._unpack(self._queue.get_nowait())

    def _unpack(self, item: Any) -> RequestOutput:
        if item is _END:
            self._queue.put_nowait(_END)  # stay exhausted
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        self.last = item
        return item

    def release(self) -> None:
        """Give the request's place back; abort it in the engine if it is still running."""
        if self._released:
            return
        self._released = True
        if self.stream is not None and not self.stream.finished:
            self.stream.abort()
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()
        self.state._release(self)


def request_cost(prompt_tokens: int, max_tokens: int, n: int, max_model_len: int) -> int:
    """The tokens one prompt of a request may make the engine hold: ``n x (prompt + output)``.

    Each of the ``n`` samples holds at most ``max_model_len`` tokens (the
    engine stops a sample there), so a sample's cost is
    ``min(prompt_tokens + max_tokens, max_model_len)``. Under the paged
    allocators the samples share the prompt's pages, but each runs its own
    decode and counts its own prompt: the cost bounds the work, not only the
    memory.
    """
    return n * min(prompt_tokens + max_tokens, max_model_len)


class ServerState:
    """Admission counts and the drain of one server (see the module docstring)."""

    def __init__(
        self,
        llm: AsyncLLM,
        *,
        max_queued_requests: int,
        max_requests_per_client: int | None,
        retry_after_s: int,
        step_grace_s: float = 2.0,
        max_queued_tokens: int | None = None,
        max_tokens_per_client: int | None = None,
    ) -> None:
        self.llm = llm
        self.max_queued_requests = max_queued_requests
        self.max_requests_per_client = max_requests_per_client
        self.max_queued_tokens = max_queued_tokens
        self.max_tokens_per_client = max_tokens_per_client
        self.client_cost: Counter[str] = Counter()
        self.retry_after_s = retry_after_s
        self.step_grace_s = step_grace_s
        self.flights: set[Flight] = set()
        self.per_client: Counter[str] = Counter()
        self.draining = False
        self._deadline: float | None = None  # monotonic; when open requests are aborted
        self._cut_at_deadline = False  # a second signal: cut at once, no step grace
        self._drain_task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self.on_drained: list[Callable[[], None]] = []
        self.drained = False
        # set when the drain ended requests itself because the engine was still in a step
        self.engine_stuck = False

    # ------------------------------------------------------------------ admission
    @property
    def num_queued(self) -> int:
        """Open requests (prompts) with no output yet: waiting for a place in the batch."""
        return sum(1 for f in self.flights if not f.started)

    @property
    def queued_cost(self) -> int:
        """Tokens of the open requests that have not produced a first output yet."""
        return sum(f.cost for f in self.flights if not f.started)

    def check_cost(self, cost: int) -> None:
        """Refuse (400) a request whose cost alone is over a budget: it could never be admitted."""
        for budget, flag in (
            (self.max_queued_tokens, "--max-queued-tokens"),
            (self.max_tokens_per_client, "--max-tokens-per-client"),
        ):
            if budget is not None and cost > budget:
                raise APIError(
                    400,
                    f"this request costs {cost} tokens (prompt tokens x n + max_tokens x n), "
                    f"over this server's budget of {budget} ({flag}); lower n, max_tokens or "
                    "the prompt, or split it over several requests",
                    param="max_tokens",
                    code="request_too_costly",
                )

    def admit_many(self, client: str, costs: list[int]) -> list[Flight]:
        """Places for all prompts of one request at once (each its own :class:`Flight`), or an
        :class:`APIError` (400, 429, 503) that admits none of them."""
        total = sum(costs)
        self.check_cost(total)
        self._check_room(client, total, len(costs))
        flights = [Flight(self, client, cost) for cost in costs]
        for flight in flights:
            self.flights.add(flight)
            self.per_client[client] += 1
            self.client_cost[client] += flight.cost
        return flights

    def admit(self, client: str, cost: int = 0) -> Flight:
        """A place for a new request of ``client`` costing ``cost`` tokens, or an
        :class:`APIError` (400, 429, 503)."""
        return self.admit_many(client, [cost])[0]

    def _check_room(self, client: str, cost: int, count: int) -> None:
        """Refuse (429, 503) what does not fit now; ``count`` flights costing ``cost`` in all."""
        if self.draining or not self.llm.accepting:
            raise APIError(
                503,
                "the server is shutting down and accepts no new request; send it to another "
                "server or retry after it restarts",
                type="server_error",
                code="shutting_down",
                headers={"Connection": "close"},
            )
        if self.llm.rollout.is_sleeping():
            raise asleep_error(self.retry_after_s)
        queued, per_client = self.num_queued, self.per_client[client]
        queued_cost, client_cost = self.queued_cost, self.client_cost[client]
        client_cap = self.max_requests_per_client
        queue_budget, client_budget = self.max_queued_tokens, self.max_tokens_per_client
        # (over the cap, why, code): the first cap exceeded is the 429's answer
        checks = (
            (
                queued + count > self.max_queued_requests,
                f"the server already has {queued} requests waiting (--max-queued-requests "
                f"{self.max_queued_requests}); retry after {self.retry_after_s} s",
                "too_many_requests",
            ),
            (
                client_cap is not None and per_client + count > client_cap,
                f"this client already has {per_client} requests open (--max-requests-per-client "
                f"{client_cap}); wait for one to finish and retry",
                "too_many_requests_per_client",
            ),
            (
                queue_budget is not None and queued_cost + cost > queue_budget,
                f"the requests waiting already cost {queued_cost} tokens and this one {cost}, "
                f"over the queue's budget of {queue_budget} (--max-queued-tokens); retry after "
                f"{self.retry_after_s} s",
                "too_many_queued_tokens",
            ),
            (
                client_budget is not None and client_cost + cost > client_budget,
                f"this client's open requests already cost {client_cost} tokens and this one "
                f"{cost}, over {client_budget} (--max-tokens-per-client); wait for one to finish and "
                "retry",
                "too_many_tokens_per_client",
            ),
        )
        for over, message, code in checks:
            if over:
                raise APIError(
                    429,
                    message,
                    type="server_error",
                    code=code,
                    headers={"Retry-After": str(self.retry_after_s)},
                )

    def _release(self, flight: Flight) -> None:
        self.flights.discard(flight)
        self.per_client[flight.client] -= 1
        if self.per_client[flight.client] <= 0:
            del self.per_client[flight.client]
        self.client_cost[flight.client] -= flight.cost
        if self.client_cost[flight.client] <= 0:
            del self.client_cost[flight.client]
        self._changed.set()

    # ------------------------------------------------------------------ drain
    def begin_drain(self, grace_s: float) -> None:
        """Start draining (first call) or shorten the drain (later calls; ``0`` cuts at once)."""
        now = time.monotonic()
        deadline = now + max(0.0, grace_s)
        first = not self.draining
        self.draining = True
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline
        if not first:
            self._cut_at_deadline = True
            log.info("second signal: ending %d open request(s) now", len(self.flights))
        else:
            log.info(
                "draining: %d open request(s) may finish for up to %.1f s",
                len(self.flights),
                grace_s,
            )
        # The engine refuses new requests and aborts what runs at the deadline.
        self.llm.begin_shutdown(max(0.0, self._deadline - now))
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        self._changed.set()

    async def _wait_for_change(self, timeout: float) -> None:
        """Sleep until a request is released or the drain changes, or ``timeout`` passes."""
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), max(0.0, timeout))
        except TimeoutError:
            pass

    async def _drain(self) -> None:
        try:
            # 1. Open requests finish, until the deadline (which a second signal moves closer).
            while self.flights and time.monotonic() < (self._deadline or 0.0):
                await self._wait_for_change((self._deadline or 0.0) - time.monotonic())
            # 2. The engine aborts them at its next step boundary: give it one step.
            grace_end = time.monotonic() + self.step_grace_s
            while self.flights and not self._cut_at_deadline and time.monotonic() < grace_end:
                await self._wait_for_change(grace_end - time.monotonic())
            # 3. A step still runs: end them here (final chunk + [DONE], or a JSON error).
            if self.flights:
                self.engine_stuck = True
                log.warning(
                    "ending %d open request(s) without the engine (a step is still running)",
                    len(self.flights),
                )
                for flight in list(self.flights):
                    flight.cut()
                end = time.monotonic() + 2.0
                while self.flights and time.monotonic() < end:
                    await self._wait_for_change(end - time.monotonic())
        finally:
            self.drained = True
            for callback in self.on_drained:
                callback()
