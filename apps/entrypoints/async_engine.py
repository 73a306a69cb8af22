"""`AsyncLLM`: an asyncio front end to :class:`~pitstop.loop.engine.LLMEngine`.

The engine is plain blocking code (a model forward holds a core for
milliseconds to seconds), so it steps in a thread of its own and the asyncio
event loop stays free to accept connections and stream tokens.

Only the engine thread touches the engine. Every other thread talks to it
through a command queue guarded by one condition variable: ``add`` (answered
through a future, so a request that fails validation raises in its own
caller and nowhere else), ``abort`` (fire and forget, from any thread) and
shutdown. Outputs travel back to each request's :class:`RequestStream`, an
``asyncio.Queue`` fed with ``loop.call_soon_threadsafe``. When there is
nothing to do the engine thread sleeps on the condition; it never spins.

After every batch of commands and every step the engine thread publishes an
:class:`EngineSnapshot` (request counts, allocator and engine statistics),
which other threads may read at any time without a lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs

from pitstop.config import EngineConfig
from pitstop.entrypoints.chat import render_chat
from pitstop.entrypoints.rollout.control import Rollout
from pitstop.entrypoints.rollout.device_memory import DeviceMemory, sleep_mode_memory
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.errors import InvalidRequestError, PitstopError
from pitstop.ground.metrics import EngineStats
from pitstop.loop.engine import LLMEngine
from pitstop.plugin_system.plugin_manager import PluginManager
from pitstop.plugin_system.protocols import AllocatorStats
from pitstop.requests.outputs import RequestOutput

log = logging.getLogger(__name__)

OutputListener = Callable[[RequestOutput], None]


class EngineClosedError(PitstopError):
    """The engine is shutting down (or shut down) and accepts no new request."""


class EngineStepError(PitstopError):
    """An engine step failed; the requests it held were aborted (the engine keeps serving)."""


@attrs.frozen
class EngineSnapshot:
    """A consistent picture of the engine, published by the engine thread."""

    num_running: int
    num_waiting: int
    allocator: AllocatorStats
    stats: EngineStats
    accepting: bool
    time: float

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache pages in use (0.0 to 1.0)."""
        a = self.allocator
        return 1.0 - a.pages_free / a.num_pages if a.num_pages else 0.0


class RequestStream:
    """The outputs of one request, as an async iterator; ends after the final output.

    Iterate it on the event loop that added the request. An engine failure
    is raised from the iterator (:class:`EngineStepError`). ``abort()`` stops
    the request; the iterator then yields a final output with
    ``finish_reason="abort"``.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, owner: AsyncLLM) -> None:
        self.request_id = request_id
        self._loop = loop
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False  # the final output (or an error) was consumed
        self.final: RequestOutput | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return self._take(await self._queue.get())

    def get_nowait(self) -> RequestOutput | None:
        """The next output if one is already queued (to merge bursts), else None."""
        if self.finished or self._queue.empty():
            return None
        return self._take(self._queue.get_nowait())

    def _take(self, item: RequestOutput | BaseException) -> RequestOutput:
        """An item off the queue: an error ends the stream and is raised; the final output is kept."""
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            self.final = item
        return item

    def abort(self) -> None:
        """Stop this request now (thread-safe; a no-op once it finished)."""
        self._owner.abort(self.request_id)

    # called by the engine thread
    def _push(self, item: RequestOutput | BaseException) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody will read this
            return False
        return True


@attrs.define
class _Add:
    stream: RequestStream
    prompt: str | None
    params: SamplingParams | None
    prompt_token_ids: list[int] | None
    messages: list[dict[str, Any]] | None
    arrival_time: float
    future: concurrent.futures.Future[None]
    lora_request: Any = None


@attrs.define
class _Abort:
    request_id: str


@attrs.define
class _Call:
    """A function run on the engine thread between two steps (sleep, wake, weight updates)."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any]


