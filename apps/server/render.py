"""Turning engine outputs into OpenAI's JSON: finish reasons, choices' log-probabilities, usage.

Completions use OpenAI's legacy log-probability object (``tokens``,
``token_logprobs``, ``top_logprobs`` as ``{token: logprob}``,
``text_offset``); chat uses the newer one (``content``: a list of
``{token, logprob, bytes, top_logprobs}``). Both are built from a
:class:`~pitstop.requests.outputs.CompletionOutput`'s ``logprobs`` (one dict per token
of the chosen token and the top ``k``), for the last ``count`` tokens when
streaming.
"""

from __future__ import annotations

from typing import Any

from pitstop.requests.outputs import CompletionOutput, Logprob, RequestOutput

# OpenAI's finish reasons are stop, length, content_filter, tool_calls. A
# request the server aborted (shutdown) was cut short: "length" says so (and
# a streamed answer then ends with an error event that says why).
OPENAI_FINISH = {"stop": "stop", "length": "length", "abort": "length"}


def _text(entry: Logprob, token_id: int) -> str:
    return entry.decoded_token if entry.decoded_token is not None else f"<{token_id}>"


def _ranked(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely entries of one position, most likely first."""
    return sorted(position.items(), key=lambda kv: -kv[1].logprob)[:k]


def _last_positions(
    choice: CompletionOutput, count: int | None
) -> list[tuple[int, dict[int, Logprob]]] | None:
    """``(token id, its log-probabilities)`` of the last ``count`` tokens (all if None)."""
    if choice.logprobs is None:
        return None
    logprobs = choice.logprobs
    positions = logprobs if count is None else logprobs[len(logprobs) - count :]
    ids = choice.token_ids[len(choice.token_ids) - len(positions) :]
    return list(zip(ids, positions, strict=True))


def completion_logprobs(
    choice: CompletionOutput, k: int, count: int | None = None, text_offset: int = 0
) -> dict[str, Any] | None:
    """OpenAI's completions ``logprobs`` object for the last ``count`` tokens (all if None)."""
    pairs = _last_positions(choice, count)
    if pairs is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    offset = text_offset
    for token_id, position in pairs:
        chosen = position[token_id]
        text = _text(chosen, token_id)
        tokens.append(text)
        values.append(chosen.logprob)
        tops.append({_text(e, t): e.logprob for t, e in _ranked(position, k)} if k else None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    choice: CompletionOutput, k: int, count: int | None = None
) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs`` object (``{"content": [...]}``) for the last ``count`` tokens."""
    pairs = _last_positions(choice, count)
    if pairs is None:
        return None

    def entry(token_id: int, e: Logprob) -> dict[str, Any]:
        text = _text(e, token_id)
        return {"token": text, "logprob": e.logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, position in pairs:
        item = entry(token_id, position[token_id])
        item["top_logprobs"] = [entry(t, e) for t, e in _ranked(position, k)]
        content.append(item)
    return {"content": content}


def prompt_logprobs_json(output: RequestOutput) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs`` of a completion choice: per prompt token, by token id."""
    if output.prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            str(t): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token}
            for t, e in position.items()
        }
        for position in output.prompt_logprobs
    ]


def usage_of(outputs: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's ``usage`` over the requests of one response (every prompt, every sample);
    ``prompt_tokens_details.cached_tokens`` counts the prompt tokens the prefix cache served."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(o.num_generated_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)},
    }
