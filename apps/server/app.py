"""The FastAPI app: OpenAI's completions and chat routes over an :class:`AsyncLLM`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events ending in ``data: [DONE]``),
``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize``,
``POST /detokenize``, ``GET /health`` and ``GET /metrics`` (Prometheus).
Any other path is a JSON 404 that says the server has no such endpoint.

Every error is OpenAI's JSON error object: 400 for bad JSON or parameters
(and a prompt over ``max_model_len``), 401 for a missing, malformed or wrong
API key, 403 for a refused ``Host`` or ``Origin``, 404 for an unknown model
or route, 408 for a request not received in time, 413 for a body over the
size limit, 415 for a body that is not declared JSON, 429 (with
``Retry-After``) beyond the queue or per-client limits, 503 while shutting
down. A client that goes away aborts its request at once, which frees its
KV-cache pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pitstop.async_engine import AsyncLLM, EngineClosedError, EngineStepError
from pitstop.chat import ChatOptions, RenderedChat, render_chat, template_reads_tools
from pitstop.errors import InvalidRequestError, PluginError
from pitstop.outputs import RequestOutput
from pitstop.sampling_params import SamplingParams
from pitstop.server.errors import validation_message
from pitstop.server.limits import Flight, ServerCut, ServerState, request_cost
from pitstop.server.metrics import ServerMetrics, failure_reason
from pitstop.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    new_id,
    now,
    parse_json_body,
)
from pitstop.server.render import OPENAI_FINISH as _OPENAI_FINISH
from pitstop.server.render import (
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
    usage_of,
)
from pitstop.server.security import RequestGuard
from pitstop.server.tools import ChatTools, plan_tools
from pitstop.validation import check_encoded_prompt, check_token_ids

log = logging.getLogger(__name__)

BodyT = TypeVar("BodyT", bound=BaseModel)

# A client that sends a body over the limit is answered 413 after its body is
# read and thrown away (so it sees the answer rather than a reset), up to this
# many extra bytes; past them the connection is closed.
_DRAIN_EXTRA_BYTES = 8 << 20

ROUTES = (
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "GET /v1/models",
    "GET /v1/models/{id}",
    "POST /tokenize",
    "POST /detokenize",
    "GET /health",
    "GET /metrics",
)

# A chunk builder of a streamed answer: (choice index, text, finish reason, new tokens, output).
ChunkFn = Callable[[int, str, str | None, int, RequestOutput | None], dict[str, Any]]


@attrs.frozen(kw_only=True)
class ServerSettings:
    """What the HTTP layer needs besides the engine (the flags of ``pitstop serve``)."""

    api_key: str | None = None  # every /v1 route then needs "Authorization: Bearer KEY"
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # more accepted keys
    max_body_bytes: int = 1 << 20
    served_model_name: str | None = None  # default: the engine's model setting
    drain_timeout_s: float = 10.0  # on shutdown, how long running requests may finish before abort
    allowed_hosts: tuple[str, ...] | None = None  # None: no Host check ("*" too)
    allowed_origins: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # "*": any
    max_json_depth: int = 32  # nesting of arrays and objects in a body
    read_timeout_s: float = 30.0  # to receive a whole request (headers and body)
    max_connections: int = 1024  # open TCP connections; more get 429
    max_queued_requests: int = 1024  # requests waiting for a place in the batch; more get 429
    max_requests_per_client: int | None = None  # open requests per API key (or address)
    # Costs in tokens (prompt tokens x n + max_tokens x n, limits.request_cost):
    max_queued_tokens: int | None = 1 << 20  # of the requests waiting; more get 429
    max_tokens_per_client: int | None = None  # of a client's open requests; more get 429
    max_n: int = 16  # samples per prompt (n); more get 400 (n=128 x 1 token stalled others)
    max_prompts_per_request: int = 64  # prompts in one completions list; more get 400
    retry_after_s: int = 1  # the Retry-After of a 429
    step_grace_s: float = 2.0  # after the drain, how long the engine may take to abort
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str | None = None  # a tool_parser plugin's name (hermes, llama3_json)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every accepted API key (empty: no authentication)."""
        return tuple(k for k in (self.api_key, *self.api_keys) if k)


