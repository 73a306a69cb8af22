"""The ``llama3_json`` tool-call parser: an answer that is ``{"name", "parameters"}`` JSON.

Llama 3.1 / 3.2 models with a JSON tool template answer a call with the
object ``{"name": ..., "parameters": {...}}`` (``arguments`` is read too),
optionally after ``<|python_tag|>``; several calls are separated by ``;``.
An answer that does not open with an object, or whose first object has no
string ``name``, is plain content. Text after the calls is content.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pitstop.entrypoints.tool_calls import CallView, ToolCallView, call_of, scan_objects
from pitstop.plugin_system.hookspecs import hookimpl

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser:
    """Reads Llama 3's JSON tool calls (see the module's docstring)."""

    def parse(self, text: str, final: bool) -> ToolCallView:
        """The calls, or the content when the answer is not a call, as far as known."""
        stripped = text.lstrip()
        i = len(text) - len(stripped)
        if stripped.startswith(PYTHON_TAG):
            i += len(PYTHON_TAG)
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
        elif not final and PYTHON_TAG.startswith(stripped):
            return ToolCallView()  # nothing yet, or the start of the tag
        if i >= len(text) or text[i] != "{":
            if i >= len(text) and not final:
                return ToolCallView()
            return ToolCallView(text if final else text.rstrip())
        objects, stop, ran_out = scan_objects(text, i, ";")
        calls: list[CallView] = []
        for n, obj in enumerate(objects):
            call = call_of(text, obj, final=final, argument_keys=("parameters", "arguments"))
            if call is None:
                if obj.end is not None and n == 0:  # a JSON answer, not a call
                    return ToolCallView(text if final else text.rstrip())
                if final:
                    return ToolCallView(text[obj.start :].rstrip(), tuple(calls))
                return ToolCallView("", tuple(calls))
            calls.append(call)
        if final and not ran_out:
            return ToolCallView(text[stop:].rstrip(), tuple(calls))
        return ToolCallView("", tuple(calls))

    def tool_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        """The tools as JSON and how to answer with a call."""
        listed = "\n\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "You can call one of these functions (JSON schemas) to answer:\n\n"
            f"{listed}\n\n"
            "To call one, answer with nothing but a JSON object naming it and giving its "
            'arguments: {"name": <function name>, "parameters": <arguments object>}.'
        )


def create_llama3_json(tokenizer: Any) -> Llama3JsonToolParser:
    """``{"name": ..., "parameters": ...}`` answers (Llama 3.1 / 3.2 JSON tool calling)."""
    del tokenizer
    return Llama3JsonToolParser()


@hookimpl
def register_tool_parsers(register: Any) -> None:
    """Llama 3's JSON tool-call format."""
    register(
        "llama3_json",
        create_llama3_json,
        description='{"name", "parameters"} answers (Llama 3.1 / 3.2 JSON tool calling)',
    )
