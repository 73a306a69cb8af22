"""`pitstop serve`: the official ``openai`` client against a real server process running SmolLM2.

One server subprocess serves the whole module (started once, waited for on
``/health``); its last test sends it SIGTERM mid-stream. Authentication off
is checked in-process on a tiny checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers.models import make_tiny_checkpoint, smollm2_gguf
from helpers.server_process import serve_subprocess
from prometheus_client.parser import text_string_to_metric_families

from pitstop import LLM, SamplingParams

API_KEY = "sk-test-pitstop"
MAX_BODY = 64 * 1024
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gib", "0.25"]
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]
DRAIN = 2.0  # --drain-timeout of the module's server
STEP_GRACE = 2.0  # ServerSettings.step_grace_s: how long the engine may take to abort


class Server:
    """A running ``pitstop serve`` subprocess."""

    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc = proc
        self.url = url
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
        )

    def health(self) -> dict:
        return self.http.get("/health").json()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by name and labels (without model_name)."""
        text = self.http.get("/metrics").text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name"
                )
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_all_pages_free(self, within: float) -> float:
        t0 = time.monotonic()
        while True:
            h = self.health()
            if (
                h["pages_free"] == h["num_pages"]
                and h["num_running"] == 0
                and h["num_waiting"] == 0
            ):
                return time.monotonic() - t0
            if time.monotonic() - t0 > within:
                raise AssertionError(f"pages not all free after {within} s: {h}")
            time.sleep(0.02)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    smollm2_gguf()
    env = {**os.environ, "PITSTOP_API_KEY": API_KEY, "TOKENIZERS_PARALLELISM": "false"}
    args = ["smollm2-135m", *ENGINE_FLAGS, "--max-body-bytes", str(MAX_BODY)]
    args += ["--drain-timeout", str(DRAIN)]
    args += ["--trust-request-chat-template"]  # test_chat_options_match_llm_chat sends templates
    with serve_subprocess(args, env, start_timeout=180) as (proc, url):
        srv = Server(proc, url)
        try:
            yield srv
        finally:
            srv.http.close()


@pytest.fixture(scope="module")
def offline() -> LLM:
    smollm2_gguf()
    return LLM("smollm2-135m", device="cpu", dtype="float32", kv_cache_gib=0.25)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


# ---------------------------------------------------------------------- the happy paths
def test_models_and_health(server: Server, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["smollm2-135m"]
    h = server.health()
    assert h["status"] == "ok" and h["pages_free"] == h["num_pages"] > 0


def test_completion_matches_generate(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
    )[0]
    resp = client.completions.create(
        model="smollm2-135m", prompt=PROMPT, max_tokens=24, temperature=0
    )
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.token_ids)

    chunks = list(
        client.completions.create(
            model="smollm2-135m",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_matches_llm_chat(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    resp = client.chat.completions.create(
        model="smollm2-135m", messages=CHAT, max_tokens=24, temperature=0
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)

    stream = client.chat.completions.create(
        model="smollm2-135m", messages=CHAT, max_tokens=24, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant ({{ mood | default('calm') }}):{% endif %}"
)


def test_chat_options_match_llm_chat(client: openai.OpenAI, offline: LLM) -> None:
    """The server takes LLM.chat's options, and LLM.chat the server's content parts: one
    rendering (pitstop.entrypoints.chat) behind both, so the answers are the same."""
    greedy = SamplingParams(temperature=0, max_tokens=8)
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is 2 + 2?"},
                {"type": "text", "text": " Answer briefly."},
            ],
        }
    ]
    cont = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    cases = [
        (parts, {}, {}),
        (cont, {"add_generation_prompt": False, "continue_final_message": True}, {}),
        (CHAT, {"chat_template": TOOLS_TEMPLATE, "chat_template_kwargs": {"mood": "terse"}}, {}),
        (CHAT, {"chat_template": TOOLS_TEMPLATE}, {"tools": tools, "tool_choice": "none"}),
    ]
    for messages, options, tool_fields in cases:
        expected = offline.chat(
            messages, greedy, use_tqdm=False, **options, **({"tools": tools} if tool_fields else {})
        )[0]
        assert (
            expected.prompt is not None
            and offline.get_tokenizer().encode(expected.prompt, add_special_tokens=False)[-3:]
            == expected.prompt_token_ids[-3:]
        )
        resp = client.chat.completions.create(
            model="smollm2-135m",
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_body=options or None,
            **tool_fields,
        )
        assert resp.choices[0].message.content == expected.text, options
        assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    rendered = offline.chat(CHAT, greedy, chat_template=TOOLS_TEMPLATE, tools=tools)[0].prompt
    assert rendered.startswith("TOOLS: add") and rendered.endswith("assistant (calm):")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="smollm2-135m",
            messages=CHAT,
            max_tokens=4,
            extra_body={"continue_final_message": True},
        )
    assert "add_generation_prompt" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="smollm2-135m",
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
            max_tokens=4,
        )
    assert "'image_url'" in info.value.message and info.value.param == "messages"


