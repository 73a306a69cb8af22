"""The ``hermes`` tool-call parser: calls written as ``<tool_call>{"name", "arguments"}</tool_call>``.

The format of Hermes 2 Pro, Qwen2.5 and Qwen3 models: each call is a JSON
object with ``name`` and ``arguments`` between ``<tool_call>`` and
``</tool_call>``; text outside the tags is the answer's content. A block
that opens with something other than an object, or an object without a
string ``name``, is left in the content as written.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pitstop.entrypoints.tool_calls import CallView, ToolCallView, call_of, scan_object
from pitstop.plugin_system.hookspecs import hookimpl

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class HermesToolParser:
    """Reads ``<tool_call>`` blocks (see the module's docstring)."""

    def parse(self, text: str, final: bool) -> ToolCallView:
        """The content outside the blocks and the calls inside them, as far as known."""
        content: list[str] = []
        calls: list[CallView] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - _partial_suffix(tail, OPEN)]
                content.append(tail)
                break
            content.append(text[pos:start])
            body = _skip_ws(text, start + len(OPEN))
            if body >= len(text):  # the block has just opened
                if final:
                    content.append(text[start:])
                break
            if text[body] != "{":  # not a call: the tag stays in the content
                content.append(text[start:body])
                pos = body
                continue
            obj = scan_object(text, body)
            call = call_of(text, obj, final=final, argument_keys=("arguments", "parameters"))
            if obj.end is None:  # the text stops inside the object
                if call is not None:
                    calls.append(call)
                elif final:
                    content.append(text[start:])
                break
            after = _skip_ws(text, obj.end)
            if text.startswith(CLOSE, after):
                end = after + len(CLOSE)
            elif not final and CLOSE.startswith(text[after:]):
                end = len(text)  # the closing tag may be arriving
            else:
                end = obj.end  # no closing tag: the object alone is the block
            if call is None:
                content.append(text[start:end])
            else:
                calls.append(call)
            pos = end
            if end >= len(text):
                break
        joined = "".join(content)
        if calls or not final:
            joined = joined.rstrip()
        return ToolCallView(joined, tuple(calls))

    def tool_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        """The tools inside ``<tools>`` and how to call one in ``<tool_call>`` tags."""
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "You can call functions to help answer. They are described as JSON schemas "
            f"inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
            "To call a function, write a JSON object with its name and arguments inside "
            'tags, one call per pair:\n<tool_call>\n{"name": <function name>, "arguments": '
            "<arguments object>}\n</tool_call>"
        )


def create_hermes(tokenizer: Any) -> HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Hermes, Qwen2.5, Qwen3)."""
    del tokenizer  # the tags are matched as text
    return HermesToolParser()


@hookimpl
def register_tool_parsers(register: Any) -> None:
    """The Hermes / Qwen tool-call format."""
    register(
        "hermes",
        create_hermes,
        description="<tool_call>{name, arguments}</tool_call> (Hermes, Qwen)",
    )
