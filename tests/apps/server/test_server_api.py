"""`pitstop serve` speaks the OpenAI API a vLLM user knows: n, logprobs, structured outputs, tokenize.

The official ``openai`` client against one ``pitstop serve smollm2-135m``
subprocess for the module. Every constraint test checks the answer with the
library a client would use (``json`` + ``jsonschema``, ``re``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers.models import smollm2_gguf
from helpers.server_process import serve_subprocess

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gib", "0.25"]
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    smollm2_gguf()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with serve_subprocess([MODEL, *ENGINE_FLAGS], env, start_timeout=180) as (_proc, base):
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def test_n_returns_n_choices(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert len({c.text for c in resp.choices}) > 1  # three samples, not one copied
    assert 3 <= resp.usage.completion_tokens <= 18  # every sample's tokens, at most 6 each
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], n=2, max_tokens=4
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_n_streams_every_choice(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, n=2, stream=True, seed=3
    )
    texts = {0: "", 1: ""}
    reasons = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert set(reasons) == {0, 1} and all(texts.values())


def test_top_logprobs_are_consistent(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for item in content:
        alts = item.top_logprobs
        assert len(alts) == 5
        values = [a.logprob for a in alts]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-4
        # greedy: the chosen token is the most likely one, with the same log-probability
        assert alts[0].token == item.token and abs(alts[0].logprob - item.logprob) < 1e-5
    legacy = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    )
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and abs(top[token] - value) < 1e-5


SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
        "required": ["ok", "score"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 99},
                    "y": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "required": ["point"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_response_format_json_schema_validates(client: openai.OpenAI, schema: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Answer with a JSON object."}],
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    text = resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_json_object_and_regex_and_choice(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": 'Reply with the JSON object {"answer": 4}.'}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(resp.choices[0].message.content), dict)
    pattern = r"[0-9]{3}-[0-9]{4}"
    text = (
        client.completions.create(
            model=MODEL,
            prompt="A phone number:",
            max_tokens=12,
            temperature=0.8,
            seed=1,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        .choices[0]
        .text
    )
    assert re.fullmatch(pattern, text), text
    text = (
        client.completions.create(
            model=MODEL,
            prompt="Is water wet?",
            max_tokens=5,
            extra_body={"guided_choice": ["yes", "no"]},
        )
        .choices[0]
        .text
    )
    assert text in ("yes", "no")


SQL_GBNF = """
    root ::= select_statement

    select_statement ::= "SELECT " column " from " table " where " condition

    column ::= "col_1 " | "col_2 "

    table ::= "table_1 " | "table_2 "

    condition ::= column "= " number

    number ::= "1 " | "2 "
"""


def test_gbnf_grammar_online_and_its_parse_errors(client: openai.OpenAI) -> None:
    """vLLM's documented GBNF grammar, through structured_outputs and guided_grammar."""
    messages = [{"role": "user", "content": "Generate an SQL query."}]
    for extra in ({"structured_outputs": {"grammar": SQL_GBNF}}, {"guided_grammar": SQL_GBNF}):
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=40, temperature=0, extra_body=extra
        )
        text = resp.choices[0].message.content
        assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", text)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=4,
            extra_body={"structured_outputs": {"grammar": 'root ::= "SELECT'}},
        )
    assert "not valid GBNF" in info.value.message and info.value.param == "structured_outputs"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_grammar": "start: a ="}
        )
    assert "read as Lark" in info.value.message and info.value.param == "guided_grammar"


def test_json_whitespace_options_online(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    }
    text = (
        client.completions.create(
            model=MODEL,
            prompt="JSON:",
            max_tokens=20,
            temperature=0,
            extra_body={"guided_json": schema, "guided_whitespace_pattern": "[ ]{2}"},
        )
        .choices[0]
        .text
    )
    assert re.fullmatch(r'\{  "a":  [0-9](  )?\}', text), text  # spaces where JSON allows them
    with pytest.raises(openai.BadRequestError, match="applies to JSON output only"):
        client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=4,
            extra_body={"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
        )


def test_prompt_logprobs_extension(url: str) -> None:
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 1,
        "prompt_logprobs": 2,
    }
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    ids = httpx.post(f"{url}/tokenize", json={"prompt": body["prompt"]}).json()["tokens"]
    prompt = choice["prompt_logprobs"]
    assert len(prompt) == len(ids) and prompt[0] is None
    for token, position in zip(ids[1:], prompt[1:], strict=True):
        assert str(token) in position and len(position) in (2, 3)  # top 2, plus the token


def test_unknown_field_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_body={"guided_whitespace": "x"}
        )
    assert info.value.body["param"] == "guided_whitespace"
    assert "unknown field" in info.value.body["message"]


def test_a_list_of_prompts_gets_a_choice_each(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt=["Hello", "The sky is"], max_tokens=3, temperature=0, n=2
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.choices[0].text == resp.choices[1].text  # greedy: both samples agree


def test_models_tokenize_detokenize_and_missing_endpoints(url: str, client: openai.OpenAI) -> None:
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    ids = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    text = httpx.post(f"{url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text.endswith("Hello world")
    r = httpx.post(f"{url}/v1/embeddings", json={"input": "hi", "model": MODEL})
    assert r.status_code == 404
    assert "no endpoint POST /v1/embeddings" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=MODEL, input="hi")


def test_metric_names_in_the_docs_are_the_ones_served(url: str) -> None:
    """Every ``pitstop:...`` name the docs mention is a series /metrics exports (a family
    written with a placeholder, ``pitstop:allocator_<name>_total``, depends on the allocator
    chosen and is not one name: tests/apps/server/test_server_tiered.py reads the tier's)."""
    text = httpx.get(f"{url}/metrics").text
    samples = {
        re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line[:1] not in "#"
    }
    histograms = {
        line.split()[2]
        for line in text.splitlines()
        if line.startswith("# TYPE") and "histogram" in line
    }
    docs = Path(__file__).resolve().parents[3] / "docs"
    named = {
        (page.name, name)
        for page in docs.glob("*.md")
        for name in re.findall(r"pitstop:[a-z0-9_]*[a-z0-9](?![a-z0-9_<])", page.read_text())
    }
    assert named, "no metric names found in docs/"
    unknown = sorted((page, n) for page, n in named if n not in samples | histograms)
    assert not unknown, f"docs name metrics that /metrics does not export: {unknown}"


def test_tools_without_auto_tool_choice(client: openai.OpenAI) -> None:
    """This server has no --enable-auto-tool-choice: tools default to "none", "auto" is a 400."""
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Say hi"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=4)
    assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, tool_choice="auto", max_tokens=4
        )
    assert (
        "--enable-auto-tool-choice" in info.value.message
        and "--tool-call-parser" in info.value.message
    )
    named = {"type": "function", "function": {"name": "ping"}}
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice=named, max_tokens=20
    )
    assert resp.choices[0].message.tool_calls[0].function.name == "ping"