def test_stop_and_sampling_options(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model="smollm2-135m", prompt=PROMPT, max_tokens=24, temperature=0, stop=["."]
    )
    assert "." not in resp.choices[0].text and resp.choices[0].finish_reason == "stop"
    kwargs = dict(
        model="smollm2-135m", prompt=PROMPT, max_tokens=8, temperature=0.9, top_p=0.9, seed=1234
    )
    extra = {"top_k": 50, "min_p": 0.05}
    a = client.completions.create(**kwargs, extra_body=extra).choices[0].text
    b = client.completions.create(**kwargs, extra_body=extra).choices[0].text
    assert a == b  # a seed makes sampling repeatable


def test_64_concurrent_streams_and_metrics(server: Server) -> None:
    server.wait_all_pages_free(within=60)  # nothing of an earlier test still running
    before = server.metrics()
    n, max_tokens = 64, 8

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, object]:
        stream = await aclient.completions.create(
            model="smollm2-135m",
            prompt=f"Request {i}: count from {i} upwards:",
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, reason, use = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage is not None:
                use = chunk.usage
        return text, reason, use

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=170
        ) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(n)))

    results = asyncio.run(main())
    assert all(reason == "length" for _, reason, _ in results)
    assert all(u.completion_tokens == max_tokens for _, _, u in results)
    assert all(text for text, _, _ in results)
    prompt_tokens = sum(u.prompt_tokens for _, _, u in results)

    server.wait_all_pages_free(within=5)
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("pitstop:request_success_total{finished_reason=length}") == n
    assert delta("pitstop:generation_tokens_total") == n * max_tokens
    assert delta("pitstop:prompt_tokens_total") == prompt_tokens
    assert delta("pitstop:time_to_first_token_seconds_count") == n
    assert delta("pitstop:e2e_request_latency_seconds_count") == n
    assert delta("pitstop:time_per_output_token_seconds_count") == n
    assert delta("pitstop:inter_token_latency_seconds_count") == n * (max_tokens - 1)
    assert after["pitstop:num_requests_running"] == 0
    assert after["pitstop:kv_cache_usage_perc"] == 0
    for name in (
        "pitstop:prefix_cache_queries_total",
        "pitstop:prefix_cache_hits_total",
        "pitstop:num_preemptions_total",
        "pitstop:spec_decode_num_draft_tokens_total",
        "pitstop:spec_decode_num_accepted_tokens_total",
    ):
        assert name in after


def test_disconnect_mid_stream_frees_pages(server: Server) -> None:
    body = {
        "model": "smollm2-135m",
        "prompt": PROMPT,
        "max_tokens": 2000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[len("data:") :]))
                if len(events) >= 3:
                    break
            # unfinished when the client leaves: three tokens of 2,000, none with a finish
            # reason (read from the stream itself: /health's snapshot, read here before,
            # once said num_running 0 on a loaded CI machine)
            assert [e["choices"][0]["finish_reason"] for e in events] == [None] * 3, events
    # the stream is closed: the request is aborted and its pages come back
    assert server.wait_all_pages_free(within=1.0) <= 1.0

    # a non-streamed request whose client gives up is aborted too
    body = {**body, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=httpx.Timeout(30, read=1.0),
        )
    assert server.wait_all_pages_free(within=1.5) <= 1.5


