"""Tool calling on ``/v1/chat/completions``: what a request's ``tools`` and ``tool_choice`` mean.

- ``"none"`` (the default without ``--enable-auto-tool-choice``): the
  template still gets the tools, the answer is plain content.
- ``"required"`` and a named function: the output is constrained to JSON
  (:func:`pitstop.entrypoints.tool_calls.tool_choice_constraint`) and read back as calls;
  no parser is needed.
- ``"auto"`` (the default with ``--enable-auto-tool-choice``): the model
  answers freely, and the tool-call parser chosen with ``--tool-call-parser``
  reads the calls out of its text.

:class:`ChatTools` is one request's plan: the constraint to add, the prompt
text for templates that do not render tools, and how to turn the text into a
message (whole) or into deltas (streamed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from pitstop.entrypoints.tool_calls import (
    FunctionTool,
    ToolCallStream,
    ToolCallView,
    ToolChoice,
    constrained_view,
    default_tool_prompt,
    finished_calls,
    parse_tool_choice,
    parse_tools,
    tool_choice_constraint,
)
from pitstop.errors import InvalidRequestError
from pitstop.plugin_system.protocols import ToolParser
from pitstop.server.protocol import APIError


@attrs.frozen
class ChatTools:
    """One chat request's tool calling (see the module's docstring)."""

    tools: tuple[FunctionTool, ...]
    choice: ToolChoice
    view: Callable[[str, bool], ToolCallView] | None  # None: the text is plain content
    # the tools described for a template that does not render them (None: not described)
    prompt: Callable[[Sequence[dict[str, Any]]], str] | None

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (None without tools)."""
        return [t.to_openai() for t in self.tools] or None

    def constraint(self, parallel_tool_calls: bool | None) -> dict[str, Any] | None:
        """The structured-outputs constraint of ``"required"`` or a named function, else None."""
        if self.choice.mode not in ("required", "function"):
            return None
        schema = tool_choice_constraint(self.choice, self.tools)
        if self.choice.mode == "required" and parallel_tool_calls is False:
            schema = {**schema, "maxItems": 1}
        return {"json": schema}

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The ``content`` and ``tool_calls`` of a whole answer."""
        if self.view is None:
            return text, []
        view = self.view(text, True)
        calls = [c.to_openai() for c in finished_calls(view)]
        return (view.content or None) if calls else view.content, calls

    def stream(self) -> ToolCallStream | None:
        """A stream of one choice's deltas (None: stream the text as content)."""
        return None if self.view is None else ToolCallStream(self.view)

    def finish_reason(self, reason: str, has_calls: bool) -> str:
        """OpenAI's finish reason: ``tool_calls`` when ``"auto"`` or ``"required"`` called.

        A named function answers ``stop``, as OpenAI (and vLLM) do.
        """
        if has_calls and reason == "stop" and self.choice.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def plan_tools(
    tools: Any,
    tool_choice: Any,
    *,
    parser: ToolParser | None,
    auto_enabled: bool,
    parallel_tool_calls: bool | None = None,
) -> ChatTools:
    """Check a request's ``tools`` and ``tool_choice`` (400 naming the field) and plan them."""
    try:
        parsed = parse_tools(tools)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="tools") from exc
    try:
        choice = parse_tool_choice(tool_choice, parsed, default="auto" if auto_enabled else "none")
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="tool_choice") from exc
    if choice.mode == "auto" and (not auto_enabled or parser is None):
        raise APIError(
            400,
            'tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
            "--tool-call-parser NAME (hermes or llama3_json, or a plugin's); or send "
            'tool_choice "required", a named function, or "none"',
            param="tool_choice",
        )
    if parallel_tool_calls is False and choice.mode == "auto":
        raise APIError(
            400,
            'parallel_tool_calls: false is not supported with tool_choice "auto" (the model '
            'may write several calls); use "required" (then at most one call) or a named function',
            param="parallel_tool_calls",
        )
    if choice.mode == "auto":
        assert parser is not None
        return ChatTools(parsed, choice, parser.parse, parser.tool_prompt)
    if choice.mode == "none":  # a template that renders tools still gets them (as vLLM)
        return ChatTools(parsed, choice, None, None)
    return ChatTools(parsed, choice, constrained_view(choice), default_tool_prompt)