def _sse(data: dict[str, Any] | str) -> str:
    payload = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {payload}\n\n"


def _stop_reason(out: RequestOutput | None, index: int, finish: str | None) -> str | int | None:
    """vLLM's ``stop_reason`` of a streamed choice: on its last chunk, the stop string or
    stop token id that ended it (None for EOS, length, or before the end)."""
    if finish is None or out is None:
        return None
    return out.outputs[index].stop_reason


def _invalid_request(
    exc: InvalidRequestError, prompt_param: str, structured_param: str | None = None
) -> APIError:
    message = str(exc)
    if "max_model_len" in message:
        return APIError(400, message, param=prompt_param, code="context_length_exceeded")
    first = message.split(" ", 1)[0].rstrip(":").split("[", 1)[0].split(".", 1)[0]
    if first == "structured_outputs" and structured_param is not None:
        return APIError(400, message, param=structured_param)
    param = (
        first
        if first
        in (
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop",
            "stop_token_ids",
            "messages",
            "logit_bias",
            "n",
            "min_tokens",
            "structured_outputs",
            "logprobs",
            "prompt_logprobs",
        )
        else prompt_param
    )
    return APIError(400, message, param=param)


def body_error(errors: Sequence[dict[str, Any]]) -> APIError:
    """The 400 of a body that fails the request models, in pitstop's words (server.errors)."""
    first = errors[0] if errors else {}
    if first.get("type") == "extra_forbidden":
        loc = [str(p) for p in first.get("loc", ())]
        return APIError(
            400,
            f"unknown field {'.'.join(loc)!r}: pitstop does not implement it, so it is refused "
            "rather than ignored; remove it (docs/server.md lists every field)",
            param=loc[0] if loc else None,
            code="unsupported_field",
        )
    param, message = validation_message(errors)
    return APIError(400, message, param=param)


def _shutdown_error() -> APIError:
    return APIError(
        503,
        "the server shut down before the request finished; send it again to another server "
        "or after the restart",
        type="server_error",
        code="shutting_down",
        headers={"Connection": "close"},
    )


def _engine_error(exc: BaseException) -> APIError:
    return APIError(503, str(exc), type="server_error", code="engine_error")


