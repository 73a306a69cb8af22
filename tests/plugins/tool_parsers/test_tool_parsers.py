"""Tool-call parsers (``hermes``, ``llama3_json``) and the constrained formats of
``tool_choice``: what they read, and that streaming, split anywhere, gives what a
whole text gives (the view of a growing text is always a prefix of the next)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pitstop.entrypoints.tool_calls import (
    ToolCallStream,
    ToolChoice,
    constrained_view,
    parse_tool_choice,
    parse_tools,
    tool_choice_constraint,
)
from pitstop.errors import InvalidRequestError
from pitstop.plugin_system.plugin_manager import PluginManager

PM = PluginManager()
HERMES = PM.create("tool_parser", "hermes", None)
LLAMA = PM.create("tool_parser", "llama3_json", None)


def streamed(view: Any, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call, from the deltas of ``pieces`` fed in turn."""
    stream = ToolCallStream(view)
    content = ""
    calls: dict[int, list[str]] = {}
    for delta in [stream.feed(p) for p in pieces] + [stream.finish()]:
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                assert d["id"].startswith("chatcmpl-tool-")
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"]["arguments"]
    return content, [(n, a) for n, a in calls.values()]


def whole(view: Any, text: str) -> tuple[str, list[tuple[str, str]]]:
    final = view(text, True)
    return final.content, [(c.name, c.arguments) for c in final.calls]


def every_character(text: str) -> list[str]:
    return list(text)


def test_hermes_reads_calls_and_content() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
        "</tool_call>\n<tool_call>"
        '{"arguments": {"q": "a}b\\"c"}, "name": "search"}</tool_call>\n'
    )
    content, calls = whole(HERMES.parse, text)
    assert content == "Let me check."
    assert calls == [
        ("get_weather", '{"city": "Paris", "days": [1, 2]}'),
        ("search", '{"q": "a}b\\"c"}'),
    ]
    assert streamed(HERMES.parse, every_character(text)) == (content, calls)
    plain = "No tools needed. <tool_ is not a tag "
    assert whole(HERMES.parse, plain) == (plain, [])
    assert streamed(HERMES.parse, every_character(plain)) == (plain, [])
    assert whole(HERMES.parse, "<tool_call>oops</tool_call>") == ("<tool_call>oops</tool_call>", [])
    # junk after a value is not part of it: the name shown first stays the name
    junk = '<tool_call>{"name": "f" "g", "arguments": {"a": 1} {"b": 2}}</tool_call>'
    assert whole(HERMES.parse, junk) == ("", [("f", '{"a": 1}')])
    assert streamed(HERMES.parse, every_character(junk)) == whole(HERMES.parse, junk)
    twice = '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>'
    assert whole(HERMES.parse, twice) == ("", [("f", "{}")])
    assert streamed(HERMES.parse, every_character(twice)) == whole(HERMES.parse, twice)
    # cut short (max_tokens): the call so far
    assert whole(HERMES.parse, '<tool_call>{"name": "f", "arguments": {"a": 1')[1] == [
        ("f", '{"a": 1')
    ]


def test_llama3_json_reads_calls_and_content() -> None:
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "neg", "arguments": {"x": -3.5}}'
    content, calls = whole(LLAMA.parse, text)
    assert content == "" and calls == [("add", '{"a": 1, "b": 2}'), ("neg", '{"x": -3.5}')]
    assert streamed(LLAMA.parse, every_character(text)) == (content, calls)
    for plain in ("The answer is 4.", '{"answer": 4}', "  <|py"):
        assert whole(LLAMA.parse, plain) == (plain, [])
        assert streamed(LLAMA.parse, every_character(plain)) == (plain, [])
    assert whole(LLAMA.parse, '{"name": "f"}') == ("", [("f", "{}")])


def test_the_constrained_formats() -> None:
    tools = parse_tools(
        [
            {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "neg"}},
        ]
    )
    required = ToolChoice("required")
    schema = tool_choice_constraint(required, tools)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [s["properties"]["name"] for s in schema["items"]["anyOf"]] == [
        {"const": "add"},
        {"const": "neg"},
    ]
    text = '[{"name": "add", "parameters": {"a": 1}}, {"name": "neg", "parameters": {}}]'
    view = constrained_view(required)
    assert whole(view, text) == ("", [("add", '{"a": 1}'), ("neg", "{}")])
    assert streamed(view, every_character(text)) == whole(view, text)
    named = constrained_view(ToolChoice("function", "add"))
    assert whole(named, ' {"a": 1} ') == ("", [("add", '{"a": 1}')])
    assert streamed(named, every_character(' {"a": 1} ')) == ("", [("add", '{"a": 1}')])
    assert tool_choice_constraint(ToolChoice("function", "add"), tools) == {"type": "object"}


