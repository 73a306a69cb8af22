"""Request and response shapes of the OpenAI-compatible API (the subset pitstop serves).

Requests are pydantic models in strict mode: a wrong type is a 400 that
names the field, and nothing is coerced (``true`` is not the number 1,
``"0.5"`` is not a float; an integer is accepted where a float is expected).
NaN, infinities and lone UTF-16 surrogates never get this far: the body
parser refuses them (see :func:`parse_json_body`). A field pitstop does not
know is a 400 that names it, and so is a known option it does not implement
(``echo``, ``suffix``): nothing a request sends is silently
ignored. ``user`` is accepted and changes nothing (docs/server.md).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pitstop.entrypoints.chat import ChatOptions
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.entrypoints.structured import structured_outputs_of
from pitstop.errors import InvalidRequestError


def clip(text: str, limit: int = 64) -> str:
    """``repr(text)`` cut to ``limit`` characters with its length: an error names what the
    request sent without repeating a long input back (a 1 MiB model name, an 8 KiB path)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"


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
    than ``max_depth`` arrays and objects. The body must be UTF-8 (RFC 8259;
    ``json.loads`` of bytes would also take UTF-16 and UTF-32), without a BOM.
    """

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number; send a finite number")

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"the number {text[:40]} is too large for a float")
        return value

    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(
            400,
            f"the request body is not UTF-8 (byte {exc.start} is not); send JSON encoded as "
            "UTF-8 (RFC 8259), not UTF-16, UTF-32 or Latin-1",
            code="invalid_encoding",
        ) from None
    if "\x00" in text or text.startswith("\ufeff"):
        # NUL never appears raw in JSON: this is UTF-16/32 that happens to be valid UTF-8
        raise APIError(
            400,
            "the request body is not UTF-8 JSON (it holds a byte-order mark or NUL bytes, as "
            "UTF-16 and UTF-32 do); send JSON encoded as UTF-8 (RFC 8259) without a BOM",
            code="invalid_encoding",
        )
    try:
        data = json.loads(text, parse_constant=no_constant, parse_float=finite)
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


_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with token counts."""

    model_config = _STRICT
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the answer must validate against."""

    model_config = _STRICT
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text``, ``json_object``, ``json_schema`` or vLLM's ``structural_tag``."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None  # structural_tag (vLLM's extension)
    triggers: list[str] | None = None


class _SamplingFields(BaseModel):
    """The fields completions and chat share (OpenAI's, plus vLLM's extensions)."""

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
    min_tokens: int = 0  # extension
    include_stop_str_in_output: bool = False  # extension
    skip_special_tokens: bool = True  # extension
    spaces_between_special_tokens: bool = True  # extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # extension (vLLM's name)
    guided_json: dict[str, Any] | str | None = None  # extension (vLLM's older names)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # applies to guided_json / json constraints
    user: str | None = None

    def _structured(self, implied: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The one structured-output constraint the request asks for, as StructuredOutputs fields.

        ``implied`` is the constraint of ``tool_choice`` (``"required"`` or a named function).
        """
        asked: list[tuple[str, dict[str, Any]]] = []
        if implied is not None:
            asked.append(("tool_choice", implied))
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(
                    400,
                    "response_format of type json_schema needs json_schema.schema (the JSON "
                    "schema of the answer)",
                    param="response_format",
                )
            asked.append(("response_format", {"json": fmt.json_schema.schema_}))
        elif fmt is not None and fmt.type == "structural_tag":
            tag = {"type": "structural_tag", "structures": fmt.structures, "triggers": fmt.triggers}
            asked.append(("response_format", {"structural_tag": tag}))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", dict(self.structured_outputs)))
        for field, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, field)
            if value is not None:
                asked.append((field, {key: value}))
        if len(asked) > 1:
            raise APIError(
                400,
                f"{asked[0][0]} and {asked[1][0]} both constrain the output; send one of them",
                param=asked[1][0],
            )
        if self.guided_whitespace_pattern is not None:
            if not asked:
                raise APIError(
                    400,
                    "guided_whitespace_pattern shapes JSON output; send it with guided_json "
                    "(or structured_outputs.whitespace_pattern with structured_outputs.json)",
                    param="guided_whitespace_pattern",
                )
            asked[0][1].setdefault("whitespace_pattern", self.guided_whitespace_pattern)
        return asked[0][1] if asked else None

    def _check_unsupported(self) -> None:
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise APIError(400, f"stop takes at most 4 strings, got {len(self.stop)}", param="stop")
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed with stream: true", param="stream_options"
            )

    def sampling_params(
        self,
        max_tokens: int | None,
        *,
        logprobs: int | None = None,
        best_of: int | None = None,
        prompt_logprobs: int | None = None,
        tool_constraint: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """Build validated :class:`SamplingParams`; an invalid value is a 400 naming the field.

        ``tool_constraint``: the structured output ``tool_choice`` implies.
        """
        self._check_unsupported()
        values: dict[str, Any] = {
            "n": self.n,
            "best_of": best_of,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "seed": self.seed,
            "stop": self.stop or (),
            "stop_token_ids": self.stop_token_ids or (),
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0
            if self.repetition_penalty is None
            else self.repetition_penalty,
            "logit_bias": self.logit_bias or {},
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
        }
        structured = self._structured(tool_constraint)
        try:
            if structured is not None:
                values["structured_outputs"] = structured_outputs_of(structured)
            return SamplingParams(**values)
        except InvalidRequestError as exc:
            message = str(exc)
            first = message.split(" ", 1)[0].rstrip(":").split(".", 1)[0]
            param = first if first in values else None
            if first == "structured_outputs":
                param = self.structured_param()
            raise APIError(400, message, param=param) from exc

    def structured_param(self) -> str | None:
        """The request field that asked for structured outputs (the ``param`` of its errors)."""
        return next(
            (
                f
                for f in (
                    "response_format",
                    "structured_outputs",
                    "guided_json",
                    "guided_regex",
                    "guided_choice",
                    "guided_grammar",
                )
                if getattr(self, f) is not None
            ),
            None,
        )

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


Prompt = tuple[str | None, list[int] | None]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # extension (vLLM's)
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[Prompt]:
        """Every prompt of the request, as text or token ids (a list gives one choice each)."""
        if self.echo:
            raise APIError(
                400, "echo is not supported (pitstop does not return the prompt)", param="echo"
            )
        if self.suffix:
            raise APIError(400, "suffix is not supported (no fill-in-the-middle)", param="suffix")
        prompt = self.prompt
        if isinstance(prompt, str):
            return [(prompt, None)]
        if prompt and all(isinstance(t, int) for t in prompt):
            return [(None, list(prompt))]  # type: ignore[arg-type]
        if not prompt:
            raise APIError(400, "prompt is an empty list; send at least one prompt", param="prompt")
        return [(p, None) if isinstance(p, str) else (None, list(p)) for p in prompt]  # type: ignore[misc]


class ChatMessage(BaseModel):
    """One chat message (content: text, or a list of ``{"type": "text", "text"}`` parts)."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers

    def as_dict(self) -> dict[str, Any]:
        """The message as sent, for :func:`pitstop.entrypoints.chat.template_messages`."""
        return self.model_dump(exclude_none=True)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = None  # extension (vLLM's)
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM's)
    add_generation_prompt: bool = True  # extension (vLLM's)
    continue_final_message: bool = False  # extension (vLLM's)
    special_tokens_in_content: Literal["text", "tokens"] | None = None  # extension (pitstop's)

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as sent (content parts and tool calls are read by pitstop.entrypoints.chat)."""
        return [m.as_dict() for m in self.messages]

    def chat_options(
        self, tools: list[dict[str, Any]] | None, *, default_special_tokens: str = "text"
    ) -> ChatOptions:
        """The template options (:class:`pitstop.entrypoints.chat.ChatOptions`); a bad one is a
        400. ``default_special_tokens``: the server's ``--special-tokens-in-content``."""
        try:
            return ChatOptions(
                chat_template=self.chat_template,
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
                chat_template_kwargs=self.chat_template_kwargs,
                tools=tools,
                special_tokens_in_content=self.special_tokens_in_content or default_special_tokens,
            )
        except InvalidRequestError as exc:
            message = str(exc)
            param = next(
                (
                    f
                    for f in ("chat_template_kwargs", "continue_final_message", "chat_template")
                    if f in message
                ),
                None,
            )
            raise APIError(400, message, param=param) from exc

    def num_logprobs(self) -> int | None:
        """``logprobs`` + ``top_logprobs`` as SamplingParams.logprobs (None: not asked)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a prompt or a chat to turn into token ids."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    special_tokens_in_content: Literal["text", "tokens"] | None = None  # messages only


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the adapter at ``lora_path`` as ``lora_name``."""

    model_config = _STRICT
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # vLLM's: replace an adapter of that name


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's): stop serving the adapter ``lora_name``."""

    model_config = _STRICT
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; ignored (the name says which)


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids to turn into text."""

    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


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


class UpdateWeightsFromDiskRequest(BaseModel):
    """``POST /update_weights_from_disk`` (SGLang's): new weights from a Hugging Face folder."""

    model_config = _STRICT
    model_path: str = Field(min_length=1)
    load_format: str | None = None  # SGLang's; only None / "auto" (safetensors) is read
