"""Tool calls: OpenAI's ``tools`` and ``tool_choice``, the constraints they imply, and streaming.

- :func:`parse_tools` and :func:`parse_tool_choice` check what a request sends
  (OpenAI's shapes) where it enters.
- ``tool_choice`` ``"required"`` and a named function need no parser: the
  output is constrained (:func:`tool_choice_constraint`) to JSON that
  :func:`constrained_view` reads back — for ``"required"`` an array of
  ``{"name", "parameters"}`` objects, one of the tools each; for a named
  function its arguments object.
- ``"auto"`` leaves the model free and a tool-call parser (a plugin kind,
  :class:`pitstop.plugin_system.protocols.ToolParser`) reads the calls out of the text.
  A parser gives a *view* of a text: the content and the calls in it.
  :class:`ToolCallStream` turns the views of a growing text into OpenAI's
  streaming deltas, so a parser is written once for both modes.
- :func:`scan_objects` is the incremental JSON scanner the shipped parsers
  share: it finds each object's top-level keys and where their values end,
  in text that may stop anywhere.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from pitstop.entrypoints.json_schema import check_schema
from pitstop.entrypoints.validation import refuse_unknown_keys
from pitstop.errors import fail_request as _fail

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@attrs.frozen
class FunctionTool:
    """One tool a request offers: a function's name, description and parameters schema."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        """The tool as OpenAI writes it (what chat templates read as ``tools``)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


def parse_tools(tools: Any) -> tuple[FunctionTool, ...]:
    """OpenAI's ``tools`` (``[{"type": "function", "function": {"name", "description",
    "parameters"}}]``) as :class:`FunctionTool`; anything else is refused by name."""
    if tools is None:
        return ()
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        _fail(f"tools must be a list of function tools, got {type(tools).__name__}")
    out: list[FunctionTool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
            _fail(
                f"{where} is of type {kind!r}; pitstop takes function tools: "
                "{'type': 'function', 'function': {'name', 'description', 'parameters'}}"
            )
        refuse_unknown_keys(tool, {"type", "function"}, where, "a tool has type and function")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            _fail(f"{where}.function must be an object with name (and description, parameters)")
        refuse_unknown_keys(
            function,
            {"name", "description", "parameters", "strict"},
            f"{where}.function",
            "it takes name, description, parameters and strict",
        )
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            _fail(
                f"{where}.function.name must be 1-64 letters, digits, '_', '.', ':' or '-', "
                f"got {name!r}"
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            _fail(f"{where}.function.description must be a string")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            _fail(f"{where}.function.parameters must be a JSON schema (an object)")
        if function.get("strict") not in (None, True, False):
            _fail(f"{where}.function.strict must be true or false")
        check_schema(parameters, f"{where}.function.parameters")
        if name in seen:  # a set: linear in the number of tools
            _fail(f"{where}.function.name {name!r} is given twice; tool names must differ")
        seen.add(name)
        out.append(FunctionTool(name, description, dict(parameters)))
    return tuple(out)


@attrs.frozen
class ToolChoice:
    """What ``tool_choice`` asks for: ``mode`` none, auto or required, or a named ``function``."""

    mode: str  # "none", "auto", "required" or "function"
    function: str | None = None


def parse_tool_choice(choice: Any, tools: Sequence[FunctionTool], *, default: str) -> ToolChoice:
    """``tool_choice`` checked against ``tools``; ``default`` applies when it is unset."""
    if choice is None:
        choice = default if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            _fail(
                f"tool_choice must be 'none', 'auto', 'required' or "
                f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}"
            )
        if choice != "none" and not tools:
            _fail(f"tool_choice {choice!r} needs tools; send the tools the model may call")
        return ToolChoice(choice)
    function = choice.get("function") if isinstance(choice, Mapping) else None
    if (
        not isinstance(choice, Mapping)
        or choice.get("type") != "function"
        or not isinstance(function, Mapping)
        or not isinstance(function.get("name"), str)
    ):
        _fail(
            "tool_choice must be 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}"
        )
    name = function["name"]
    if not any(t.name == name for t in tools):
        have = ", ".join(t.name for t in tools) or "none"
        _fail(f"tool_choice names the function {name!r}, which is not among the tools ({have})")
    return ToolChoice("function", name)


def tool_choice_constraint(choice: ToolChoice, tools: Sequence[FunctionTool]) -> dict[str, Any]:
    """The JSON schema the output follows for ``"required"`` or a named function.

    ``"required"``: an array of at least one ``{"name": <a tool's name>,
    "parameters": <its arguments>}`` object (one schema per tool, any of
    them); a named function: its parameters schema, the output being the
    arguments themselves.
    """
    if choice.mode == "function":
        return next(t.parameters for t in tools if t.name == choice.function)
    assert choice.mode == "required"
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "parameters": t.parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "minItems": 1, "items": item}


