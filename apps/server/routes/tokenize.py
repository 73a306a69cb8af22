"""``POST /tokenize`` (a text or a chat to token ids) and ``POST /detokenize`` (back)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from pitstop.entrypoints.chat import ChatOptions, render_chat
from pitstop.errors import InvalidRequestError
from pitstop.requests.validation import check_token_ids
from pitstop.server.deps import Authorized, State, json_body
from pitstop.server.protocol import APIError, DetokenizeRequest, TokenizeRequest

router = APIRouter()

TokenizeBody = Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))]
DetokenizeBody = Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))]


@router.post("/tokenize")
async def tokenize(state: State, _caller: Authorized, body: TokenizeBody) -> JSONResponse:
    """The token ids of a prompt, or of a chat rendered by the model's template."""
    state.check_model(body.model, required=False)
    tok = state.tokenizer_or_400()
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send one of prompt (text) or messages (a chat)", param="prompt")
    try:
        if body.messages is not None:
            ids = render_chat(
                tok,
                [m.as_dict() for m in body.messages],
                ChatOptions(
                    add_generation_prompt=body.add_generation_prompt,
                    special_tokens_in_content=body.special_tokens_in_content
                    or state.settings.special_tokens_in_content,
                ),
            ).token_ids
        else:
            assert body.prompt is not None
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len})


@router.post("/detokenize")
async def detokenize(state: State, _caller: Authorized, body: DetokenizeBody) -> JSONResponse:
    """The text of a list of token ids (special tokens kept)."""
    state.check_model(body.model, required=False)
    tok = state.tokenizer_or_400()
    try:
        check_token_ids("tokens", body.tokens, state.vocab_size)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="tokens") from exc
    return JSONResponse({"prompt": tok.decode(body.tokens, skip_special_tokens=False)})
