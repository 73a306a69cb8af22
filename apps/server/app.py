"""The FastAPI app: OpenAI's completions and chat routes over an :class:`AsyncLLM`.

Routes (:mod:`pitstop.server.routes`, one group per module):
``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events ending in ``data: [DONE]``),
``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize``,
``POST /detokenize``, ``GET /health`` and ``GET /metrics`` (Prometheus).
Any other path is a JSON 404 that says the server has no such endpoint.

Every error is OpenAI's JSON error object (:mod:`pitstop.server.handlers`):
400 for bad JSON or parameters (and a prompt over ``max_model_len``), 401
for a missing, malformed or wrong API key, 403 for a refused ``Host`` or
``Origin``, 404 for an unknown model or route, 408 for a request not
received in time, 413 for a body over the size limit, 415 for a body that
is not declared JSON, 429 (with ``Retry-After``) beyond the queue or
per-client limits, 503 while shutting down. A client that goes away aborts
its request at once, which frees its KV-cache pages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from pitstop.entrypoints.async_engine import AsyncLLM
from pitstop.errors import InvalidRequestError
from pitstop.server.handlers import install_error_handlers
from pitstop.server.metrics import failure_reason
from pitstop.server.routes import ROUTERS, ROUTES
from pitstop.server.routes.rollout import rollout_routers
from pitstop.server.security import RequestGuard
from pitstop.server.settings import ServerSettings
from pitstop.server.state import AppState

__all__ = ["ROUTES", "ServerSettings", "create_app"]

log = logging.getLogger(__name__)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the engine with the app; stop its thread when the app stops."""
    state: AppState = app.state.app_state
    llm = state.llm
    if state.settings.grammar_at_start:
        await _build_grammar_compiler(state)
    llm.start()
    yield
    if state.template_sandbox is not None:
        state.template_sandbox.close()
    # The drain (ServerState) already finished or aborted every request; the
    # engine thread ends after its current step. Do not wait past one step, nor at
    # all when the drain already waited out the step grace for it.
    log.info("stopping the engine thread")
    llm.begin_shutdown(0.0)
    wait_s = 0.0 if state.server.engine_stuck else 1.0
    if not await asyncio.to_thread(llm.join, wait_s):
        log.warning("the engine thread is still in a step; exiting without it")


async def _build_grammar_compiler(state: AppState) -> None:
    """Build the grammar backend (llguidance's view of the tokenizer: seconds) before the port
    opens, so that no stream waits on it at the first structured request; skipped without
    its library."""
    try:
        await asyncio.to_thread(state.llm.engine.grammar_compiler)
    except InvalidRequestError as exc:  # no tokenizer, or llguidance is not installed
        log.info("structured outputs not prepared at start: %s", exc)


def create_app(llm: AsyncLLM, settings: ServerSettings | None = None) -> FastAPI:
    """Build the app around a started :class:`AsyncLLM`; shutting the app down shuts the engine down.

    ``app.state.server`` is the :class:`~pitstop.server.limits.ServerState`
    (admission counts, drain), ``app.state.metrics`` the
    :class:`~pitstop.server.metrics.ServerMetrics`, ``app.state.app_state``
    the :class:`~pitstop.server.state.AppState` the routes read.
    """
    settings = settings or ServerSettings()
    state = AppState.build(llm, settings)
    app = FastAPI(
        title="pitstop", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.app_state = state
    app.state.llm = llm
    app.state.metrics = state.metrics
    app.state.settings = settings
    app.state.server = state.server

    def count_refusal(status: int, _code: str) -> None:
        state.metrics.observe_request_failure(failure_reason(status))

    app.add_middleware(
        RequestGuard,
        allowed_hosts=settings.allowed_hosts,
        allowed_origins=settings.allowed_origins,
        on_reject=count_refusal,
    )
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    for router in rollout_routers(settings.enable_sleep_mode, settings.enable_weight_updates):
        app.include_router(router)
    return app
