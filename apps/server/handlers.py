"""Every error as OpenAI's JSON error object: the app's exception handlers.

An :class:`~pitstop.server.protocol.APIError` raised anywhere (a route, a
dependency) is answered by :func:`error_response`; Starlette's 404/405,
FastAPI's validation errors and any unexpected exception are turned into
one first. The refusals are counted in the server's metrics.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pitstop.server.api_errors import body_error
from pitstop.server.metrics import failure_reason
from pitstop.server.protocol import APIError
from pitstop.server.routes import ROUTES
from pitstop.server.state import AppState

log = logging.getLogger(__name__)


def error_response(state: AppState, exc: APIError) -> JSONResponse:
    """The JSON answer of ``exc``, with the headers its status needs; counted unless it was."""
    headers = dict(exc.headers)
    if exc.status == 413:
        headers.setdefault("Connection", "close")
    if exc.status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    if state.server.draining:
        headers.setdefault("Connection", "close")
    if exc.counted:
        state.metrics.observe_request_failure(failure_reason(exc.status, exc.code))
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)


def http_error(request: Request, exc: StarletteHTTPException) -> APIError:
    """Starlette's 404 (no such route), 405 (wrong method) and others, in OpenAI's shape."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = str(exc.detail)
    served = ", ".join(ROUTES)
    if exc.status_code == 404:
        message = (
            f"this server has no endpoint {request.method} {_path(request)}; it serves " + served
        )
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {_path(request)}; it serves " + served
    return APIError(exc.status_code, message, type=kind, headers=exc.headers)


def _path(request: Request, limit: int = 80) -> str:
    """The request's path as an error names it: cut at ``limit`` characters, never echoed whole."""
    path = request.url.path
    return path if len(path) <= limit else f"{path[:limit]}... ({len(path):,} characters)"


def _state(request: Request) -> AppState:
    return request.app.state.app_state


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(_state(request), exc)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(_state(request), http_error(request, exc))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(_state(request), body_error(exc.errors()))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error")
    err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
    return error_response(_state(request), err)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` as OpenAI's JSON error object."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