# ---------------------------------------------------------------------- views
@attrs.frozen
class CallView:
    """One tool call as far as a text shows it: the name, and the arguments' JSON text so far."""

    name: str
    arguments: str


@attrs.frozen
class ToolCallView:
    """What a text holds: content for the user and the tool calls found in it.

    A parser's view of a text that may still grow (``final=False``) must be a
    prefix of its view of any longer text: content only grows at its end, a
    call once shown keeps its name, and its arguments only grow at their end.
    """

    content: str = ""
    calls: tuple[CallView, ...] = ()


@attrs.frozen
class ToolCall:
    """A finished tool call in OpenAI's shape."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    """A fresh tool-call id (``chatcmpl-tool-...``, as vLLM spells them)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def finished_calls(view: ToolCallView) -> list[ToolCall]:
    """The calls of a final view with fresh ids."""
    return [ToolCall(new_call_id(), c.name, c.arguments) for c in view.calls]


class ToolCallStream:
    """OpenAI streaming deltas of a growing text, from a view function's successive views.

    ``view(text, final)`` is a parser's :meth:`~pitstop.plugin_system.protocols.ToolParser.parse`
    (or :func:`constrained_view`). :meth:`feed` takes each new piece of text
    and returns the delta to send (``{}`` when nothing is ready); :meth:`finish`
    the last one. Deltas are ``{"content": str}`` and/or ``{"tool_calls":
    [{"index", "id", "type", "function": {"name", "arguments"}}]}``: a call's
    first delta carries its id and name, later ones pieces of its arguments.
    """

    def __init__(self, view: Any) -> None:
        self._view = view
        self._text = ""
        self._content = 0  # characters of content sent
        self._calls: list[tuple[str, str, int]] = []  # (id, name, argument characters sent)

    @property
    def has_calls(self) -> bool:
        """Whether any tool call was sent."""
        return bool(self._calls)

    def feed(self, delta: str) -> dict[str, Any]:
        """The delta to send after ``delta`` arrived."""
        self._text += delta
        return self._diff(self._view(self._text, False))

    def finish(self, delta: str = "") -> dict[str, Any]:
        """The last delta, once the text is complete (``delta``: its last piece, if any)."""
        self._text += delta
        return self._diff(self._view(self._text, True))

    def _diff(self, view: ToolCallView) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if len(view.content) > self._content:
            out["content"] = view.content[self._content :]
            self._content = len(view.content)
        deltas = []
        for i, call in enumerate(view.calls):
            if i == len(self._calls):
                call_id = new_call_id()
                self._calls.append((call_id, call.name, len(call.arguments)))
                deltas.append(
                    {
                        "index": i,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
                continue
            call_id, name, sent = self._calls[i]
            if len(call.arguments) > sent:
                deltas.append({"index": i, "function": {"arguments": call.arguments[sent:]}})
                self._calls[i] = (call_id, name, len(call.arguments))
        if deltas:
            out["tool_calls"] = deltas
        return out


# ---------------------------------------------------------------------- scanning
@attrs.frozen
class ScannedObject:
    """One JSON object found by :func:`scan_objects`.

    ``values`` maps each top-level key to ``(start, end)`` of its value in
    the text (``end`` None while the value is not complete); ``end`` is the
    index after the closing brace, None while the object is open.
    """

    start: int
    values: dict[str, tuple[int, int | None]]
    end: int | None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string_end(text: str, i: int) -> int:
    """The index of the quote closing the string that opens at ``text[i]`` (``len(text)``
    while the text stops inside it)."""
    j = i + 1
    while j < len(text) and text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    return j


@attrs.define
class _ObjectScan:
    """The state of :func:`scan_object` as it walks one object's text."""

    text: str
    values: dict[str, tuple[int, int | None]] = attrs.field(factory=dict)
    depth: int = 1
    key: str | None = None  # the key whose value is being read
    value_start: int = 0
    expect_key: bool = True

    def end_value(self, end: int) -> None:
        """End the value being read at ``end``, unless it has ended already."""
        if self.key is not None and self.values[self.key][1] is None:
            self.values[self.key] = (self.value_start, end)

    def start_key(self, i: int, j: int, colon: int) -> int:
        """Record the top-level key ``text[i..j]`` (a colon at ``colon`` follows it); return
        where its value starts."""
        text = self.text
        try:
            key = json.loads(text[i : j + 1])
        except json.JSONDecodeError:
            key = text[i + 1 : j]
        self.value_start = _skip_ws(text, colon + 1)
        if key in self.values:
            self.key = None  # a repeated key: the first one stands
        else:
            self.key = key
            self.values[key] = (self.value_start, None)
        self.expect_key = False
        return self.value_start

    def string(self, i: int) -> int | None:
        """Past the string at ``text[i]``: the next index to read, None when the text ends."""
        j = _string_end(self.text, i)
        if j >= len(self.text):
            return None  # an open string: the text stops inside it
        if self.depth == 1 and self.expect_key:
            k = _skip_ws(self.text, j + 1)
            if k >= len(self.text):
                return None  # the text stops before what follows the string
            if self.text[k] == ":":
                return self.start_key(i, j, k)
        if self.depth == 1:
            self.end_value(j + 1)  # a string value ends at its quote
        return j + 1

    def close(self, i: int) -> bool:
        """At a closing bracket ``text[i]``; True when it closes the object itself."""
        self.depth -= 1
        if self.depth == 1:
            self.end_value(i + 1)  # (a value ends once: junk after it is not it)
        if self.depth == 0:
            self.end_value(_rstrip_end(self.text, self.value_start, i))
            return True
        return False

    def comma(self, i: int) -> None:
        """At a top-level comma: the value ends, a key comes next."""
        self.end_value(_rstrip_end(self.text, self.value_start, i))
        self.key = None
        self.expect_key = True


def scan_object(text: str, start: int) -> ScannedObject:
    """Scan the JSON object that opens at ``text[start] == "{"``, as far as the text goes.

    Not a validator: it follows strings, escapes and nesting to find the
    top-level keys and the extent of their values; the values are parsed by
    whoever needs them.
    """
    assert text[start] == "{"
    scan = _ObjectScan(text)
    i: int | None = start + 1
    while i is not None and i < len(text):
        ch = text[i]
        if ch == '"':
            i = scan.string(i)
            continue
        if ch in "{[":
            scan.depth += 1
        elif ch in "}]":
            if scan.close(i):
                return ScannedObject(start, scan.values, i + 1)
        elif ch == "," and scan.depth == 1:
            scan.comma(i)
        i += 1
    return ScannedObject(start, scan.values, None)


def _rstrip_end(text: str, start: int, end: int) -> int:
    while end > start and text[end - 1] in " \t\r\n":
        end -= 1
    return end


def call_of(
    text: str, obj: ScannedObject, *, final: bool, argument_keys: Sequence[str]
) -> CallView | None:
    """The call an object describes (``{"name": ..., <argument key>: {...}}``), as far as known.

    None while its name is not complete (or is not a string). The arguments
    are the value's text as the model wrote it; while the value is open, the
    text so far (an object or array grows at its end; a scalar is held back
    until it is complete, unless ``final``).
    """
    name_span = obj.values.get("name")
    if name_span is None or name_span[1] is None:
        return None
    try:
        name = json.loads(text[name_span[0] : name_span[1]])
    except json.JSONDecodeError:
        return None
    if not isinstance(name, str):
        return None
    span = next((obj.values[k] for k in argument_keys if k in obj.values), None)
    if span is None:
        return CallView(name, "{}" if final or obj.end is not None else "")
    start, end = span
    if end is None:
        if start < len(text) and text[start] in "{[":
            end = len(text)
        elif final:
            end = _rstrip_end(text, start, len(text))
        else:
            end = start
    return CallView(name, text[start:end])


def scan_objects(text: str, start: int, separators: str) -> tuple[list[ScannedObject], int, bool]:
    """Consecutive JSON objects from ``start``, separated by any of ``separators`` (and
    whitespace): ``(objects, where scanning stopped, whether the text ran out)``.

    It stops at the end of the text (inside an object or not), or at the first
    character that neither opens an object nor separates two.
    """
    objects: list[ScannedObject] = []
    i = start
    while True:
        while i < len(text) and (text[i] in separators or text[i] in " \t\r\n"):
            i += 1
        if i >= len(text):
            return objects, i, True
        if text[i] != "{":
            return objects, i, False
        obj = scan_object(text, i)
        objects.append(obj)
        if obj.end is None:
            return objects, len(text), True
        i = obj.end


def constrained_view(choice: ToolChoice) -> Any:
    """The view function of an output constrained by :func:`tool_choice_constraint`."""
    if choice.mode == "function":
        name = choice.function
        assert name is not None

        def named(text: str, final: bool) -> ToolCallView:
            del final  # trailing blanks are held back until more text follows them
            return ToolCallView("", (CallView(name, text.strip()),))

        return named

    def required(text: str, final: bool) -> ToolCallView:
        i = _skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return ToolCallView(text if final else "")
        objects, _, _ = scan_objects(text, i + 1, ",")
        calls = []
        for obj in objects:
            call = call_of(text, obj, final=final, argument_keys=("parameters",))
            if call is None:
                break
            calls.append(call)
        return ToolCallView("", tuple(calls))

    return required


def default_tool_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """A system-prompt text that lists the tools, for templates that do not render them."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "These functions are available to you, described as JSON schemas:\n"
        f"{listed}\n"
        'To call one, answer with a JSON object {"name": <function name>, '
        '"parameters": <arguments object>}.'
    )