# ---------------------------------------------------------------------- errors
def test_auth_required_on_v1_routes(server: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -3}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"²": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"①": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {" 5": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"٣": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"𝟓": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n"),  # the server's --max-n cap
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": ["hi"] * 65}, 400, "prompt"),  # --max-prompts-per-request
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (
        "/v1/completions",
        {"prompt": "hi", "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    (
        "/v1/completions",
        {
            "prompt": "hi",
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}},
        },
        400,
        "response_format",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "structured_outputs": {"regex": "[a-"}},
        400,
        "structured_outputs",
    ),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": [1] * 5000}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "model": "SmolLM2-135M"}, 404, "model"),  # exact
    ("/v1/completions", {"prompt": "hi", "model": " smollm2-135m"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "model": ""}, 400, "model"),
    ("/v1/completions", {"prompt": "hi", "model": None}, 400, "model"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "model": None},
        400,
        "model",
    ),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 300}, 400, "n"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        400,
        "tools",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi " * 5000}]},
        400,
        "messages",
    ),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD_REQUESTS)
def test_invalid_parameters_are_4xx(
    server: Server, route: str, body: dict, status: int, param: str
) -> None:
    r = server.http.post(route, json={"model": "smollm2-135m", **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert set(error) == {"message", "type", "param", "code"}


def test_malformed_and_oversize_bodies(server: Server, client: openai.OpenAI) -> None:
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = server.http.post(
            "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400, r.text
    big = json.dumps({"prompt": "x" * (MAX_BODY + 10)}).encode()
    r = server.http.post(
        "/v1/completions", content=big, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert server.http.get("/v1/nothing-here").status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2-135m", prompt="hi", max_tokens=4, temperature=-1)
    # and the server keeps answering
    resp = client.completions.create(
        model="smollm2-135m", prompt=PROMPT, max_tokens=4, temperature=0
    )
    assert resp.usage.completion_tokens >= 1
    server.wait_all_pages_free(within=2)


def test_auth_off_in_process(tmp_path: Path) -> None:
    from pitstop.config import EngineConfig
    from pitstop.entrypoints.async_engine import AsyncLLM
    from pitstop.loop.engine import LLMEngine
    from pitstop.server.app import ServerSettings, create_app

    folder = make_tiny_checkpoint(tmp_path, "llama")
    config = EngineConfig(
        model=str(folder), device="cpu", dtype="float32", kv_cache_gib=0.02, max_model_len=128
    )
    llm = AsyncLLM(LLMEngine(config))

    async def main() -> None:
        transport = httpx.ASGITransport(
            app=create_app(llm, ServerSettings(served_model_name="tiny"))
        )
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            r = await c.get("/v1/models")
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
            r = await c.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1

    try:
        asyncio.run(main())
    finally:
        llm.close()


def test_huge_seed_beside_three_normal_streams(server: Server) -> None:
    """Issue 22: seed=2**70 used to fail the shared step and every request in it; seeds are
    int64 now (issue 32), so the largest one runs beside three normal streams."""

    async def one(aclient: openai.AsyncOpenAI, extra: dict) -> str | None:
        stream = await aclient.completions.create(
            model="smollm2-135m",
            prompt=PROMPT,
            max_tokens=12,
            stream=True,
            extra_body={"ignore_eos": True},
            **extra,
        )
        reason = None
        async for chunk in stream:
            if chunk.choices:
                reason = chunk.choices[0].finish_reason or reason
        return reason

    async def main() -> list[str | None]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120
        ) as aclient:
            normal = [one(aclient, {"temperature": 0}) for _ in range(3)]
            return await asyncio.gather(
                one(aclient, {"seed": 2**63 - 1, "temperature": 1.0}), *normal
            )

    assert asyncio.run(main()) == ["length"] * 4
    server.wait_all_pages_free(within=2)


def _stream_lines(server: Server, body: dict, out: list[str], started: threading.Event) -> None:
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            started.set()
            out.extend(line for line in r.iter_lines() if line)


def _finish_reason(lines: list[str]) -> str | None:
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines if x != "data: [DONE]"]
    return next(
        (c["choices"][0]["finish_reason"] for c in reversed(chunks) if c.get("choices")), None
    )


# ---------------------------------------------------------------------- last: shutdown
def test_sigterm_drains_then_ends_every_request(server: Server) -> None:
    """SIGTERM during a long prefill: /health says draining, every stream ends with a finish
    reason and [DONE], a waiting non-streamed client gets a JSON error, exit 0 in time."""
    body = {
        "model": "smollm2-135m",
        "prompt": PROMPT,
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
    }
    long_prompt = {**body, "prompt": [504] * 1500}  # a long prefill
    streams: list[list[str]] = [[] for _ in range(3)]
    started = [threading.Event() for _ in streams]
    threads = [
        threading.Thread(target=_stream_lines, args=(server, b, out, ev), daemon=True)
        for b, out, ev in zip((body, body, long_prompt), streams, started, strict=True)
    ]
    plain: list[httpx.Response] = []
    threads.append(
        threading.Thread(
            target=lambda: plain.append(server.http.post("/v1/completions", json=body)),
            daemon=True,
        )
    )
    for t in threads:
        t.start()
    for ev in started:
        assert ev.wait(30)
    time.sleep(0.3)  # the long prompt's prefill is running
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    seen_draining = False
    with httpx.Client(base_url=server.url, timeout=2) as probe:
        while time.monotonic() - t0 < DRAIN - 0.5 and not seen_draining:
            try:
                r = probe.get("/health")
                seen_draining = r.status_code == 503 and r.json()["status"] == "draining"
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    assert seen_draining, "/health never answered 503 draining during the drain"
    code = server.proc.wait(DRAIN + STEP_GRACE + 8)
    took = time.monotonic() - t0
    assert code == 0
    # the documented bound (docs/server.md): the drain, the step grace, then an exit without
    # the interpreter's teardown; 1 s for a busy 2-core machine to deliver and reap
    assert took < DRAIN + STEP_GRACE + 1.0, f"exited {took:.1f} s after SIGTERM"
    for t in threads:
        t.join(5)
    for lines in streams:
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]
        assert _finish_reason(lines) in ("length", "stop"), lines[-3:]
    assert plain and plain[0].status_code == 503, plain
    assert plain[0].json()["error"]["code"] == "shutting_down"


def test_second_signal_ends_the_drain_at_once() -> None:
    smollm2_gguf()
    env = {**os.environ, "PITSTOP_API_KEY": API_KEY, "TOKENIZERS_PARALLELISM": "false"}
    args = ["smollm2-135m", *ENGINE_FLAGS, "--drain-timeout", "120"]
    with serve_subprocess(args, env, start_timeout=180) as (proc, url):
        srv = Server(proc, url)
        body = {
            "model": "smollm2-135m",
            "prompt": PROMPT,
            "max_tokens": 2000,
            "temperature": 0,
            "ignore_eos": True,
        }
        streams: list[list[str]] = [[], []]
        started = [threading.Event(), threading.Event()]
        threads = [
            threading.Thread(target=_stream_lines, args=(srv, body, out, ev), daemon=True)
            for out, ev in zip(streams, started, strict=True)
        ]
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert srv.http.get("/health").status_code == 503
        assert proc.poll() is None, "the first signal must drain, not exit"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
        took = time.monotonic() - t0
        srv.http.close()
    for t in threads:
        t.join(5)
    assert took < STEP_GRACE + 1.0, f"exited {took:.1f} s after the second signal"
    for lines in streams:
        assert lines[-1] == "data: [DONE]" and _finish_reason(lines) == "length", lines[-3:]
        # cut short: after the OpenAI finish reason, an error event says why
        assert '"code":"shutting_down"' in lines[-2], lines[-3:]
