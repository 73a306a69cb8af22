"""The rollout endpoints (docs/rl.md): vLLM's ``/sleep``, ``/wake_up``, ``/is_sleeping``,
``/reset_prefix_cache`` and SGLang's ``/update_weights_from_disk``, behind the API key.

They are served only with ``--enable-sleep-mode`` (sleep, wake, is_sleeping, reset) or
``--enable-weight-updates`` (update from disk, reset); otherwise the paths answer 404.
Each runs on the engine thread between two steps (:meth:`AsyncLLM.call`). Sleeping, waking
and updating are refused with 409 while a request is unfinished (the message names them):
the caller drains its own traffic first, as a trainer does between rollouts. While asleep,
generation requests get 503 with ``Retry-After`` and are never accepted (so none is lost).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse

from pitstop.entrypoints.async_engine import EngineClosedError
from pitstop.entrypoints.rollout.errors import (
    EngineBusyError,
    EngineSleepingError,
    WeightUpdateError,
)
from pitstop.errors import ConfigError
from pitstop.server.api_errors import engine_closed_error
from pitstop.server.deps import Authorized, State, json_body
from pitstop.server.protocol import APIError, UpdateWeightsFromDiskRequest
from pitstop.server.state import AppState

sleep_router = APIRouter()
weights_router = APIRouter()
reset_router = APIRouter()

DiskBody = Annotated[UpdateWeightsFromDiskRequest, Depends(json_body(UpdateWeightsFromDiskRequest))]


async def _run(state: AppState, fn: Callable[[], Any]) -> Any:
    """``fn`` on the engine thread; the rollout's refusals as HTTP errors."""
    try:
        return await state.llm.call(fn)
    except (EngineBusyError, EngineSleepingError) as exc:
        raise APIError(409, str(exc), code="engine_busy") from exc
    except (WeightUpdateError, ConfigError, ValueError) as exc:
        raise APIError(400, str(exc), code="invalid_rollout_request") from exc
    except EngineClosedError as exc:
        raise engine_closed_error(exc) from exc


@sleep_router.post("/sleep")
async def sleep(state: State, _caller: Authorized, level: int = 1) -> JSONResponse:
    """Release the weights (kept on the host at level 1) and the KV cache."""
    if level not in (1, 2):
        raise APIError(400, f"level must be 1 or 2, got {level}", param="level")
    await _run(state, lambda: state.llm.rollout.sleep(level))
    return JSONResponse({"is_sleeping": True, "level": level})


@sleep_router.post("/wake_up")
async def wake_up(
    state: State, _caller: Authorized, tags: Annotated[list[str] | None, Query()] = None
) -> JSONResponse:
    """Restore ``tags`` (``?tags=weights``, ``?tags=kv_cache``; none: all)."""
    await _run(state, lambda: state.llm.rollout.wake_up(tags or None))
    return JSONResponse({"is_sleeping": state.llm.rollout.is_sleeping()})


@sleep_router.get("/is_sleeping")
async def is_sleeping(state: State, _caller: Authorized) -> JSONResponse:
    """``{"is_sleeping": bool}`` (vLLM's answer)."""
    return JSONResponse({"is_sleeping": state.llm.rollout.is_sleeping()})


@reset_router.post("/reset_prefix_cache")
async def reset_prefix_cache(state: State, _caller: Authorized) -> JSONResponse:
    """Forget every cached prefix."""
    done = await _run(state, state.llm.rollout.reset_prefix_cache)
    return JSONResponse({"success": bool(done)})


@weights_router.post("/update_weights_from_disk")
async def update_weights_from_disk(
    state: State, _caller: Authorized, body: DiskBody
) -> JSONResponse:
    """Write the weights of ``model_path`` in place (all checked first; a refusal is a 400
    naming the tensor, and nothing was applied)."""
    if body.load_format not in (None, "auto", "safetensors"):
        raise APIError(
            400, f"load_format {body.load_format!r}: pitstop reads safetensors", param="load_format"
        )
    count = await _run(state, lambda: state.llm.rollout.update_weights_from_disk(body.model_path))
    return JSONResponse(
        {"success": True, "message": f"updated {count} tensor(s) from {body.model_path}"}
    )


def rollout_routers(enable_sleep_mode: bool, enable_weight_updates: bool) -> list[APIRouter]:
    """The routers the flags turn on (none without them: the paths answer 404)."""
    routers = []
    if enable_sleep_mode:
        routers.append(sleep_router)
    if enable_weight_updates:
        routers.append(weights_router)
    if enable_sleep_mode or enable_weight_updates:
        routers.append(reset_router)
    return routers
