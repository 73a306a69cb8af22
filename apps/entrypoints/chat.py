"""Rendering a chat into a prompt: one implementation for ``LLM.chat`` and the server.

A conversation arrives as OpenAI messages (``{"role", "content"}``, where
content is a string or a list of ``{"type": "text", "text": ...}`` parts;
assistant messages may carry ``tool_calls``, tool messages a
``tool_call_id``). :func:`template_messages` turns them into what chat
templates read, :class:`ChatOptions` holds the template options both entry
points take (vLLM's names), and :func:`render_chat` renders the text and its
token ids, so that ``RequestOutput.prompt`` can show the text the model saw.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from pitstop.entrypoints.chat_template import (
    encode_chat_text,
    mark_special_text,
    render_chat_template,
    unmark,
)
from pitstop.entrypoints.validation import refuse_unknown_keys
from pitstop.errors import fail_request as _fail

if TYPE_CHECKING:
    from pitstop.loading.tokenizer import Tokenizer


def _text_of_parts(parts: Sequence[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping):
            _fail(
                f"{where}[{j}] must be a content part such as {{'type': 'text', 'text': ...}}, "
                f"got {type(part).__name__}"
            )
        kind = part.get("type")
        if kind != "text":
            _fail(
                f"{where}[{j}] is a content part of type {kind!r}; pitstop serves text models, "
                "so only {'type': 'text', 'text': ...} parts are accepted"
            )
        refuse_unknown_keys(
            part, {"type", "text"}, f"{where}[{j}]", "a text part has type and text"
        )
        text = part.get("text")
        if not isinstance(text, str):
            _fail(f"{where}[{j}].text must be a string, got {type(text).__name__}")
        texts.append(text)
    return "".join(texts)


def _template_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` as templates read them: ``arguments`` as an object."""
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        _fail(f"{where} must be a list of tool calls, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            _fail(
                f"{where}[{j}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}"
            )
        call = dict(call)
        function = dict(function)
        arguments = function.get("arguments")
        if isinstance(arguments, str):  # OpenAI sends JSON text; templates index into an object
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                function["arguments"] = parsed
        call["function"] = function
        out.append(call)
    return out


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates read them.

    Text content parts are joined into one string (other part types are
    refused by name), ``developer`` becomes ``system``, ``content: null``
    becomes ``""`` and an assistant's tool-call ``arguments`` (JSON text)
    become objects. Roles and texts are checked when the template renders them
    (:func:`pitstop.entrypoints.chat_template.validate_messages`).
    """
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        _fail(
            f"messages must be a list of {{'role', 'content'}} objects, got {type(messages).__name__}"
        )
    if not messages:
        _fail("the conversation is empty; give at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            _fail(
                f"messages[{i}] must be an object with role and content, got "
                f"{type(message).__name__}"
            )
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content", "")
        if isinstance(content, Sequence) and not isinstance(content, str):
            message["content"] = _text_of_parts(content, f"messages[{i}].content")
        else:
            message["content"] = content
        if message.get("role") == "developer":
            message["role"] = "system"
        for key, role in (("tool_calls", "assistant"), ("tool_call_id", "tool")):
            if key in message and message.get("role") != role:
                _fail(
                    f"messages[{i}].{key} belongs to a message of role {role!r}, not "
                    f"{message.get('role')!r}; remove it"
                )
        if "tool_calls" in message:
            message["tool_calls"] = _template_tool_calls(
                message["tool_calls"], f"messages[{i}].tool_calls"
            )
            if not message["tool_calls"]:
                del message["tool_calls"]
        out.append(message)
    return out


SPECIAL_TOKENS_IN_CONTENT = ("text", "tokens")
"""The values of ``ChatOptions.special_tokens_in_content``."""

RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        # pitstop's own options
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        # transformers' apply_chat_template parameters: a kwarg of these names would change
        # the template, or what the renderer returns, instead of reaching the template
        "conversation",
        "chat_template",
        "documents",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)
"""``chat_template_kwargs`` names that are options of rendering rather than template values."""


def _kwargs(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        _fail(f"chat_template_kwargs must be an object of named values, got {type(value).__name__}")
    return dict(value)


@attrs.frozen(kw_only=True)
class ChatOptions:
    """How a chat is rendered (vLLM's names; ``LLM.chat`` and the server take the same).

    ``chat_template`` (Jinja text) replaces the model's own;
    ``add_generation_prompt`` opens the assistant's turn;
    ``continue_final_message`` leaves the last (assistant) message open so
    the model continues it (it excludes ``add_generation_prompt``, as in
    vLLM); ``chat_template_kwargs`` are passed to the template; ``tools``
    (OpenAI function definitions) are passed to it as ``tools``.
    ``special_tokens_in_content``: ``"text"`` (the default, as OpenAI) encodes
    special-token text written in messages, tools and template arguments as
    plain text, so a message cannot forge another role; ``"tokens"`` reads it
    as the special tokens (vLLM's behaviour).
    """

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = attrs.field(default=None, converter=_kwargs)
    tools: tuple[dict[str, Any], ...] | None = attrs.field(
        default=None, converter=lambda v: tuple(v) if isinstance(v, list) else v
    )
    special_tokens_in_content: str = "text"

    def __attrs_post_init__(self) -> None:
        if self.special_tokens_in_content not in SPECIAL_TOKENS_IN_CONTENT:
            _fail(
                "special_tokens_in_content must be 'text' (special-token text in messages "
                "stays text) or 'tokens' (it is read as special tokens), got "
                f"{self.special_tokens_in_content!r}"
            )
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name} must be true or false")
        if self.continue_final_message and self.add_generation_prompt:
            _fail(
                "continue_final_message and add_generation_prompt exclude each other; "
                "pass add_generation_prompt=False to continue the last message"
            )
        if self.chat_template is not None and (
            not isinstance(self.chat_template, str) or not self.chat_template
        ):
            _fail("chat_template must be a non-empty Jinja template string")
        clash = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or ()))
        if clash:
            _fail(
                f"chat_template_kwargs must not set {clash[0]!r}: it is an option of the "
                "renderer, not a template variable; pass it as its own option or leave it out"
            )


@attrs.frozen
class RenderedChat:
    """A chat rendered by the template: the prompt text and its token ids."""

    text: str
    token_ids: list[int]


def template_reads_tools(tokenizer: Tokenizer, options: ChatOptions) -> bool:
    """Whether the chat template in use mentions ``tools`` (SmolLM2's does not)."""
    template = options.chat_template or tokenizer.chat_template or ""
    return "tools" in template


def render_chat(
    tokenizer: Tokenizer,
    messages: Any,
    options: ChatOptions | None = None,
    *,
    tool_prompt: Callable[[Sequence[dict[str, Any]]], str] | None = None,
    renderer: Callable[..., str] | None = None,
) -> RenderedChat:
    """Render one conversation with the model's template (or ``options.chat_template``).

    ``renderer`` replaces :func:`~pitstop.entrypoints.chat_template.render_chat_template`
    over ``tokenizer`` (same arguments, the tokenizer left out; the server renders a
    request's own template in a sandbox process with it).

    With ``options.tools`` and a template that does not read ``tools``,
    ``tool_prompt(tools)`` (text that describes the tools and the format to
    call them in) is added to the system message, so the model still learns
    of them; without ``tool_prompt`` such tools are refused rather than
    dropped.
    """
    options = options or ChatOptions()
    rendered = template_messages(messages)
    tools = list(options.tools) if options.tools else None
    kwargs = options.chat_template_kwargs
    if options.special_tokens_in_content == "text":  # marked, to be encoded as plain text
        rendered = mark_special_text(tokenizer, rendered)
        tools = mark_special_text(tokenizer, tools)
        kwargs = mark_special_text(tokenizer, kwargs)
    if tools and not template_reads_tools(tokenizer, options):
        if tool_prompt is None:
            _fail(
                "the chat template does not read tools, so the model would never see them; "
                "pass a chat_template that renders tools"
            )
        assert tool_prompt is not None
        text = tool_prompt(tools)
        if rendered[0].get("role") == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{text}"}
        else:
            rendered.insert(0, {"role": "system", "content": text})
    render = renderer or functools.partial(render_chat_template, tokenizer)
    text = render(
        rendered,
        options.add_generation_prompt,
        chat_template=options.chat_template,
        continue_final_message=options.continue_final_message,
        template_kwargs=kwargs,
        tools=tools,
    )
    return RenderedChat(unmark(text), encode_chat_text(tokenizer, text))
