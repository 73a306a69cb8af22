"""A streamed answer (``stream: true``): server-sent events, one chunk per choice that moved.

The order is always: the first chunk (chat's role), choice chunks, the usage
chunk (when asked for), the error event (if any), ``data: [DONE]``. A
request the engine failed ends with an error event; one cut short by the
server's shutdown ends each open choice with ``finish_reason`` ``"length"``
and then an error event with code ``shutting_down``; one whose answer
reached ``--max-response-bytes`` likewise, with code ``response_too_large``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import attrs
from fastapi.responses import StreamingResponse

from pitstop.entrypoints.async_engine import EngineStepError
from pitstop.requests.outputs import CompletionOutput, RequestOutput
from pitstop.server.api_errors import engine_error, request_failed, shutdown_error
from pitstop.server.budget import ResponseBudget
from pitstop.server.limits import Flight, ServerCut
from pitstop.server.metrics import ServerMetrics
from pitstop.server.protocol import APIError
from pitstop.server.render import OPENAI_FINISH, usage_of

# A chunk builder of a streamed answer: (choice index, text, finish reason, new tokens, output).
ChunkFn = Callable[[int, str, str | None, int, RequestOutput | None], dict[str, Any]]
# The usage chunk of a streamed answer, from its final output.
UsageFn = Callable[[RequestOutput], dict[str, Any]]


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <compact JSON or the text>`` and a blank line."""
    payload = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {payload}\n\n"


def stop_reason(out: RequestOutput | None, index: int, finish: str | None) -> str | int | None:
    """vLLM's ``stop_reason`` of a streamed choice: on its last chunk, the stop string or
    stop token id that ended it (None for EOS, length, or before the end)."""
    if finish is None or out is None:
        return None
    return out.outputs[index].stop_reason


