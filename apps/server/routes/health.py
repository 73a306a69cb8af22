"""``GET /health`` (503 while draining) and ``GET /metrics`` (Prometheus); no key needed."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pitstop.server.deps import State

router = APIRouter()


@router.get("/health")
async def health(state: State) -> JSONResponse:
    """Whether the server takes requests, and the engine's load."""
    llm, server = state.llm, state.server
    snap = llm.snapshot
    ok = llm.accepting and llm.is_running and not server.draining
    return JSONResponse(
        {
            "status": "ok" if ok else "draining",
            "model": state.model_name,
            "num_running": snap.num_running,
            "num_waiting": snap.num_waiting,
            "num_open_requests": len(server.flights),
            "pages_free": snap.allocator.pages_free,
            "num_pages": snap.allocator.num_pages,
            "kv_cache_usage": snap.kv_cache_usage,
        },
        status_code=200 if ok else 503,
        headers={"Connection": "close"} if server.draining else None,
    )


@router.get("/metrics")
async def prometheus_metrics(state: State) -> Response:
    """The server's and the engine's metrics in Prometheus' text format."""
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
