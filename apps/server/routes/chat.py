"""``POST /v1/chat/completions``: OpenAI's chat completions, tool calls included."""

from __future__ import annotations

from typing import Annotated, Any

import attrs
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pitstop.entrypoints.tool_calls import ToolCallStream
from pitstop.requests.outputs import CompletionOutput, RequestOutput
from pitstop.server.budget import ResponseBudget
from pitstop.server.deps import (
    Authorized,
    State,
    check_logprobs,
    check_request_size,
    json_body,
    off_loop,
)
from pitstop.server.protocol import ChatCompletionRequest, new_id, now
from pitstop.server.render import OPENAI_FINISH, chat_logprobs, usage_of
from pitstop.server.streaming import AnswerHead, chunk_logprobs, sse_response
from pitstop.server.submit import add, admit, check_structured, collect, rendered
from pitstop.server.tools import ChatTools, plan_tools

router = APIRouter()

ChatBody = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]

_CHUNK = "chat.completion.chunk"


@attrs.define
class ChatAnswer:
    """The JSON of one chat request's answer: whole, or as stream chunks.

    A streamed answer keeps one tool-call stream per choice (``streams``),
    which turns the text into content or tool-call deltas.
    """

    head: AnswerHead
    logprobs: int | None  # top-k per token, None: none
    tools: ChatTools
    streams: list[ToolCallStream | None] = attrs.field(factory=list)

    def first_chunk(self, n: int) -> dict[str, Any]:
        """The stream's first chunk: each choice's role, with empty content."""
        roles = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(n)
        ]
        return self.head.chunk(_CHUNK, roles)

    def chunk(
        self, index: int, text: str, finish: str | None, count: int, out: RequestOutput | None
    ) -> dict[str, Any]:
        """A stream chunk of choice ``index`` (:data:`~pitstop.server.streaming.ChunkFn`)."""
        stream = self.streams[index]
        if stream is None:
            delta: dict[str, Any] = {"content": text} if text else {}
        elif finish is None:
            delta = stream.feed(text)
        else:
            delta = stream.finish(text)
            finish = self.tools.finish_reason(finish, stream.has_calls)
        logprobs = chunk_logprobs(chat_logprobs, out, index, self.logprobs, count)
        return self.head.choice_chunk(_CHUNK, index, {"delta": delta}, logprobs, finish, out)

    def usage_chunk(self, final: RequestOutput) -> dict[str, Any]:
        """The stream's last chunk before [DONE] when usage is asked for."""
        return self.head.usage_chunk(_CHUNK, final)

    def choice(self, c: CompletionOutput) -> dict[str, Any]:
        """One choice of the whole answer: its message, tool calls parsed out of the text."""
        content, calls = self.tools.message(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        reason = OPENAI_FINISH.get(c.finish_reason or "", c.finish_reason or "")
        return {
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(c, self.logprobs) if self.logprobs is not None else None,
            "finish_reason": self.tools.finish_reason(reason, bool(calls)),
            "stop_reason": c.stop_reason,
        }

    def whole(self, final: RequestOutput) -> dict[str, Any]:
        """The non-streamed answer."""
        choices = [self.choice(c) for c in final.outputs]
        return {**self.head.body("chat.completion", choices), "usage": usage_of([final])}


@router.post("/v1/chat/completions")
async def chat_completions(
    request: Request, state: State, caller: Authorized, body: ChatBody
) -> Response:
    """Answer a chat (streamed or not), with tools when the request offers them."""
    state.check_model(body.model)
    state.check_chat_template(body.chat_template, body.chat_template_kwargs)
    messages = body.template_messages()
    tools = plan_tools(
        body.tools,
        body.tool_choice,
        parser=state.tool_parser,
        auto_enabled=state.settings.enable_auto_tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
    )
    options = body.chat_options(
        tools.template_tools, default_special_tokens=state.settings.special_tokens_in_content
    )
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    k = body.num_logprobs()
    check_logprobs(state, "top_logprobs", k)  # before SamplingParams, which names logprobs
    tool_constraint = tools.constraint(body.parallel_tool_calls)
    # No limit given (None): the engine stops at max_model_len.
    params = await off_loop(
        request,
        lambda: body.sampling_params(max_tokens, logprobs=k, tool_constraint=tool_constraint),
    )
    check_request_size(state, params, 1, logprobs_param="top_logprobs")
    structured_param = "tool_choice" if tool_constraint else body.structured_param()
    await check_structured(state, params, structured_param)
    rid = new_id("chatcmpl")
    chat = await rendered(state, messages, options, tools)
    chat_ids = None if chat is None else chat.token_ids
    (flight,) = admit(state, params, [chat_ids], caller.client)
    flight = await add(
        state,
        flight,
        rid,
        params,
        prompt=None if chat is None else chat.text,
        messages=messages if chat is None else None,
        prompt_token_ids=chat_ids,
        arrival=caller.arrival,
        model=body.model,
        structured_param=structured_param,
        prompt_param="messages",
    )
    head = AnswerHead(rid, now(), state.answer_name(body.model), body.include_usage)
    answer = ChatAnswer(head, k, tools)
    budget = ResponseBudget(state.settings.max_response_bytes)
    if body.stream:
        first = answer.first_chunk(params.n)
        answer.streams = [tools.stream() for _ in range(params.n)]  # one per choice
        return sse_response(
            flight,
            state.metrics,
            answer.chunk,
            first=first,
            usage_chunk=answer.usage_chunk if body.include_usage else None,
            num_choices=params.n,
            budget=budget,
        )
    return budget.json_response(answer.whole(await collect(state, request, flight, budget, k)))