@attrs.frozen
class AnswerHead:
    """What every answer and stream chunk of one request carries besides its choices."""

    request_id: str
    created: int
    model: str
    include_usage: bool  # stream_options.include_usage: chunks carry "usage": null

    def body(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """An answer (or chunk) of object type ``obj`` around ``choices``."""
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A stream chunk: :meth:`body`, with ``"usage": null`` when usage is asked for."""
        extra = {"usage": None} if self.include_usage else {}
        return {**self.body(obj, choices), **extra}

    def usage_chunk(self, obj: str, final: RequestOutput) -> dict[str, Any]:
        """The stream's last chunk before [DONE] when usage is asked for."""
        return {**self.body(obj, []), "usage": usage_of([final])}

    def choice_chunk(
        self,
        obj: str,
        index: int,
        content: dict[str, Any],
        logprobs: Any,
        finish: str | None,
        out: RequestOutput | None,
    ) -> dict[str, Any]:
        """A stream chunk of choice ``index``: its ``content`` (``text`` or ``delta``),
        ``logprobs``, ``finish_reason`` and ``stop_reason`` (:func:`stop_reason`)."""
        choice = {
            "index": index,
            **content,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop_reason(out, index, finish),
        }
        return self.chunk(obj, [choice])


def chunk_logprobs(
    render: Callable[[CompletionOutput, int, int], Any],
    out: RequestOutput | None,
    index: int,
    k: int | None,
    count: int,
) -> Any:
    """The logprobs of a chunk's ``count`` new tokens of choice ``index`` (``render``:
    completions' or chat's shape), None when none were asked for or none came."""
    if k is None or not count or out is None:
        return None
    return render(out.outputs[index], k, count)


class FlightResponse(StreamingResponse):
    """A streamed answer that gives its request's place back however it ends."""

    def __init__(self, content: AsyncIterator[str], flight: Flight, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.flight = flight

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.flight.release()


def _burst(flight: Flight, out: RequestOutput) -> tuple[list[RequestOutput], Exception | None]:
    """``out`` and the outputs already queued behind it, merged into one event per choice,
    with the error queued after them if one ended the stream (its outputs are sent first)."""
    burst = [out]
    try:
        while not burst[-1].finished and (more := flight.get_nowait()) is not None:
            burst.append(more)
    except StopAsyncIteration:
        pass
    except Exception as exc:  # noqa: BLE001 - raised by the caller once the burst is sent
        return burst, exc
    return burst, None


def _burst_events(
    burst: list[RequestOutput], finished: set[int], make_chunk: ChunkFn, *, failed: bool
) -> Iterator[str]:
    """The events of a burst: a chunk per choice that moved (text, tokens or its finish);
    of a failed request only the text, with no finish reason."""
    last = burst[-1]
    for k, choice in enumerate(last.outputs):
        delta = "".join(o.outputs[k].text_delta for o in burst)
        count = sum(len(o.outputs[k].new_token_ids) for o in burst)
        done = choice.finish_reason is not None and k not in finished
        if failed:
            if delta:
                yield sse(make_chunk(k, delta, None, count, last))
            continue
        if delta or count or done:
            reason = OPENAI_FINISH[choice.finish_reason] if done else None
            if done:
                finished.add(k)
            yield sse(make_chunk(k, delta, reason, count, last))


def _metered(
    events: Iterator[str], budget: ResponseBudget | None, over: list[bool]
) -> Iterator[str]:
    """``events`` while the answer stays within ``budget``; at the first event that would
    pass it, stop and append True to ``over``."""
    for event in events:
        if budget is not None and not budget.take(len(event.encode("utf-8"))):
            over.append(True)
            return
        yield event


def _cut_choices(
    num_choices: int, finished: set[int], make_chunk: ChunkFn, flight: Flight
) -> Iterator[str]:
    """A last chunk with ``finish_reason: "length"`` for every choice not yet finished (a
    request the server ended: shutdown, or the response budget)."""
    for k in range(num_choices):
        if k not in finished:
            yield sse(make_chunk(k, "", "length", 0, flight.last))


async def _events(
    flight: Flight,
    metrics: ServerMetrics,
    make_chunk: ChunkFn,
    first: dict[str, Any] | None,
    usage_chunk: UsageFn | None,
    num_choices: int,
    budget: ResponseBudget | None,
) -> AsyncIterator[str]:
    finished: set[int] = set()  # choices whose finish_reason was sent
    error: APIError | None = None  # the error event, sent after the usage chunk
    over_budget: list[bool] = []  # set by _metered when the answer reaches the budget
    try:
        if first is not None:
            yield sse(first)
        async for out in flight:
            burst, behind = _burst(flight, out)
            last = burst[-1]
            failed = last.finished and last.finish_reason not in OPENAI_FINISH
            events = _burst_events(burst, finished, make_chunk, failed=failed)
            for event in _metered(events, budget, over_budget):
                yield event
            if over_budget:
                assert budget is not None
                metrics.observe_request_failure("invalid_request")
                error = budget.error()  # the request is aborted by release() below
                for event in _cut_choices(num_choices, finished, make_chunk, flight):
                    yield event
                break
            if failed:
                metrics.observe_request_failure("request_error")
                error = request_failed(last.finish_reason)
                break
            if last.finished and any(c.finish_reason == "abort" for c in last.outputs):
                metrics.observe_request_failure("shutdown")
                error = shutdown_error()
            if behind is not None:
                raise behind
    except ServerCut:
        metrics.observe_request_failure("shutdown")
        for event in _cut_choices(num_choices, finished, make_chunk, flight):
            yield event
        error = shutdown_error()
    except EngineStepError as exc:
        metrics.observe_stream_error(exc)
        error = engine_error(exc)
    finally:
        flight.release()  # aborts the request if the client went away (cancelled)
    # One order, whatever ended the stream: choices, usage (when asked), error, [DONE].
    if usage_chunk is not None and flight.last is not None:
        yield sse(usage_chunk(flight.last))
    if error is not None:
        yield sse(error.to_dict())
    yield sse("[DONE]")


def sse_response(
    flight: Flight,
    metrics: ServerMetrics,
    make_chunk: ChunkFn,
    *,
    first: dict[str, Any] | None,
    usage_chunk: UsageFn | None,
    num_choices: int = 1,
    budget: ResponseBudget | None = None,
) -> StreamingResponse:
    """Stream one request's choices as SSE (the module's docstring gives the order); past
    ``budget`` the stream ends as :mod:`pitstop.server.budget` says."""
    return FlightResponse(
        _events(flight, metrics, make_chunk, first, usage_chunk, num_choices, budget),
        flight,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
