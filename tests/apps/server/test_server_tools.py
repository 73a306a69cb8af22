"""Tool calling through the official ``openai`` client against ``pitstop serve``.

One server for the module, started with ``--enable-auto-tool-choice
--tool-call-parser hermes``. ``"required"`` and a named function are
constrained to JSON, so even SmolLM2-135M calls tools reliably; ``"auto"``
is read by the parser from the text, here made to take the Hermes format
with a regex constraint (a 135M model does not write tool calls by itself).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import httpx
import openai
import pytest
from helpers.models import smollm2_gguf
from helpers.server_process import serve_subprocess

pytest.importorskip("llguidance")

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gib", "0.25"]
MODEL = "smollm2-135m"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The Hermes format, forced: what a model trained for it writes.
HERMES_CALL = (
    r'I will look\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    smollm2_gguf()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with serve_subprocess([MODEL, *ENGINE_FLAGS, *flags], env, start_timeout=180) as (_p, base):
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _check_arguments(name: str, arguments: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), schema)


def test_required_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.role == "assistant"
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in calls)
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        _check_arguments(call.function.name, call.function.arguments)
    single = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0.8,
        seed=1,
    )
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_named_function_is_called(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0
    )
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    _check_arguments("get_weather", call.function.arguments)
    assert resp.choices[0].finish_reason == "stop"  # as OpenAI answers a forced function


def test_none_answers_in_text(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls


def _accumulate(stream: openai.Stream) -> tuple[str, dict[int, dict[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls and d.type == "function"
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_auto_is_read_by_the_hermes_parser_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        extra_body={"structured_outputs": {"regex": HERMES_CALL}},
    )
    resp = client.chat.completions.create(**kwargs)  # tool_choice defaults to "auto"
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] == "celsius"
    content, calls, finish = _accumulate(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == "I will look."
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (call.function.name, call.function.arguments)
    ]


def test_required_streams_tool_call_deltas(client: openai.OpenAI, url: str) -> None:
    kwargs = dict(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    content, calls, finish = _accumulate(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    # the raw chunks: the first delta of a call names it, later ones carry argument pieces
    body = {**kwargs, "stream": True, "tools": TOOLS}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        events = [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: {") and '"tool_calls"' in line
        ]
    pieces = [d for e in events for c in e["choices"] for d in c["delta"].get("tool_calls", [])]
    assert pieces[0]["function"]["name"] == whole[0].function.name and "id" in pieces[0]
    assert len(pieces) > 2 and all("name" not in p["function"] for p in pieces[1:] if "id" not in p)


def test_a_conversation_with_tool_results(client: openai.OpenAI) -> None:
    """The assistant's earlier call and the tool's answer go back through the template."""
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert resp.choices[0].message.content


def test_bad_tool_requests_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    for kwargs, param, fragment in (
        ({"tools": [{"type": "retrieval"}]}, "tools", "function tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "not among the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "both constrain the output",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kwargs)
        assert info.value.param == param and fragment in info.value.message, info.value.message