class _FlightResponse(StreamingResponse):
    """A streamed answer that gives its request's place back however it ends."""

    def __init__(self, content: AsyncIterator[str], flight: Flight, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.flight = flight

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.flight.release()


def create_app(llm: AsyncLLM, settings: ServerSettings | None = None) -> FastAPI:
    """Build the app around a started :class:`AsyncLLM`; shutting the app down shuts the engine down.

    ``app.state.server`` is the :class:`~pitstop.server.limits.ServerState`
    (admission counts, drain), ``app.state.metrics`` the
    :class:`~pitstop.server.metrics.ServerMetrics`.
    """
    settings = settings or ServerSettings()
    model_name = settings.served_model_name or llm.config.model
    model_aliases = {model_name, llm.config.model}
    metrics = ServerMetrics(llm, model_name)
    state = ServerState(
        llm,
        max_queued_requests=settings.max_queued_requests,
        max_requests_per_client=settings.max_requests_per_client,
        retry_after_s=settings.retry_after_s,
        step_grace_s=settings.step_grace_s,
        max_queued_tokens=settings.max_queued_tokens,
        max_tokens_per_client=settings.max_tokens_per_client,
    )
    keys = [k.encode("utf-8") for k in settings.keys]
    vocab_size: int = llm.engine.model_config.vocab_size
    tool_parser = None
    if settings.tool_call_parser is not None:
        tool_parser = llm.engine.plugins.create(
            "tool_parser", settings.tool_call_parser, llm.engine.tokenizer
        )
    elif settings.enable_auto_tool_choice:
        raise PluginError(
            "--enable-auto-tool-choice needs --tool-call-parser NAME (the format the model "
            "writes its calls in: " + ", ".join(llm.engine.plugins.names("tool_parser")) + ")"
        )
    started = now()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        llm.start()
        yield
        # The drain (ServerState) already finished or aborted every request; the
        # engine thread ends after its current step. Do not wait past one step, nor at
        # all when the drain already waited out the step grace for it.
        log.info("stopping the engine thread")
        llm.begin_shutdown(0.0)
        wait_s = 0.0 if state.engine_stuck else 1.0
        if not await asyncio.to_thread(llm.join, wait_s):
            log.warning("the engine thread is still in a step; exiting without it")

    app = FastAPI(
        title="pitstop", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.llm = llm
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.server = state

    def count_refusal(status: int, _code: str) -> None:
        metrics.observe_request_failure(failure_reason(status))

    app.add_middleware(
        RequestGuard,
        allowed_hosts=settings.allowed_hosts,
        allowed_origins=settings.allowed_origins,
        on_reject=count_refusal,
    )

    # ------------------------------------------------------------------ errors
    def error_response(exc: APIError) -> JSONResponse:
        headers = dict(exc.headers)
        if exc.status == 413:
            headers.setdefault("Connection", "close")
        if exc.status == 401:
            headers.setdefault("WWW-Authenticate", "Bearer")
        if state.draining:
            headers.setdefault("Connection", "close")
        if exc.counted:
            metrics.observe_request_failure(failure_reason(exc.status, exc.code))
        return JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 404:
            message = (
                f"this server has no endpoint {request.method} {request.url.path}; it serves "
                + ", ".join(ROUTES)
            )
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; it serves " + (
                ", ".join(ROUTES)
            )
        err = APIError(exc.status_code, message, type=kind, headers=exc.headers)
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(body_error(exc.errors()))

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return error_response(err)

    # ------------------------------------------------------------------ helpers
    def check_auth(request: Request) -> str | None:
        """Refuse a missing, malformed or wrong key (401); return which key matched."""
        if not keys:
            return None
        header = request.headers.get("authorization")
        how = "send the header 'Authorization: Bearer <key>'"
        if header is None:
            raise APIError(401, f"missing API key: {how}", code="invalid_api_key")
        scheme, _, token = header.strip().partition(" ")
        token = token.strip()
        # The scheme is case-insensitive (RFC 9110): "bearer" works too.
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, f"malformed Authorization header: {how}", code="invalid_api_key")
        try:
            raw = token.encode("latin-1")  # the header's own bytes (ASGI decodes latin-1)
        except UnicodeEncodeError:
            raw = b""
        matched = None
        for i, key in enumerate(keys):  # every key compared, in constant time each
            if secrets.compare_digest(raw, key) and matched is None:
                matched = f"key{i}"
        if matched is None:
            raise APIError(401, f"invalid API key: {how}", code="invalid_api_key")
        return matched

    def client_of(request: Request, key: str | None) -> str:
        if key is not None:
            return key
        return request.client.host if request.client is not None else "unknown"

    def check_model(name: str | None, *, required: bool = True) -> None:
        """The request's ``model``: exactly the served name (or the model setting), else 404;
        missing or empty on a generation route, 400 (vLLM answers alike)."""
        if not name and required:
            raise APIError(
                400,
                f"model is required; this server serves {model_name!r}: send "
                f'"model": "{model_name}"',
                param="model",
                code="model_required",
            )
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
        try:
            async with asyncio.timeout(settings.read_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size <= limit:
                        body += chunk
                    elif size > limit + _DRAIN_EXTRA_BYTES:
                        break
        except TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {settings.read_timeout_s:g} s "
                "(--read-timeout); send it at once",
                code="request_timeout",
                headers={"Connection": "close"},
            ) from None
        except ClientDisconnect:
            raise APIError(400, "the client closed the connection while sending") from None
        if size > limit:
            raise too_large
        data = parse_json_body(bytes(body), max_depth=settings.max_json_depth)
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise body_error(exc.errors()) from exc

    def check_request_size(params: SamplingParams, num_prompts: int) -> None:
        """The server's caps on ``n`` and on prompts per request (400 above them)."""
        if params.n > settings.max_n:
            raise APIError(
                400,
                f"n is {params.n}, above this server's cap of {settings.max_n} samples per prompt "
                f"(--max-n); ask for at most {settings.max_n}, or send several requests",
                param="n",
            )
        if num_prompts > settings.max_prompts_per_request:
            raise APIError(
                400,
                f"prompt holds {num_prompts} prompts, above this server's cap of "
                f"{settings.max_prompts_per_request} per request (--max-prompts-per-request); "
                "split the list over several requests",
                param="prompt",
            )

    def check_vocab(params: SamplingParams) -> None:
        try:
            check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="stop_token_ids") from exc

    async def encoded(prompt: str | None, ids: list[int] | None) -> list[int] | None:
        """The token ids of a prompt (text is encoded off the event loop), to count its cost.

        None when they cannot be known here (no tokenizer, an empty text): the
        engine then refuses the request with its own message.
        """
        tok = llm.engine.tokenizer
        if ids is not None or prompt is None or not prompt or tok is None:
            return ids
        try:
            out = await asyncio.to_thread(tok.encode, prompt)
            check_encoded_prompt(prompt, out, vocab_size)
        except InvalidRequestError as exc:
            raise _invalid_request(exc, "prompt") from exc
        return out

    async def rendered(
        messages: list[dict[str, Any]], options: ChatOptions, tools: ChatTools | None = None
    ) -> RenderedChat | None:
        """A chat rendered by the model's template (pitstop.chat, as ``LLM.chat`` renders
        it), or None without a tokenizer (the engine then refuses the request)."""
        tok = llm.engine.tokenizer
        if tok is None:
            return None
        prompt = None if tools is None else tools.prompt
        if tools is not None and options.tools and prompt is None:
            if not template_reads_tools(tok, options):  # tool_choice "none": nothing to show
                options = attrs.evolve(options, tools=None)
        try:
            return await asyncio.to_thread(render_chat, tok, messages, options, tool_prompt=prompt)
        except InvalidRequestError as exc:
            raise _invalid_request(exc, "messages") from exc

    def admit(
        params: SamplingParams, prompt_ids: list[list[int] | None], client: str
    ) -> list[Flight]:
        """One place per prompt, admitted together by their cost in tokens (400/429/503)."""
        check_vocab(params)
        max_len = llm.config.max_model_len or 4096
        costs = [
            request_cost(len(ids or ()), params.max_tokens or max_len, params.n, max_len)
            for ids in prompt_ids
        ]
        return state.admit_many(client, costs)

    async def add(
        flight: Flight,
        request_id: str,
        params: SamplingParams,
        *,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        arrival: float,
        structured_param: str | None = None,
        prompt_param: str = "prompt",
    ) -> Flight:
        """Hand an admitted request to the engine; its place is given back if that fails.

        ``prompt_param`` names the field an error about the prompt points at.
        """
        try:
            await flight.add(
                llm.add_request(
                    prompt,
                    params,
                    prompt_token_ids=prompt_token_ids,
                    messages=messages,
                    request_id=request_id,
                    arrival_time=arrival,
                )
            )
        except ServerCut:
            flight.release()
            raise _shutdown_error() from None
        except InvalidRequestError as exc:
            flight.release()
            raise _invalid_request(exc, prompt_param, structured_param) from exc
        except EngineClosedError as exc:
            flight.release()
            raise APIError(
                503,
                str(exc),
                type="server_error",
                code="shutting_down",
                headers={"Connection": "close"},
            ) from exc
        except BaseException:
            flight.release()
            raise
        return flight

    async def watch_disconnect(request: Request, flight: Flight) -> None:
        stream = flight.stream
        assert stream is not None
        while not stream.finished:
            if await request.is_disconnected():
                log.info("client of %s went away: aborting", stream.request_id)
                stream.abort()
                return
            await asyncio.sleep(0.1)

    async def collect(request: Request, flight: Flight) -> RequestOutput:
        """Wait for the final output; abort if the client disconnects meanwhile."""
        watcher = asyncio.create_task(watch_disconnect(request, flight))
        try:
            final: RequestOutput | None = None
            async for out in flight:
                final = out
            assert final is not None
        except ServerCut:
            raise _shutdown_error() from None
        except EngineStepError as exc:
            metrics.observe_stream_error(exc)  # counts the request and, once, its step
            err = _engine_error(exc)
            err.counted = False
            raise err from exc
        finally:
            watcher.cancel()
            flight.release()
        if final.finish_reason == "abort":
            err = _shutdown_error()
            if not state.draining:  # the client went away: nobody reads this, count nothing
                err.counted = False
            raise err
        if final.finish_reason not in _OPENAI_FINISH:
            raise APIError(
                500,
                f"the engine failed this request ({final.finish_reason})",
                type="server_error",
                code="request_failed",
            )
        return final

    def sse_response(
        flight: Flight,
        make_chunk: ChunkFn,
        *,
        first: dict[str, Any] | None,
        usage_chunk: Callable[[RequestOutput], dict[str, Any]] | None,
        num_choices: int = 1,
    ) -> StreamingResponse:
        """Stream one request's choices as SSE: a chunk per choice that moved, then [DONE].

        A request the engine failed ends with an error event; one cut short by
        the server's shutdown ends each open choice with ``finish_reason``
        ``"length"`` and then an error event with code ``shutting_down``.
        The order is always: choice chunks, the usage chunk (when asked for),
        the error event (if any), ``data: [DONE]``.
        """

        async def events() -> AsyncIterator[str]:
            finished: set[int] = set()  # choices whose finish_reason was sent
            error: APIError | None = None  # the error event, sent after the usage chunk
            try:
                if first is not None:
                    yield _sse(first)
                async for out in flight:
                    burst = [out]
                    while not burst[-1].finished and (more := flight.get_nowait()) is not None:
                        burst.append(more)  # merge a burst into one event per choice
                    last = burst[-1]
                    failed = last.finished and last.finish_reason not in _OPENAI_FINISH
                    for k, choice in enumerate(last.outputs):
                        delta = "".join(o.outputs[k].text_delta for o in burst)
                        count = sum(len(o.outputs[k].new_token_ids) for o in burst)
                        done = choice.finish_reason is not None and k not in finished
                        if failed:
                            if delta:
                                yield _sse(make_chunk(k, delta, None, count, last))
                            continue
                        if delta or count or done:
                            reason = _OPENAI_FINISH[choice.finish_reason] if done else None
                            if done:
                                finished.add(k)
                            yield _sse(make_chunk(k, delta, reason, count, last))
                    if failed:
                        metrics.observe_request_failure("request_error")
                        error = APIError(
                            500,
                            f"the engine failed this request ({last.finish_reason})",
                            type="server_error",
                            code="request_failed",
                        )
                        break
                    if last.finished and any(c.finish_reason == "abort" for c in last.outputs):
                        metrics.observe_request_failure("shutdown")
                        error = _shutdown_error()
            except ServerCut:
                metrics.observe_request_failure("shutdown")
                for k in range(num_choices):
                    if k not in finished:
                        yield _sse(make_chunk(k, "", "length", 0, flight.last))
                error = _shutdown_error()
            except EngineStepError as exc:
                metrics.observe_stream_error(exc)
                error = _engine_error(exc)
            finally:
                flight.release()  # aborts the request if the client went away (cancelled)
            # One order, whatever ended the stream: choices, usage (when asked), error, [DONE].
            if usage_chunk is not None and flight.last is not None:
                yield _sse(usage_chunk(flight.last))
            if error is not None:
                yield _sse(error.to_dict())
            yield _sse("[DONE]")

        return _FlightResponse(
            events(),
            flight,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # ------------------------------------------------------------------ routes
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        key = check_auth(request)
        body = await read_body(request, CompletionRequest)
        check_model(body.model)
        prompts = body.prompts()
        if body.stream and len(prompts) > 1:
            raise APIError(
                400,
                f"stream: true takes one prompt, got {len(prompts)}; send one request per prompt, "
                "or stream: false for a list",
                param="prompt",
            )
        k = body.logprobs
        params = body.sampling_params(
            16 if body.max_tokens is None else body.max_tokens,
            logprobs=k,
            best_of=body.best_of,
            prompt_logprobs=body.prompt_logprobs,
        )
        if body.stream and params.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs needs stream: false", param="prompt_logprobs")
        check_request_size(params, len(prompts))
        rid = new_id("cmpl")
        prompt_ids = [await encoded(prompt, ids) for prompt, ids in prompts]
        flights = admit(params, prompt_ids, client_of(request, key))
        try:
            for i, ((prompt, _), ids) in enumerate(zip(prompts, prompt_ids, strict=True)):
                await add(
                    flights[i],
                    rid if len(prompts) == 1 else f"{rid}-{i}",
                    params,
                    prompt=prompt,
                    prompt_token_ids=ids,
                    arrival=arrival,
                    structured_param=body.structured_param(),
                )
        except BaseException:
            for flight in flights:
                flight.release()
            raise
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

            def chunk(
                index: int, text: str, finish: str | None, count: int, out: RequestOutput | None
            ) -> dict[str, Any]:
                logprobs = None
                if k is not None and count and out is not None:
                    logprobs = completion_logprobs(out.outputs[index], k, count)
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": _stop_reason(out, index, finish),
                }
                return {**base([choice]), **extra}

            def usage_chunk(final: RequestOutput) -> dict[str, Any]:
                return {**base([]), "usage": usage_of([final])}

            return sse_response(
                flights[0],
                chunk,
                first=None,
                usage_chunk=usage_chunk if body.include_usage else None,
                num_choices=params.n,
            )
        finals = await asyncio.gather(*(collect(request, f) for f in flights))
        choices = [
            {
                "index": i * params.n + c.index,
                "text": c.text,
                "logprobs": completion_logprobs(c, k) if k is not None else None,
                "finish_reason": _OPENAI_FINISH.get(c.finish_reason or "", c.finish_reason),
                "stop_reason": c.stop_reason,
                **(
                    {"prompt_logprobs": prompt_logprobs_json(final)}
                    if params.prompt_logprobs is not None
                    else {}
                ),
            }
            for i, final in enumerate(finals)
            for c in final.outputs
        ]
        return JSONResponse({**base(choices), "usage": usage_of(list(finals))})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        key = check_auth(request)
        body = await read_body(request, ChatCompletionRequest)
        check_model(body.model)
        messages = body.template_messages()
        tools = plan_tools(
            body.tools,
            body.tool_choice,
            parser=tool_parser,
            auto_enabled=settings.enable_auto_tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
        )
        options = body.chat_options(tools.template_tools)
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        k = body.num_logprobs()
        tool_constraint = tools.constraint(body.parallel_tool_calls)
        # No limit given (None): the engine stops at max_model_len.
        params = body.sampling_params(max_tokens, logprobs=k, tool_constraint=tool_constraint)
        check_request_size(params, 1)
        rid = new_id("chatcmpl")
        chat = await rendered(messages, options, tools)
        chat_ids = None if chat is None else chat.token_ids
        (flight,) = admit(params, [chat_ids], client_of(request, key))
        flight = await add(
            flight,
            rid,
            params,
            prompt=None if chat is None else chat.text,
            messages=messages if chat is None else None,
            prompt_token_ids=chat_ids,
            arrival=arrival,
            structured_param="tool_choice" if tool_constraint else body.structured_param(),
            prompt_param="messages",
        )
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
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for i in range(params.n)
                    ],
                ),
                **extra,
            }

            streams = [tools.stream() for _ in range(params.n)]  # one per choice

            def chunk(
                index: int, text: str, finish: str | None, count: int, out: RequestOutput | None
            ) -> dict[str, Any]:
                stream = streams[index]
                if stream is None:
                    delta: dict[str, Any] = {"content": text} if text else {}
                elif finish is None:
                    delta = stream.feed(text)
                else:
                    delta = stream.finish(text)
                    finish = tools.finish_reason(finish, stream.has_calls)
                logprobs = None
                if k is not None and count and out is not None:
                    logprobs = chat_logprobs(out.outputs[index], k, count)
                choice = {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": _stop_reason(out, index, finish),
                }
                return {**base(obj, [choice]), **extra}

            def usage_chunk(final: RequestOutput) -> dict[str, Any]:
                return {**base(obj, []), "usage": usage_of([final])}

            return sse_response(
                flight,
                chunk,
                first=first,
                usage_chunk=usage_chunk if body.include_usage else None,
                num_choices=params.n,
            )
        final = await collect(request, flight)
        choices = []
        for c in final.outputs:
            content, calls = tools.message(c.text)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            reason = _OPENAI_FINISH.get(c.finish_reason or "", c.finish_reason or "")
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": chat_logprobs(c, k) if k is not None else None,
                    "finish_reason": tools.finish_reason(reason, bool(calls)),
                    "stop_reason": c.stop_reason,
                }
            )
        return JSONResponse({**base("chat.completion", choices), "usage": usage_of([final])})

    def model_card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": started,
            "owned_by": "pitstop",
            "root": llm.config.model,
            "max_model_len": llm.config.max_model_len,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        check_auth(request)
        check_model(model_id)
        return JSONResponse(model_card())

    def tokenizer_or_400():
        tok = llm.engine.tokenizer
        if tok is None:
            raise APIError(400, f"the model {model_name!r} has no tokenizer", code="no_tokenizer")
        return tok

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        check_auth(request)
        body = await read_body(request, TokenizeRequest)
        check_model(body.model, required=False)
        tok = tokenizer_or_400()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send one of prompt (text) or messages (a chat)", param="prompt")
        try:
            if body.messages is not None:
                ids = render_chat(
                    tok,
                    [m.as_dict() for m in body.messages],
                    ChatOptions(add_generation_prompt=body.add_generation_prompt),
                ).token_ids
            else:
                assert body.prompt is not None
                ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        return JSONResponse(
            {"tokens": ids, "count": len(ids), "max_model_len": llm.config.max_model_len}
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        check_auth(request)
        body = await read_body(request, DetokenizeRequest)
        check_model(body.model, required=False)
        tok = tokenizer_or_400()
        try:
            check_token_ids("tokens", body.tokens, vocab_size)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="tokens") from exc
        return JSONResponse({"prompt": tok.decode(body.tokens, skip_special_tokens=False)})

    @app.get("/health")
    async def health() -> JSONResponse:
        snap = llm.snapshot
        ok = llm.accepting and llm.is_running and not state.draining
        return JSONResponse(
            {
                "status": "ok" if ok else "draining",
                "model": model_name,
                "num_running": snap.num_running,
                "num_waiting": snap.num_waiting,
                "num_open_requests": len(state.flights),
                "pages_free": snap.allocator.pages_free,
                "num_pages": snap.allocator.num_pages,
                "kv_cache_usage": snap.kv_cache_usage,
            },
            status_code=200 if ok else 503,
            headers={"Connection": "close"} if state.draining else None,
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
