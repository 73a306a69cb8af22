"""The routes' shared dependencies: the app state, authentication, the body, the size caps.

A route declares what it needs as parameters (``state: State``,
``caller: Authorized``, ``body: Annotated[Model, Depends(json_body(Model))]``);
FastAPI resolves them in that order, so the key is checked before the
body is read, as OpenAI's server does.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

import attrs
from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.server.api_errors import body_error
from pitstop.server.protocol import APIError, parse_json_body
from pitstop.server.state import AppState

BodyT = TypeVar("BodyT", bound=BaseModel)
ResultT = TypeVar("ResultT")

# A client that sends a body over the limit is answered 413 after its body is
# read and thrown away (so it sees the answer rather than a reset), up to this
# many extra bytes; past them the connection is closed.
DRAIN_EXTRA_BYTES = 8 << 20

_HOW = "send the header 'Authorization: Bearer <key>'"


async def app_state(request: Request) -> AppState:
    """The :class:`AppState` that :func:`~pitstop.server.app.create_app` put on the app."""
    return request.app.state.app_state


State = Annotated[AppState, Depends(app_state)]


@attrs.frozen
class Caller:
    """Who sent a request that passed authentication, and when it arrived."""

    arrival: float  # time.perf_counter() when the route was entered
    key: str | None  # which API key matched ("key0", ...), None without authentication
    client: str  # whom the per-client limits count: the key, else the address


def check_key(keys: tuple[bytes, ...], header: str | None) -> str | None:
    """Refuse a missing, malformed or wrong key (401); return which key matched."""
    if not keys:
        return None
    if header is None:
        raise APIError(401, f"missing API key: {_HOW}", code="invalid_api_key")
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    # The scheme is case-insensitive (RFC 9110): "bearer" works too.
    if scheme.lower() != "bearer" or not token:
        raise APIError(401, f"malformed Authorization header: {_HOW}", code="invalid_api_key")
    try:
        raw = token.encode("latin-1")  # the header's own bytes (ASGI decodes latin-1)
    except UnicodeEncodeError:
        raw = b""
    matched = None
    for i, key in enumerate(keys):  # every key compared, in constant time each
        if secrets.compare_digest(raw, key) and matched is None:
            matched = f"key{i}"
    if matched is None:
        raise APIError(401, f"invalid API key: {_HOW}", code="invalid_api_key")
    return matched


async def authorize(request: Request, state: State) -> Caller:
    """The dependency of every ``/v1`` and tokenizer route: the caller, once its key is checked."""
    arrival = time.perf_counter()
    key = check_key(state.keys, request.headers.get("authorization"))
    if key is not None:
        client = key
    else:
        client = request.client.host if request.client is not None else "unknown"
    return Caller(arrival=arrival, key=key, client=client)


Authorized = Annotated[Caller, Depends(authorize)]


async def read_body(request: Request, state: AppState, model: type[BodyT]) -> BodyT:
    """The request's JSON body as ``model``: 413 over the size limit, 408 when it comes too
    slowly, 400 when it is not JSON or fails the model."""
    settings = state.settings
    limit = settings.max_body_bytes
    too_large = APIError(
        413,
        f"the request body is over the limit of {limit} bytes (--max-body-bytes)",
        code="request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + DRAIN_EXTRA_BYTES:
        raise too_large
    try:
        body, size = await _receive(request, limit, settings.read_timeout_s)
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
    request.state.large_body = size > OFF_LOOP_BYTES
    if request.state.large_body:  # parsing and checking are linear, but not free: off the loop
        return await asyncio.to_thread(_parse, body, settings.max_json_depth, model)
    return _parse(body, settings.max_json_depth, model)


OFF_LOOP_BYTES = 32 << 10
"""Bodies larger than this are parsed, checked and turned into sampling parameters on a
worker thread (:func:`off_loop`), so that no request holds the event loop for long: a
1 MiB body (the default limit) of ``logit_bias`` entries takes about 0.2 s to check."""


def _parse(body: bytes, max_depth: int, model: type[BodyT]) -> BodyT:
    """The body's JSON as ``model``: 400 when it is not JSON or fails the model."""
    data = parse_json_body(body, max_depth=max_depth)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise body_error(exc.errors()) from exc


async def off_loop(request: Request, work: Callable[[], ResultT]) -> ResultT:
    """``work()`` (a request's own checks, linear in its size) on a worker thread when the
    request's body was large (:data:`OFF_LOOP_BYTES`), else here: a small request pays no
    thread hop, a large one cannot stall the other streams."""
    if getattr(request.state, "large_body", False):
        return await asyncio.to_thread(work)
    return work()


async def _receive(request: Request, limit: int, timeout_s: float) -> tuple[bytes, int]:
    """The body's first ``limit`` bytes and its size, reading on past the limit (to answer
    413 rather than reset) up to :data:`DRAIN_EXTRA_BYTES` more."""
    body = bytearray()
    size = 0
    async with asyncio.timeout(timeout_s):
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                body += chunk
            elif size > limit + DRAIN_EXTRA_BYTES:
                break
    return bytes(body), size


def json_body(model: type[BodyT]) -> Callable[[Request, AppState], Awaitable[BodyT]]:
    """A dependency that reads the body as ``model`` (:func:`read_body`)."""

    async def dependency(request: Request, state: State) -> BodyT:
        return await read_body(request, state, model)

    return dependency


def check_logprobs(state: AppState, field: str, k: int | None) -> None:
    """The server's cap on log-probabilities per token (``max_logprobs``, 20): a ``k`` outside
    ``[0, max_logprobs]`` is a 400 naming ``field`` (-1, the whole vocabulary, too)."""
    top = state.settings.max_logprobs
    if k is not None and not 0 <= k <= top:
        raise APIError(
            400,
            f"{field} must be an integer in [0, {top}] (max_logprobs), got {k}; the server "
            f"returns at most the {top} most likely tokens per position; ask for at most {top}",
            param=field,
        )


def check_request_size(
    state: AppState, params: SamplingParams, num_prompts: int, logprobs_param: str = "logprobs"
) -> None:
    """The server's caps on ``n``, on prompts per request and on log-probabilities per token
    (400 above them; ``logprobs_param`` names the field that asked for them)."""
    settings = state.settings
    check_logprobs(state, logprobs_param, params.logprobs)
    check_logprobs(state, "prompt_logprobs", params.prompt_logprobs)
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
