"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from pitstop.server.deps import Authorized, State

router = APIRouter()


@router.get("/v1/models")
async def models(state: State, _caller: Authorized) -> JSONResponse:
    """The list of served model names (one model, under each of its names), then the
    adapters (``--lora-modules``), each with the model as ``parent``."""
    return JSONResponse(
        {
            "object": "list",
            "data": [state.model_card(n) for n in (*state.model_names, *state.adapters)],
        }
    )


@router.get("/v1/models/{model_id:path}")
async def model(state: State, _caller: Authorized, model_id: str) -> JSONResponse:
    """The served model's card under one of its names; any other name is a 404."""
    state.check_model(model_id)
    return JSONResponse(state.model_card(model_id))
