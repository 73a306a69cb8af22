"""From a checked request to the engine and back: encode or render the prompt, admit the
request by its cost, hand it to the engine, and wait for a non-streamed answer.

Every function maps the engine's refusals and failures to the server's
:class:`~pitstop.server.protocol.APIError` answers (:mod:`pitstop.server.api_errors`)
and gives an admitted request's place back however it ends.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import attrs
from fastapi import Request

from pitstop.entrypoints.async_engine import EngineClosedError, EngineStepError
from pitstop.entrypoints.chat import ChatOptions, RenderedChat, render_chat, template_reads_tools
from pitstop.entrypoints.rollout.errors import EngineSleepingError
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.errors import InvalidRequestError
from pitstop.requests.outputs import RequestOutput
from pitstop.requests.validation import check_encoded_prompt, check_token_ids
from pitstop.server.api_errors import (
    asleep_error,
    engine_closed_error,
    engine_error,
    invalid_request,
    request_failed,
    shutdown_error,
)
from pitstop.server.budget import ResponseBudget, output_bytes
from pitstop.server.limits import Flight, ServerCut, request_cost
from pitstop.server.protocol import APIError
from pitstop.server.render import OPENAI_FINISH
from pitstop.server.state import AppState
from pitstop.server.tools import ChatTools

log = logging.getLogger(__name__)


async def encoded(state: AppState, prompt: str | None, ids: list[int] | None) -> list[int] | None:
    """The token ids of a prompt (text is encoded off the event loop), to count its cost.

    None when they cannot be known here (no tokenizer, an empty text): the
    engine then refuses the request with its own message.
    """
    tok = state.llm.engine.tokenizer
    if ids is not None or prompt is None or not prompt or tok is None:
        return ids
    try:
        out = await asyncio.to_thread(tok.encode, prompt)
        check_encoded_prompt(prompt, out, state.vocab_size)
    except InvalidRequestError as exc:
        raise invalid_request(exc, "prompt") from exc
    return out


async def rendered(
    state: AppState,
    messages: list[dict[str, Any]],
    options: ChatOptions,
    tools: ChatTools | None = None,
) -> RenderedChat | None:
    """A chat rendered by the model's template (pitstop.entrypoints.chat, as ``LLM.chat`` renders
    it), or None without a tokenizer (the engine then refuses the request)."""
    tok = state.llm.engine.tokenizer
    if tok is None:
        return None
    prompt = None if tools is None else tools.prompt
    if tools is not None and options.tools and prompt is None:
        if not template_reads_tools(tok, options):  # tool_choice "none": nothing to show
            options = attrs.evolve(options, tools=None)
    try:
        if options.chat_template is None:  # the model's own template: trusted
            return await asyncio.to_thread(render_chat, tok, messages, options, tool_prompt=prompt)
        return await _sandboxed(state, tok, messages, options, prompt)
    except InvalidRequestError as exc:
        param = "chat_template" if options.chat_template is not None else "messages"
        raise invalid_request(exc, param) from exc


async def _sandboxed(
    state: AppState, tok: Any, messages: list[dict[str, Any]], options: ChatOptions, prompt: Any
) -> RenderedChat:
    """A chat rendered with the request's own template, in the sandbox process, one at a
    time (pitstop.server.template_sandbox); a request waiting too long for its turn is 429."""
    sandbox = state.template_sandbox
    assert sandbox is not None  # the route refused the template otherwise
    wait_s = 4 * sandbox.timeout_s
    try:
        async with asyncio.timeout(wait_s):
            await state.template_slot.acquire()
    except TimeoutError:
        raise APIError(
            429,
            f"the server renders one request chat_template at a time and none was free within "
            f"{wait_s:g} s; retry later, or leave chat_template out to use the model's own",
            code="chat_template_busy",
            headers={"Retry-After": str(state.settings.retry_after_s)},
        ) from None
    try:
        render = sandbox.renderer(dict(tok.hf.special_tokens_map))
        return await asyncio.to_thread(
            render_chat, tok, messages, options, tool_prompt=prompt, renderer=render
        )
    finally:
        state.template_slot.release()


async def check_structured(
    state: AppState, params: SamplingParams, structured_param: str | None
) -> None:
    """Compile the request's structured-output constraint on a worker thread before it is
    queued (the engine then finds it compiled): one that does not compile, or matches no
    text at all, is a 400 naming ``structured_param``. The first such request builds the
    grammar backend there too, unless the server built it at start-up."""
    spec = params.structured_outputs
    if spec is None:
        return
    engine = state.llm.engine
    try:
        await asyncio.to_thread(lambda: engine.grammar_compiler().check(spec))
    except InvalidRequestError as exc:
        raise invalid_request(exc, "prompt", structured_param or "structured_outputs") from exc


def admit(
    state: AppState, params: SamplingParams, prompt_ids: list[list[int] | None], client: str
) -> list[Flight]:
    """One place per prompt, admitted together by their cost in tokens (400/429/503)."""
    try:
        check_token_ids("stop_token_ids", params.stop_token_ids, state.vocab_size)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="stop_token_ids") from exc
    max_len = state.max_model_len or 4096
    costs = [
        request_cost(len(ids or ()), params.max_tokens or max_len, params.n, max_len)
        for ids in prompt_ids
    ]
    return state.server.admit_many(client, costs)


async def add(
    state: AppState,
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
    model: str | None = None,
) -> Flight:
    """Hand an admitted request to the engine; its place is given back if that fails.

    ``prompt_param`` names the field an error about the prompt points at; ``model``: the
    request's, which selects an adapter when it names one (``--lora-modules``).
    """
    try:
        await flight.add(
            state.llm.add_request(
                prompt,
                params,
                prompt_token_ids=prompt_token_ids,
                messages=messages,
                request_id=request_id,
                arrival_time=arrival,
                lora_request=state.adapters.get(model or ""),
            )
        )
    except ServerCut:
        flight.release()
        raise shutdown_error() from None
    except InvalidRequestError as exc:
        flight.release()
        raise invalid_request(exc, prompt_param, structured_param) from exc
    except EngineClosedError as exc:
        flight.release()
        raise engine_closed_error(exc) from exc
    except EngineSleepingError as exc:  # slept between admission and the engine thread
        flight.release()
        raise asleep_error(state.server.retry_after_s, str(exc)) from exc
    except BaseException:
        flight.release()
        raise
    return flight


async def _watch_disconnect(request: Request, flight: Flight) -> None:
    """Abort the flight's request when its client goes away before it finishes."""
    stream = flight.stream
    assert stream is not None
    while not stream.finished:
        if await request.is_disconnected():
            log.info("client of %s went away: aborting", stream.request_id)
            stream.abort()
            return
        await asyncio.sleep(0.1)


async def collect(
    state: AppState,
    request: Request,
    flight: Flight,
    budget: ResponseBudget | None = None,
    logprobs: int | None = None,
) -> RequestOutput:
    """Wait for the final output; abort if the client disconnects meanwhile, or when the
    answer grows past ``budget`` (a 400; ``logprobs``: the top-k asked per token)."""
    watcher = asyncio.create_task(_watch_disconnect(request, flight))
    try:
        final: RequestOutput | None = None
        async for out in flight:
            if budget is not None and not budget.take(
                output_bytes(out, logprobs, first=final is None)
            ):
                raise budget.error()  # release() below aborts the request
            final = out
        assert final is not None
    except ServerCut:
        raise shutdown_error() from None
    except EngineStepError as exc:
        state.metrics.observe_stream_error(exc)  # counts the request and, once, its step
        err = engine_error(exc)
        err.counted = False
        raise err from exc
    finally:
        watcher.cancel()
        flight.release()
    if final.finish_reason == "abort":
        err = shutdown_error()
        if not state.server.draining:  # the client went away: nobody reads this, count nothing
            err.counted = False
        raise err
    if final.finish_reason not in OPENAI_FINISH:
        raise request_failed(final.finish_reason)
    return final