class AsyncLLM:
    """Serve one :class:`LLMEngine` from a background thread to asyncio callers.

    >>> llm = AsyncLLM.from_config(EngineConfig(model="smollm2-135m"))  # doctest: +SKIP
    >>> async for out in llm.generate("Hello", SamplingParams(max_tokens=8)):  # doctest: +SKIP
    ...     print(out.text_delta, end="")
    >>> await llm.shutdown()  # doctest: +SKIP
    """

    def __init__(
        self, engine: LLMEngine, *, start: bool = True, memory: DeviceMemory | None = None
    ) -> None:
        """``memory``: how sleep releases device memory (the engine was built with its
        ``region``; None: sleep mode off)."""
        self.engine = engine
        self.rollout = Rollout(engine, memory)
        """Sleep, wake and weight updates; call them through :meth:`call`."""
        self._cond = threading.Condition(threading.Lock())
        self._commands: list[_Add | _Abort | _Call] = []
        self._accepting = True
        self._stopping = False
        self._deadline: float | None = None  # after it, the engine aborts what still runs
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._listeners: list[OutputListener] = []
        self._failure_listeners: list[Callable[[int], None]] = []
        self._step_failures_seen = 0
        self._thread: threading.Thread | None = None
        self.snapshot = self._take_snapshot()
        if start:
            self.start()

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        plugins: PluginManager | None = None,
        *,
        enable_sleep_mode: bool = False,
    ) -> AsyncLLM:
        """Build the engine (loads the model, blocking) and start its thread;
        ``enable_sleep_mode``: allocate it so that ``rollout.sleep`` can free its memory."""
        memory = sleep_mode_memory(config, enable_sleep_mode)
        region = memory.region if memory is not None else None
        return cls(LLMEngine(config, plugins, memory_region=region), memory=memory)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine thread between two steps and return its result (its
        exception is raised here): what changes the engine's memory or weights runs there,
        so no step is in flight meanwhile."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                raise EngineClosedError("the engine is shutting down")
            self._commands.append(_Call(fn, future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    # ------------------------------------------------------------------ properties
    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (with ``max_model_len`` filled in)."""
        return self.engine.config

    @property
    def accepting(self) -> bool:
        """Whether new requests are accepted (false once shutdown began)."""
        return self._accepting

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def add_output_listener(self, listener: OutputListener) -> None:
        """Call ``listener(output)`` on the engine thread for every output (metrics); keep it cheap."""
        self._listeners.append(listener)

    def add_failure_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(0)`` on the engine thread for every step the engine isolated a failure in.

        The requests such a step failed come out as outputs with
        ``finish_reason="error"`` (the others in the step ran on), so the
        argument, the number of requests the step itself failed, is 0.
        """
        self._failure_listeners.append(listener)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pitstop-engine", daemon=True)
        self._thread.start()

    def begin_shutdown(self, grace_s: float | None = 0.0) -> None:
        """Stop accepting requests; let running ones finish for ``grace_s`` seconds, then abort them.

        ``grace_s=None`` waits for every request to finish. Thread-safe and
        non-blocking; :meth:`shutdown` also waits for the thread to end.
        """
        with self._cond:
            deadline = None if grace_s is None else time.monotonic() + max(0.0, grace_s)
            if self._stopping and self._deadline is not None:
                deadline = self._deadline if deadline is None else min(deadline, self._deadline)
            self._accepting = False
            self._stopping = True
            self._deadline = deadline
            self._cond.notify()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the engine thread to end; true when it has."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    async def shutdown(self, grace_s: float | None = 0.0) -> None:
        """Stop accepting, finish or abort what runs (see :meth:`begin_shutdown`), join the thread."""
        self.begin_shutdown(grace_s)
        await asyncio.to_thread(self.join)

    def close(self, grace_s: float | None = 0.0) -> None:
        """Blocking :meth:`shutdown`, for code outside an event loop."""
        self.begin_shutdown(grace_s)
        self.join()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # ------------------------------------------------------------------ requests
    async def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[dict[str, Any]] | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
    ) -> RequestStream:
        """Queue a request and return its stream once the engine accepted it.

        Give one of ``prompt`` (text), ``prompt_token_ids`` or ``messages``
        (a chat, rendered with the model's template on the engine thread,
        which owns the tokenizer). Raises :class:`InvalidRequestError` when
        the engine rejects the request, :class:`EngineClosedError` during
        shutdown. ``arrival_time`` (``time.perf_counter``) defaults to now.
        ``lora_request``: the adapter it runs with (needs ``enable_lora``).
        """
        loop = asyncio.get_running_loop()
        rid = request_id or f"req-{uuid.uuid4().hex}"
        stream = RequestStream(rid, loop, self)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        command = _Add(
            stream=stream,
            prompt=prompt,
            params=params,
            prompt_token_ids=None if prompt_token_ids is None else list(prompt_token_ids),
            messages=None if messages is None else [dict(m) for m in messages],
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
            future=future,
            lora_request=lora_request,
        )
        with self._cond:
            if not self._accepting:
                raise EngineClosedError("the engine is shutting down and accepts no new request")
            self._commands.append(command)
            self._cond.notify()
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.abort(rid)  # the caller went away while the request was queued
            raise
        return stream

    async def generate(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[dict[str, Any]] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; leaving the loop early aborts it."""
        stream = await self.add_request(
            prompt,
            params,
            prompt_token_ids=prompt_token_ids,
            messages=messages,
            request_id=request_id,
        )
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request by id, from any thread; unknown or finished ids are ignored."""
        with self._cond:
            self._commands.append(_Abort(request_id))
            self._cond.notify()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while (
                    not self._commands
                    and not engine.has_unfinished_requests()
                    and not self._stopping
                ):
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping, deadline = self._stopping, self._deadline
            for command in commands:
                if isinstance(command, _Add):
                    self._apply_add(command)
                elif isinstance(command, _Call):
                    self._apply_call(command)
                else:
                    self._apply_abort(command.request_id)
            if stopping and deadline is not None and time.monotonic() >= deadline:
                for rid in list(self._streams):
                    self._apply_abort(rid)
            if engine.has_unfinished_requests():
                self._step()
            else:
                self.snapshot = self._take_snapshot()
            if stopping and not engine.has_unfinished_requests():
                with self._cond:
                    if not self._commands:
                        break
        log.info("engine thread stopped")

    def _apply_call(self, cmd: _Call) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        try:
            result = cmd.fn()
        except BaseException as exc:  # noqa: BLE001 - the caller gets it
            cmd.future.set_exception(exc)
        else:
            cmd.future.set_result(result)
        self.snapshot = self._take_snapshot()

    def _apply_add(self, cmd: _Add) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        try:
            self.rollout.check_can_generate()  # asleep: refused, never accepted and dropped
            ids = cmd.prompt_token_ids
            if cmd.messages is not None:
                tokenizer = self.engine.tokenizer
                if tokenizer is None:
                    raise InvalidRequestError(
                        f"model {self.config.model!r} has no tokenizer, so no chat template"
                    )
                ids = render_chat(tokenizer, cmd.messages).token_ids
            self.engine.add_request(
                cmd.prompt,
                cmd.params,
                prompt_token_ids=ids,
                request_id=cmd.stream.request_id,
                arrival_time=cmd.arrival_time,
                lora_request=cmd.lora_request,
            )
        except PitstopError as exc:
            cmd.future.set_exception(exc)
            return
        except (ValueError, TypeError, KeyError) as exc:  # malformed input the engine did not name
            cmd.future.set_exception(InvalidRequestError(f"invalid request: {exc}"))
            return
        except Exception as exc:  # noqa: BLE001 - a bug: fail this request only, keep serving
            log.exception("adding request %s failed", cmd.stream.request_id)
            cmd.future.set_exception(exc)
            return
        self._streams[cmd.stream.request_id] = cmd.stream
        cmd.future.set_result(None)

    def _apply_abort(self, request_id: str) -> None:
        try:
            out = self.engine.abort(request_id)
        except Exception:  # noqa: BLE001
            log.exception("aborting request %s failed", request_id)
            out = None
        if out is not None:
            self.snapshot = self._take_snapshot()  # before the caller sees the final output
            self._deliver([out])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the live requests, keep the loop alive
            log.exception("engine step failed; aborting %d request(s)", len(self._streams))
            error = EngineStepError(f"the engine step failed: {type(exc).__name__}: {exc}")
            for rid, stream in list(self._streams.items()):
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001
                    log.exception("aborting request %s after a failed step failed", rid)
                stream._push(error)
                self._streams.pop(rid, None)
            self.snapshot = self._take_snapshot()
            if self.engine.has_unfinished_requests():
                time.sleep(0.05)  # the engine is wedged: do not spin on it
            return
        self.snapshot = self._take_snapshot()  # before callers see the outputs
        failures = self.engine.stats.step_failures - self._step_failures_seen
        if failures:
            self._step_failures_seen += failures
            for listener in self._failure_listeners:
                for _ in range(failures):
                    try:
                        listener(0)
                    except Exception:  # noqa: BLE001
                        log.exception("failure listener %r failed", listener)
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Each output to the listeners (the server's metrics), then to its request's stream:
        a client that has read a request's last output finds it counted in ``/metrics``."""
        for out in outputs:
            for listener in self._listeners:
                try:
                    listener(out)
                except Exception:  # noqa: BLE001
                    log.exception("output listener %r failed", listener)
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
            if stream is not None and not stream._push(out) and not out.finished:
                self._apply_abort(out.request_id)  # its reader is gone

    def _take_snapshot(self) -> EngineSnapshot:
        engine = self.engine
        return EngineSnapshot(
            num_running=engine.scheduler.num_running,
            num_waiting=engine.scheduler.num_waiting,
            allocator=engine.allocator.stats(),
            stats=attrs.evolve(engine.stats),
            accepting=self._accepting,
            time=time.time(),
        )
