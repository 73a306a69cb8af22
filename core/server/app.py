"""The FastAPI app: OpenAI's completions and chat routes over an :class:`AsyncLLM`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events ending in ``data: [DONE]``),
``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus).

Every error is OpenAI's JSON error object with a 4xx status: 400 for bad
JSON or parameters (and a prompt over ``max_model_len``), 401 for a missing
or wrong API key, 404 for an unknown model or route, 413 for a body over the
size limit, 503 while shutting down. A client that goes away aborts its
request at once, which frees its KV-cache pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pitstop.async_engine import AsyncLLM, EngineClosedError, EngineStepError, RequestStream
from pitstop.errors import InvalidRequestError
from pitstop.outputs import RequestOutput
from pitstop.sampling_params import SamplingParams
from pitstop.server.metrics import ServerMetrics
from pitstop.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
    now,
    usage,
)

log = logging.getLogger(__name__)

BodyT = TypeVar("BodyT", bound=BaseModel)

# A client that sends a body over the limit is answered 413 after its body is
# read and thrown away (so it sees the answer rather than a reset), up to this
# many extra bytes; past them the connection is closed.
_DRAIN_EXTRA_BYTES = 8 << 20


@attrs.frozen(kw_only=True)
class ServerSettings:
    """What the HTTP layer needs besides the engine."""

    api_key: str | None = None  # every /v1 route then needs "Authorization: Bearer KEY"
    max_body_bytes: int = 1 << 20
    served_model_name: str | None = None  # default: the engine's model setting
    drain_timeout_s: float = 10.0  # on shutdown, how long running requests may finish before abort


def _sse(data: dict[str, Any] | str) -> str:
    payload = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {payload}\n\n"


def _invalid_request(exc: InvalidRequestError, prompt_param: str) -> APIError:
    message = str(exc)
    if "max_model_len" in message:
        return APIError(400, message, param=prompt_param, code="context_length_exceeded")
    first = message.split(" ", 1)[0]
    param = (
        first
        if first in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "stop")
        else prompt_param
    )
    return APIError(400, message, param=param)


def create_app(llm: AsyncLLM, settings: ServerSettings | None = None) -> FastAPI:
    """Build the app around a started :class:`AsyncLLM`; shutting the app down shuts the engine down."""
    settings = settings or ServerSettings()
    model_name = settings.served_model_name or llm.config.model
    model_aliases = {model_name, llm.config.model}
    metrics = ServerMetrics(llm, model_name)
    started = now()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        llm.start()
        yield
        log.info("shutting the engine down (grace %.1f s)", settings.drain_timeout_s)
        await llm.shutdown(settings.drain_timeout_s)

    app = FastAPI(
        title="pitstop", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.llm = llm
    app.state.metrics = metrics
    app.state.settings = settings

    # ------------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        headers = {"Connection": "close"} if exc.status == 413 else None
        if exc.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(err.to_dict(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, str(exc)).to_dict(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.to_dict(), status_code=500)

    # ------------------------------------------------------------------ helpers
    def check_auth(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip(), settings.api_key
        ):
            raise APIError(
                401,
                "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    def check_model(name: str | None) -> None:
        if name and name not in model_aliases:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def read_body(request: Request, model: type[BodyT]) -> BodyT:
        limit = settings.max_body_bytes
        too_large = APIError(
            413,
            f"the request body is over the limit of {limit} bytes (--max-body-bytes)",
            code="request_too_large",
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit + _DRAIN_EXTRA_BYTES:
            raise too_large
        body = bytearray()
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                body += chunk
            elif size > limit + _DRAIN_EXTRA_BYTES:
                break
        if size > limit:
            raise too_large
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = [str(p) for p in first.get("loc", ())]
            param = ".".join(loc) or None
            raise APIError(
                400, f"{param or 'body'}: {first.get('msg')}", param=loc[0] if loc else None
            ) from exc

    async def add(
        request_id: str,
        params: SamplingParams,
        *,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        arrival: float,
    ) -> RequestStream:
        try:
            return await llm.add_request(
                prompt,
                params,
                prompt_token_ids=prompt_token_ids,
                messages=messages,
                request_id=request_id,
                arrival_time=arrival,
            )
        except InvalidRequestError as exc:
            raise _invalid_request(exc, "messages" if messages is not None else "prompt") from exc
        except EngineClosedError as exc:
            raise APIError(503, str(exc), type="server_error", code="shutting_down") from exc

    async def watch_disconnect(request: Request, stream: RequestStream) -> None:
        while not stream.finished:
            if await request.is_disconnected():
                log.info("client of %s went away: aborting", stream.request_id)
                stream.abort()
                return
            await asyncio.sleep(0.1)

    async def collect(request: Request, stream: RequestStream) -> RequestOutput:
        """Wait for the final output; abort if the client disconnects meanwhile."""
        watcher = asyncio.create_task(watch_disconnect(request, stream))
        try:
            final: RequestOutput | None = None
            async for out in stream:
                final = out
            assert final is not None
            return final
        except EngineStepError as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_error") from exc
        finally:
            watcher.cancel()
            if not stream.finished:
                stream.abort()

    def sse_response(
        stream: RequestStream,
        make_chunk: Callable[[str, str | None], dict[str, Any]],
        *,
        first: dict[str, Any] | None,
        usage_chunk: Callable[[RequestOutput], dict[str, Any]] | None,
    ) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            try:
                if first is not None:
                    yield _sse(first)
                async for out in stream:
                    delta, last = out.text_delta, out
                    while not last.finished and (more := stream.get_nowait()) is not None:
                        delta, last = delta + more.text_delta, more  # merge a burst into one event
                    if delta or last.finished:
                        yield _sse(make_chunk(delta, last.finish_reason if last.finished else None))
                if usage_chunk is not None and stream.final is not None:
                    yield _sse(usage_chunk(stream.final))
            except EngineStepError as exc:
                yield _sse(
                    APIError(503, str(exc), type="server_error", code="engine_error").to_dict()
                )
            finally:
                if not stream.finished:  # the client went away (cancelled) or we failed
                    stream.abort()
            yield _sse("[DONE]")

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # ------------------------------------------------------------------ routes
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        check_auth(request)
        body = await read_body(request, CompletionRequest)
        check_model(body.model)
        prompt, ids = body.prompt_input()
        params = body.sampling_params(16 if body.max_tokens is None else body.max_tokens)
        rid = new_id("cmpl")
        stream = await add(rid, params, prompt=prompt, prompt_token_ids=ids, arrival=arrival)
        created = now()
        extra = {"usage": None} if body.include_usage else {}

        def base(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": choices,
            }

        if body.stream:

            def chunk(text: str, finish: str | None) -> dict[str, Any]:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                return {**base([choice]), **extra}

            def usage_chunk(final: RequestOutput) -> dict[str, Any]:
                return {
                    **base([]),
                    "usage": usage(len(final.prompt_token_ids), len(final.token_ids)),
                }

            return sse_response(
                stream, chunk, first=None, usage_chunk=usage_chunk if body.include_usage else None
            )
        final = await collect(request, stream)
        choice = {
            "index": 0,
            "text": final.text,
            "logprobs": None,
            "finish_reason": final.finish_reason,
        }
        return JSONResponse(
            {**base([choice]), "usage": usage(len(final.prompt_token_ids), len(final.token_ids))}
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        check_auth(request)
        body = await read_body(request, ChatCompletionRequest)
        check_model(body.model)
        messages = body.template_messages()
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        # No limit given: the engine stops at max_model_len.
        params = body.sampling_params(
            (llm.config.max_model_len or 4096) if max_tokens is None else max_tokens
        )
        rid = new_id("chatcmpl")
        stream = await add(rid, params, messages=messages, arrival=arrival)
        created = now()
        extra = {"usage": None} if body.include_usage else {}

        def base(obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model_name,
                "choices": choices,
            }

        if body.stream:
            obj = "chat.completion.chunk"
            first = {
                **base(
                    obj,
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                ),
                **extra,
            }

            def chunk(text: str, finish: str | None) -> dict[str, Any]:
                delta = {"content": text} if text else {}
                return {
                    **base(
                        obj,
                        [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                    ),
                    **extra,
                }

            def usage_chunk(final: RequestOutput) -> dict[str, Any]:
                return {
                    **base(obj, []),
                    "usage": usage(len(final.prompt_token_ids), len(final.token_ids)),
                }

            return sse_response(
                stream, chunk, first=first, usage_chunk=usage_chunk if body.include_usage else None
            )
        final = await collect(request, stream)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": final.text},
            "logprobs": None,
            "finish_reason": final.finish_reason,
        }
        return JSONResponse(
            {
                **base("chat.completion", [choice]),
                "usage": usage(len(final.prompt_token_ids), len(final.token_ids)),
            }
        )

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        card = {
            "id": model_name,
            "object": "model",
            "created": started,
            "owned_by": "pitstop",
            "root": llm.config.model,
            "max_model_len": llm.config.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> JSONResponse:
        snap = llm.snapshot
        ok = llm.accepting and llm.is_running
        return JSONResponse(
            {
                "status": "ok" if ok else "draining",
                "model": model_name,
                "num_running": snap.num_running,
                "num_waiting": snap.num_waiting,
                "pages_free": snap.allocator.pages_free,
                "num_pages": snap.allocator.num_pages,
                "kv_cache_usage": snap.kv_cache_usage,
            },
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
