"""Request and response shapes of the OpenAI-compatible API (the subset pitstop serves).

Requests are pydantic models in strict mode: a wrong type is a 400 that
names the field, and nothing is coerced (``true`` is not the number 1,
``"0.5"`` is not a float; an integer is accepted where a float is expected).
NaN, infinities and lone UTF-16 surrogates never get this far: the body
parser refuses them (see :func:`parse_json_body`). Unknown fields are ignored, as most OpenAI-compatible servers do, so that
clients which send extra options keep working; options that would change the
output but that pitstop does not implement (``n > 1``, ``logprobs``,
``echo``, penalties, ``logit_bias``, ``suffix``) are rejected with a 400
rather than silently ignored.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pitstop.errors import InvalidRequestError
from pitstop.sampling_params import SamplingParams


class APIError(Exception):
    """An error answered as OpenAI's JSON error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.counted = True  # whether /metrics counts it as a failed request

    def to_dict(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def parse_json_body(body: bytes, *, max_depth: int) -> dict[str, Any]:
    """The request body as a JSON object, or an :class:`APIError` 400 that says what is wrong.

    Stricter than :func:`json.loads`: ``NaN``, ``Infinity`` and numbers that
    overflow a float (``1e400``) are refused, as are strings holding a lone
    UTF-16 surrogate (``"\\ud800"``, which is not text) and nesting deeper
    than ``max_depth`` arrays and objects.
    """

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number; send a finite number")

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"the number {text[:40]} is too large for a float")
        return value

    try:
        data = json.loads(body, parse_constant=no_constant, parse_float=finite)
    except RecursionError:
        raise APIError(
            400,
            f"the request body nests arrays or objects deeper than {max_depth} levels",
            code="json_too_deep",
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except ValueError as exc:  # parse_constant, parse_float, or an int of over 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_tree(data, max_depth)
    return data


def _check_tree(data: Any, max_depth: int) -> None:
    """Walk the parsed body once (no recursion): bound its depth, refuse lone surrogates."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "body")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, dict | list):
            if depth > max_depth:
                raise APIError(
                    400,
                    f"the request body nests arrays or objects deeper than {max_depth} levels "
                    f"(at {path})",
                    code="json_too_deep",
                )
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, value in items:
                if isinstance(key, str):
                    _check_text(key, path)
                    child = f"{path}.{key}" if path != "body" else key
                else:
                    child = f"{path}[{key}]"
                stack.append((value, depth + 1, child))
        elif isinstance(node, str):
            _check_text(node, path)


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(
            400,
            f"{path} holds {text[exc.start : exc.end]!r}, half of a UTF-16 surrogate pair, which "
            "is not text; send valid Unicode (pair the surrogates or remove it)",
            param=path.split(".", 1)[0].split("[", 1)[0],
        ) from None


_STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with token counts."""

    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The fields completions and chat share."""

    model_config = _STRICT

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM's spelling; -1 or 0 disables)
    min_p: float | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def _check_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(
                400,
                f"n must be 1 (pitstop returns one choice per request), got {self.n}",
                param="n",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported; leave it unset or 0", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise APIError(400, f"stop takes at most 4 strings, got {len(self.stop)}", param="stop")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Build validated :class:`SamplingParams`; an invalid value is a 400 naming the field."""
        self._check_unsupported()
        top_k = self.top_k
        if top_k == 0:
            top_k = -1  # OpenAI-style clients send 0 for "disabled"
        values: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if top_k is None else top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "seed": self.seed,
            "stop": self.stop or (),
            "stop_token_ids": self.stop_token_ids or (),
            "ignore_eos": self.ignore_eos,
        }
        try:
            return SamplingParams(**values)
        except InvalidRequestError as exc:
            message = str(exc)
            first = message.split(" ", 1)[0].rstrip(":")
            param = first if first in values else None
            raise APIError(400, message, param=param) from exc

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def prompt_input(self) -> tuple[str | None, list[int] | None]:
        """The one prompt, as text or token ids."""
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.logprobs is not None:
            raise APIError(400, "logprobs is not supported", param="logprobs")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1", param="best_of")
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt, None
        if prompt and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)  # type: ignore[arg-type]
        if len(prompt) == 1:
            only = prompt[0]
            return (only, None) if isinstance(only, str) else (None, list(only))  # type: ignore[arg-type]
        raise APIError(
            400, "send one prompt per request (a string or a list of token ids)", param="prompt"
        )


class ContentPart(BaseModel):
    """One part of a message's content; only ``text`` parts are supported."""

    model_config = _STRICT
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, str]:
        """The message as the chat template expects it (text content)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"content parts of type {part.type!r} are not supported",
                        param="messages",
                    )
                texts.append(part.text)
            content = "".join(texts)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    tools: list[Any] | None = None

    def template_messages(self) -> list[dict[str, str]]:
        """The conversation for the chat template."""
        if self.logprobs:
            raise APIError(400, "logprobs is not supported", param="logprobs")
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")
        return [m.to_template() for m in self.messages]


# ---------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time, in whole seconds (OpenAI's ``created``)."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
