"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: vLLM's, behind the key.

Loading reads and checks the adapter at once (the ``lora`` plugin's refusals come back as a
400 naming the problem) and then serves it as a model name, as ``--lora-modules`` does;
unloading stops serving the name (requests already running with it finish). Both need an
engine with an adapter plugin (``--enable-lora``).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from pitstop.entrypoints.lora_request import LoRARequest
from pitstop.errors import InvalidRequestError
from pitstop.server.deps import Authorized, State, json_body
from pitstop.server.protocol import APIError, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pitstop.server.state import AppState

router = APIRouter()

LoadBody = Annotated[LoadLoRAAdapterRequest, Depends(json_body(LoadLoRAAdapterRequest))]
UnloadBody = Annotated[UnloadLoRAAdapterRequest, Depends(json_body(UnloadLoRAAdapterRequest))]


def _adapters(state: AppState):
    """The engine's adapter plugin; a 400 naming --enable-lora without one."""
    adapters = getattr(state.llm.engine.runner, "adapters", None)
    if adapters is None:
        raise APIError(
            400,
            "this server serves no adapters: start it with --enable-lora",
            code="lora_not_enabled",
        )
    return adapters


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(state: State, _caller: Authorized, body: LoadBody) -> PlainTextResponse:
    """Read the adapter at ``lora_path`` and serve it as the model name ``lora_name``."""
    adapters = _adapters(state)
    name = body.lora_name
    if name in state.model_names or (name in state.adapters and not body.load_inplace):
        raise APIError(
            400,
            f"the model name {name!r} is already served; unload it first (or load_inplace)",
            param="lora_name",
            code="lora_name_in_use",
        )
    request = LoRARequest(name, next(state.adapter_ids), body.lora_path)
    try:
        await asyncio.to_thread(adapters.check, request)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from exc
    state.adapters[name] = request
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    state: State, _caller: Authorized, body: UnloadBody
) -> PlainTextResponse:
    """Stop serving the adapter ``lora_name`` (its running requests finish)."""
    _adapters(state)
    if state.adapters.pop(body.lora_name, None) is None:
        raise APIError(
            404,
            f"no adapter named {body.lora_name!r} is served",
            param="lora_name",
            code="lora_not_found",
        )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
