"""The byte budget of one request's answer (``--max-response-bytes``).

What a request asks for bounds its answer only loosely: ``n`` choices of up
to ``max_model_len`` tokens, each with up to 20 log-probabilities and their
bytes, can make tens of megabytes that the server would hold (a non-streamed
answer is built whole) or queue for a slow reader. :class:`ResponseBudget`
counts the bytes of one request's answer as it grows: every event of a
stream exactly, and for an answer built whole an estimate per engine output
(:func:`output_bytes`) and then the JSON itself. A request that reaches the
budget is ended there: a stream ends each open choice with
``finish_reason: "length"`` and an error event with code
``response_too_large``; a whole answer is a 400 with that code, and the
request is aborted in the engine either way.
"""

from __future__ import annotations

import attrs
from fastapi.responses import JSONResponse

from pitstop.requests.outputs import RequestOutput
from pitstop.server.protocol import APIError

LOGPROB_ENTRY_BYTES = 96
"""What one log-probability entry costs in an answer, about (chat's ``{"token", "logprob",
"bytes"}`` with a short token; completions' ``"token": logprob`` is smaller)."""

CHOICE_OVERHEAD_BYTES = 160
"""What one choice's chunk of a stream, or a token's share of a whole answer, costs besides
its text and log-probabilities (ids, object names, finish reasons)."""


def output_bytes(out: RequestOutput, logprobs: int | None, *, first: bool = False) -> int:
    """About how many bytes ``out`` (one engine output of a request) adds to its answer: the
    new text of every choice, JSON-escaped, and ``logprobs + 1`` entries per new token
    (``first``: the output's prompt log-probabilities too, sent once)."""
    total = 0
    per_token = 0 if logprobs is None else (logprobs + 1) * LOGPROB_ENTRY_BYTES
    for choice in out.outputs:
        text = choice.text_delta
        # a control character is escaped as \u00XX (6 bytes); everything else as its UTF-8
        total += len(text.encode("utf-8", "surrogatepass")) + 5 * sum(c < " " for c in text)
        total += len(choice.new_token_ids) * per_token
    if first and out.prompt_logprobs is not None:
        total += sum(
            len(position) * LOGPROB_ENTRY_BYTES for position in out.prompt_logprobs if position
        )
    return total


@attrs.define
class ResponseBudget:
    """The bytes one request's answer may still take (see the module docstring)."""

    limit: int
    used: int = 0

    def take(self, nbytes: int) -> bool:
        """Count ``nbytes`` more; False once the answer is over the budget."""
        self.used += nbytes
        return self.used <= self.limit

    def error(self) -> APIError:
        """The error of a request whose answer reached the budget."""
        return APIError(
            400,
            f"the answer to this request reached the server's limit of {self.limit:,} bytes "
            "(--max-response-bytes) and the request was ended there; ask for fewer tokens "
            "(max_tokens), fewer log-probabilities (logprobs, top_logprobs) or fewer choices "
            "(n), or stream the answer and read it as it comes",
            code="response_too_large",
        )

    def json_response(self, body: dict) -> JSONResponse:  # type: ignore[type-arg]
        """``body`` as the JSON answer, or the budget's 400 when the JSON is over it."""
        response = JSONResponse(body)
        if len(response.body) > self.limit:
            raise self.error()
        return response
