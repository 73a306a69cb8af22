"""``POST /v1/completions``: OpenAI's text completions, whole or streamed."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import attrs
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.requests.outputs import RequestOutput
from pitstop.server.budget import ResponseBudget
from pitstop.server.deps import (
    Authorized,
    Caller,
    State,
    check_request_size,
    json_body,
    off_loop,
)
from pitstop.server.limits import Flight
from pitstop.server.protocol import APIError, CompletionRequest, Prompt, new_id, now
from pitstop.server.render import OPENAI_FINISH, completion_logprobs, prompt_logprobs_json, usage_of
from pitstop.server.state import AppState
from pitstop.server.streaming import AnswerHead, chunk_logprobs, sse_response
from pitstop.server.submit import add, admit, check_structured, collect, encoded

router = APIRouter()

CompletionBody = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]


_OBJECT = "text_completion"


@attrs.frozen
class CompletionAnswer:
    """The JSON of one completions request's answer: whole, or as stream chunks."""

    head: AnswerHead
    logprobs: int | None  # the request's ``logprobs`` (top-k per token), None: none

    def chunk(
        self, index: int, text: str, finish: str | None, count: int, out: RequestOutput | None
    ) -> dict[str, Any]:
        """A stream chunk of choice ``index`` (:data:`~pitstop.server.streaming.ChunkFn`)."""
        logprobs = chunk_logprobs(completion_logprobs, out, index, self.logprobs, count)
        return self.head.choice_chunk(_OBJECT, index, {"text": text}, logprobs, finish, out)

    def usage_chunk(self, final: RequestOutput) -> dict[str, Any]:
        """The stream's last chunk before [DONE] when usage is asked for."""
        return self.head.usage_chunk(_OBJECT, final)

    def whole(self, finals: list[RequestOutput], params: SamplingParams) -> dict[str, Any]:
        """The non-streamed answer: every prompt's ``n`` choices, numbered in order."""
        k = self.logprobs
        choices = [
            {
                "index": i * params.n + c.index,
                "text": c.text,
                "logprobs": completion_logprobs(c, k) if k is not None else None,
                "finish_reason": OPENAI_FINISH.get(c.finish_reason or "", c.finish_reason),
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
        return {**self.head.body(_OBJECT, choices), "usage": usage_of(finals)}


def _sampling_params(body: CompletionRequest, num_prompts: int) -> SamplingParams:
    """The request's sampling parameters, with the checks only completions make (400)."""
    if body.stream and num_prompts > 1:
        raise APIError(
            400,
            f"stream: true takes one prompt, got {num_prompts}; send one request per prompt, "
            "or stream: false for a list",
            param="prompt",
        )
    params = body.sampling_params(
        16 if body.max_tokens is None else body.max_tokens,
        logprobs=body.logprobs,
        best_of=body.best_of,
        prompt_logprobs=body.prompt_logprobs,
    )
    if body.stream and params.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs needs stream: false", param="prompt_logprobs")
    return params


async def _start(
    state: AppState,
    caller: Caller,
    body: CompletionRequest,
    prompts: list[Prompt],
    params: SamplingParams,
    request_id: str,
) -> list[Flight]:
    """Admit every prompt together and hand each to the engine (ids ``rid-i`` for a list)."""
    prompt_ids = [await encoded(state, prompt, ids) for prompt, ids in prompts]
    flights = admit(state, params, prompt_ids, caller.client)
    try:
        for i, ((prompt, _), ids) in enumerate(zip(prompts, prompt_ids, strict=True)):
            await add(
                state,
                flights[i],
                request_id if len(prompts) == 1 else f"{request_id}-{i}",
                params,
                prompt=prompt,
                prompt_token_ids=ids,
                arrival=caller.arrival,
                structured_param=body.structured_param(),
                model=body.model,
            )
    except BaseException:
        for flight in flights:
            flight.release()
        raise
    return flights


@router.post("/v1/completions")
async def completions(
    request: Request, state: State, caller: Authorized, body: CompletionBody
) -> Response:
    """Complete one prompt (streamed or not) or a list of prompts (not streamed)."""
    state.check_model(body.model)
    prompts = body.prompts()
    params = await off_loop(request, lambda: _sampling_params(body, len(prompts)))
    check_request_size(state, params, len(prompts))
    await check_structured(state, params, body.structured_param())
    rid = new_id("cmpl")
    flights = await _start(state, caller, body, prompts, params, rid)
    head = AnswerHead(rid, now(), state.answer_name(body.model), body.include_usage)
    answer = CompletionAnswer(head, body.logprobs)
    budget = ResponseBudget(state.settings.max_response_bytes)  # the whole answer's, shared
    if body.stream:
        return sse_response(
            flights[0],
            state.metrics,
            answer.chunk,
            first=None,
            usage_chunk=answer.usage_chunk if body.include_usage else None,
            num_choices=params.n,
            budget=budget,
        )
    finals = await asyncio.gather(
        *(collect(state, request, f, budget, body.logprobs) for f in flights)
    )
    return budget.json_response(answer.whole(list(finals), params))