def test_tools_and_tool_choice_are_checked_where_they_enter() -> None:
    tools = parse_tools([{"type": "function", "function": {"name": "f"}}])
    for bad, fragment in (
        ([{"type": "code_interpreter"}], "function tools"),
        ([{"type": "function", "function": {"name": "a b"}}], "letters, digits"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON schema"),
        ([{"type": "function", "function": {"name": "f", "extra": 1}}], "unknown key 'extra'"),
        ([{"type": "function", "function": {"name": "f"}}] * 2, "given twice"),
    ):
        with pytest.raises(InvalidRequestError, match=fragment):
            parse_tools(bad)
    assert parse_tool_choice(None, tools, default="auto") == ToolChoice("auto")
    assert parse_tool_choice(None, (), default="auto") == ToolChoice("none")
    named = {"type": "function", "function": {"name": "f"}}
    assert parse_tool_choice(named, tools, default="none") == ToolChoice("function", "f")
    for bad, fragment in (
        ("sometimes", "tool_choice must be"),
        ({"type": "function", "function": {"name": "g"}}, "not among the tools"),
    ):
        with pytest.raises(InvalidRequestError, match=fragment):
            parse_tool_choice(bad, tools, default="none")
    with pytest.raises(InvalidRequestError, match="needs tools"):
        parse_tool_choice("required", (), default="none")


# ------------------------------------------------------------------ properties
NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)
CONTENT = st.text(alphabet=st.characters(blacklist_characters="<"), max_size=20)


def _splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@settings(max_examples=150, deadline=None)
@given(
    before=CONTENT,
    calls=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3),
    indent=st.sampled_from([None, 2]),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_hermes_round_trip_split_anywhere(
    before: str, calls: list[tuple[str, dict]], indent: int | None, cuts: list[int]
) -> None:
    blocks = "".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, indent=indent)}\n</tool_call>\n"
        for n, a in calls
    )
    text = before + blocks
    content, found = whole(HERMES.parse, text)
    assert content == before.rstrip()
    assert [(n, json.loads(a)) for n, a in found] == calls
    assert streamed(HERMES.parse, _splits(text, cuts)) == (content, found)
    assert streamed(HERMES.parse, every_character(text)) == (content, found)


@settings(max_examples=150, deadline=None)
@given(
    calls=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3),
    tag=st.booleans(),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_llama3_json_round_trip_split_anywhere(
    calls: list[tuple[str, dict]], tag: bool, cuts: list[int]
) -> None:
    text = ("<|python_tag|>" if tag else "") + "; ".join(
        json.dumps({"name": n, "parameters": a}) for n, a in calls
    )
    content, found = whole(LLAMA.parse, text)
    assert content == "" and [(n, json.loads(a)) for n, a in found] == calls
    assert streamed(LLAMA.parse, _splits(text, cuts)) == (content, found)
    assert streamed(LLAMA.parse, every_character(text)) == (content, found)


PIECES = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<tool",
        "{",
        "}",
        "[",
        "]",
        '"name"',
        ":",
        '"f"',
        ",",
        '"arguments"',
        '"parameters"',
        " ",
        "\n",
        "x",
        ";",
        "<|python_tag|>",
        '\\"',
        "1",
    ]
)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(PIECES, max_size=30), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_any_text_streams_to_what_the_whole_text_gives(parts: list[str], cuts: list[int]) -> None:
    """Whatever a model writes, well-formed or not: streamed == whole (no delta to take back)."""
    text = "".join(parts)
    for view in (
        HERMES.parse,
        LLAMA.parse,
        constrained_view(ToolChoice("required")),
        constrained_view(ToolChoice("function", "f")),
    ):
        assert streamed(view, every_character(text)) == whole(view, text), view
        assert streamed(view, _splits(text, cuts)) == whole(view, text), view


def test_serve_flags_name_the_parser_and_its_partner() -> None:
    import argparse

    from pitstop.errors import ConfigError, PluginError
    from pitstop.server.cli import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match="needs --tool-call-parser NAME"):
        settings_from_args(parser.parse_args(["m", "--enable-auto-tool-choice"]))
    with pytest.raises(PluginError, match="hermes, llama3_json"):
        settings_from_args(parser.parse_args(["m", "--tool-call-parser", "mistral"]))
    args = parser.parse_args(["m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    settings = settings_from_args(args)
    assert settings.enable_auto_tool_choice and settings.tool_call_parser == "hermes"
