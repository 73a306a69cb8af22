"""Issue 22's server side: strict input, Host/Origin checks, limits, drain, failure counters.

A real uvicorn server (the same ``build_server`` as ``pitstop serve``) runs
in a thread of this process on a tiny random checkpoint, so that every
check below the app (read timeout, connection cap) is exercised over real
sockets without the cost of a subprocess. Tests that need a slow engine
stall its step on an event instead of running a large model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.models import SMOLLM2_VOCAB, make_tiny_checkpoint
from helpers.server_process import free_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from pitstop.entrypoints.async_engine import AsyncLLM
from pitstop.entrypoints.engine_args import engine_config
from pitstop.loop.engine import LLMEngine
from pitstop.server.app import ServerSettings, create_app
from pitstop.server.cli import build_server
from pitstop.server.security import default_allowed_hosts, host_name

KEY_A, KEY_B = "sk-client-a", "sk-client-b"
ALLOWED_ORIGIN = "https://app.example"
READ_TIMEOUT = 1.0
MODEL = "tiny"  # the served name of every Live server


class Live:
    """A server running in a thread of this process."""

    def __init__(
        self, folder: Path, *, engine: dict[str, Any] | None = None, **overrides: Any
    ) -> None:
        config = engine_config(
            **{
                "model": str(folder),
                "device": "cpu",
                "dtype": "float32",
                "kv_cache_gib": 0.02,
                "max_model_len": 64,
                **(engine or {}),
            }
        )
        self.llm = AsyncLLM(LLMEngine(config))
        values: dict[str, Any] = dict(
            api_keys=(KEY_A, KEY_B),
            allowed_hosts=default_allowed_hosts("127.0.0.1"),
            allowed_origins=(ALLOWED_ORIGIN,),
            read_timeout_s=READ_TIMEOUT,
            max_connections=400,
            drain_timeout_s=0.5,
            step_grace_s=0.5,
            served_model_name=MODEL,
        )
        values.update(overrides)
        self.settings = ServerSettings(**values)
        self.app = create_app(self.llm, self.settings)
        self.state = self.app.state.server
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = build_server(self.app, self.settings, host="127.0.0.1", port=self.port)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30
        )

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for s in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name"
                )
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(15)
        self.llm.close()

    @contextlib.contextmanager
    def stalled(self, *, blocked: bool = True, delay: float = 0.0) -> Iterator[threading.Event]:
        """Engine steps wait while the yielded gate is clear (and take ``delay`` s each).

        Set the gate to let the engine go; it is set when the block ends.
        """
        gate = threading.Event()
        if not blocked:
            gate.set()
        engine = self.llm.engine
        step = engine.step

        def slow_step(*args: Any, **kwargs: Any) -> Any:
            time.sleep(delay)
            gate.wait(30)
            return step(*args, **kwargs)

        engine.step = slow_step  # type: ignore[method-assign]
        try:
            yield gate
        finally:
            gate.set()
            engine.step = step  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("safety"), "llama")


@pytest.fixture(scope="module")
def live(folder: Path) -> Iterator[Live]:
    srv = Live(folder)
    try:
        yield srv
    finally:
        srv.stop()


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0, **extra}


def sse_lines(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line]


def stream_events(client: httpx.Client, body: dict[str, Any], key: str = KEY_A) -> list[str]:
    with client.stream(
        "POST",
        "/v1/completions",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {key}"},
    ) as r:
        assert r.status_code == 200, r.read()
        return sse_lines(r)


def final_reason(lines: list[str]) -> str | None:
    """The finish_reason of the last choice chunk of an SSE answer."""
    reasons = [
        c["choices"][0]["finish_reason"]
        for c in (json.loads(x.removeprefix("data: ")) for x in lines if x != "data: [DONE]")
        if c.get("choices")
    ]
    return reasons[-1] if reasons else None


# ---------------------------------------------------------------------- point 5: web pages
def test_text_plain_and_untyped_posts_are_415(live: Live) -> None:
    body = json.dumps(completion()).encode()
    for headers in (
        {"Content-Type": "text/plain"},
        {"Content-Type": "application/x-www-form-urlencoded"},
        {},
    ):
        r = live.http.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 415, r.text
        assert r.json()["error"]["code"] == "unsupported_media_type"
    r = live.http.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json; charset=utf-8"}
    )
    assert r.status_code == 200, r.text


def test_a_foreign_origin_is_403_an_allowed_one_gets_cors(live: Live) -> None:
    r = live.http.post(
        "/v1/completions", json=completion(), headers={"Origin": "https://evil.example"}
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "--allowed-origins" in r.json()["error"]["message"]
    assert live.http.get("/metrics", headers={"Origin": "null"}).status_code == 403
    r = live.http.post("/v1/completions", json=completion(), headers={"Origin": ALLOWED_ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    pre = live.http.options(
        "/v1/completions",
        headers={
            "Origin": ALLOWED_ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert pre.status_code == 204 and "POST" in pre.headers["access-control-allow-methods"]


def test_host_check_stops_dns_rebinding(live: Live) -> None:
    r = live.http.get("/health", headers={"Host": f"evil.example:{live.port}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{live.port}", f"127.0.0.1:{live.port}", f"[::1]:{live.port}"):
        assert live.http.get("/health", headers={"Host": host}).status_code == 200, host
    assert host_name("[::1]:8000") == "::1" and host_name("LocalHost.:80") == "localhost"
    assert default_allowed_hosts("0.0.0.0") is None
    assert set(default_allowed_hosts("127.0.0.1") or ()) == {"localhost", "127.0.0.1", "::1"}


# ---------------------------------------------------------------------- point 6: auth headers
def test_malformed_authorization_is_401(live: Live) -> None:
    url = f"{live.url}/v1/models"
    for header in ("Bearer sk-\u00e9t\u00e9", "Basic abc", "Bearer", "sk-client-a", "Bearer x y"):
        r = httpx.get(url, headers={"Authorization": header.encode("utf-8")})
        assert r.status_code == 401, (header, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    raw = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xff\xfe\r\n\r\n"
    with socket.create_connection(("127.0.0.1", live.port)) as s:
        s.sendall(raw)
        assert s.recv(64).startswith(b"HTTP/1.1 401")
    for key in (KEY_A, KEY_B):
        assert httpx.get(url, headers={"Authorization": f"bearer {key}"}).status_code == 200


# ---------------------------------------------------------------------- point 9: nesting
def test_deep_nesting_is_400_and_the_connection_survives(live: Live) -> None:
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        for raw in (b"[" * 100_000, b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}"):
            r = c.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "json_too_deep"
        r = c.post("/v1/completions", json=completion())  # same keep-alive connection
        assert r.status_code == 200


# ---------------------------------------------------------------------- points 1, 10: values
BAD_BODIES: list[tuple[str, bytes | dict[str, Any], str | None]] = [
    ("/v1/completions", completion(temperature=True), "temperature"),
    ("/v1/completions", completion(temperature="hot"), "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', None),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e400}', None),
    ("/v1/completions", b'{"prompt": "hi", "top_p": -Infinity}', None),
    ("/v1/completions", completion(max_tokens=True), "max_tokens"),
    ("/v1/completions", completion(max_tokens=2**63), "max_tokens"),
    ("/v1/completions", completion(top_k=2**63), "top_k"),
    ("/v1/completions", completion(seed=True), "seed"),
    ("/v1/completions", completion(seed="7"), "seed"),
    ("/v1/completions", completion(stop=123), "stop"),
    ("/v1/completions", completion(stop_token_ids=["a"]), "stop_token_ids"),
    ("/v1/completions", completion(stop_token_ids=[True]), "stop_token_ids"),
    ("/v1/completions", completion(stop_token_ids=[2**70]), "stop_token_ids"),
    ("/v1/completions", completion(stop_token_ids=[-1]), "stop_token_ids"),
    ("/v1/completions", completion(stop_token_ids=[SMOLLM2_VOCAB]), "stop_token_ids"),
    ("/v1/completions", completion(ignore_eos=1), "ignore_eos"),
    ("/v1/completions", completion(stream="yes"), "stream"),
    ("/v1/completions", completion(n=True), "n"),
    ("/v1/completions", completion(prompt=[True, 5]), "prompt"),
    ("/v1/completions", completion(prompt=[2**70]), "prompt"),
    ("/v1/completions", b'{"prompt": "a \\ud800 b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udfff"]}', "stop"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5},
        "max_tokens",
    ),
]


# BAD_BODIES are posted by tests/apps/server/test_server_errors.py, which checks for each the 400, the
# field it names and OpenAI's error shape (one request per body, not one per file).


def test_a_prompt_that_encodes_to_nothing_is_400(live: Live) -> None:
    r = live.http.post("/v1/completions", json=completion(prompt="\x04"))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"


def test_huge_seed_and_top_k_run_beside_normal_requests(live: Live) -> None:
    """Values that used to raise inside the shared step run when they fit int64."""

    def one(body: dict[str, Any]) -> list[str]:
        with httpx.Client(base_url=live.url, timeout=30) as c:
            return stream_events(c, body)

    bodies = [
        completion(seed=2**63 - 1, temperature=1.0, max_tokens=8),
        completion(seed=-(2**63), temperature=1.0, max_tokens=8),
        completion(top_k=2**62, temperature=1.0, max_tokens=8),
        *[completion(max_tokens=8, ignore_eos=True) for _ in range(3)],
    ]
    results: list[list[str]] = [[] for _ in bodies]
    threads = [
        threading.Thread(target=lambda i=i, b=b: results.__setitem__(i, one(b)))
        for i, b in enumerate(bodies)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for lines in results:
        assert lines[-1] == "data: [DONE]" and final_reason(lines) in ("stop", "length"), lines
    # seeds are int64 (as vLLM takes them); a negative one repeats like any other
    a, b = (
        live.http.post("/v1/completions", json=completion(seed=-1, temperature=1.0, max_tokens=8))
        for _ in range(2)
    )
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    for seed in (2**63, -(2**63) - 1, 2**70):  # outside int64: 400, as vLLM answers
        r = live.http.post("/v1/completions", json=completion(seed=seed, max_tokens=2))
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


# ---------------------------------------------------------------------- point 7: limits
def test_slow_connections_do_not_hold_the_server(live: Live) -> None:
    heads = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"
    half_body = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer "
        + KEY_A.encode()
        + b"\r\nContent-Length: 500\r\n\r\n"
        + b'{"prompt": "'
    )
    socks = []
    for i in range(200):
        s = socket.create_connection(("127.0.0.1", live.port))
        s.sendall(heads if i % 2 else half_body)
        s.settimeout(READ_TIMEOUT + 5)
        socks.append(s)
    t0 = time.monotonic()
    r = live.http.post("/v1/completions", json=completion())  # served meanwhile
    assert r.status_code == 200
    try:
        for s in socks:
            answer = s.recv(4096)  # 408, then the server closes
            while chunk := s.recv(4096):
                answer += chunk
            assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:80]
        held = time.monotonic() - t0
    finally:
        for s in socks:
            s.close()
    assert held < READ_TIMEOUT + 3, f"slow connections held for {held:.1f} s"
    assert live.http.get("/health").status_code == 200


def test_connection_cap_is_429_with_retry_after(live: Live) -> None:
    limits = live.server.limits
    idle = []
    old = limits.max_connections
    try:
        limits.max_connections = len(limits.open) + 3
        idle = [socket.create_connection(("127.0.0.1", live.port)) for _ in range(3)]
        time.sleep(0.1)
        with httpx.Client(base_url=live.url) as c:
            r = c.get("/health")
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_connections"
    finally:
        limits.max_connections = old
        for s in idle:
            s.close()
    time.sleep(0.1)
    assert live.http.get("/health").status_code == 200


def _post_async(live: Live, bodies: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
            tasks = []
            for key, body in bodies:
                tasks.append(
                    asyncio.create_task(
                        c.post(
                            "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                        )
                    )
                )
                await asyncio.sleep(0.05)  # in this order
            return await asyncio.gather(*tasks)

    return asyncio.run(main())


def test_queue_cap_is_429(live: Live) -> None:
    state = live.state
    old = state.max_queued_requests
    state.max_queued_requests = 2
    try:
        with live.stalled() as release:
            threading.Timer(1.0, release.set).start()
            results = _post_async(live, [(KEY_A, completion()) for _ in range(5)])
    finally:
        state.max_queued_requests = old
    codes = [r.status_code for r in results]
    assert 429 in codes and codes.count(200) >= 2, codes
    refused = results[codes.index(429)]
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "too_many_requests"


def test_per_client_cap_leaves_room_for_others(live: Live) -> None:
    state = live.state
    state.max_requests_per_client = 1
    try:
        with live.stalled() as release:
            threading.Timer(1.0, release.set).start()
            results = _post_async(
                live, [(KEY_A, completion()), (KEY_A, completion()), (KEY_B, completion())]
            )
    finally:
        state.max_requests_per_client = None
    assert [r.status_code for r in results] == [200, 429, 200], [r.text for r in results]
    assert results[1].json()["error"]["code"] == "too_many_requests_per_client"
    assert not state.flights and not state.per_client


# ---------------------------------------------------------------------- point 8: counters
def test_step_failures_and_request_failures_are_counted(live: Live) -> None:
    before = live.metrics()
    engine = live.llm.engine
    step = engine.step
    failed = threading.Event()

    def failing_step(*args: Any, **kwargs: Any) -> Any:
        if not failed.is_set():
            failed.set()
            raise RuntimeError("boom")
        return step(*args, **kwargs)

    engine.step = failing_step  # type: ignore[method-assign]
    try:
        r = live.http.post("/v1/completions", json=completion())
    finally:
        engine.step = step  # type: ignore[method-assign]
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
    live.http.post("/v1/completions", json=completion(temperature=-1))  # one invalid request
    after = live.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("pitstop:step_failures_total") == 1
    assert delta("pitstop:request_failures_total{reason=step_failure}") == 1
    assert delta("pitstop:request_failures_total{reason=invalid_request}") == 1
    assert delta("pitstop:request_failures_total{reason=shutdown}") == 0
    for reason in ("unauthorized", "timeout", "rate_limited", "shutdown", "request_error"):
        assert f"pitstop:request_failures_total{{reason={reason}}}" in after
    # and the engine serves on
    assert live.http.post("/v1/completions", json=completion()).status_code == 200


# ---------------------------------------------------------------------- the fuzz
# Mostly valid bodies with zero to two fields replaced by anything JSON can say, so
# that about half the requests run (beside the victim) and the rest probe the checks.
# Any character: a prompt that encodes to no tokens (SmolLM2 drops some control characters)
# is refused where it enters (test_a_prompt_that_encodes_to_nothing_is_400).
_text = st.characters()
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(_text, max_size=12),
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_VALID = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.sampled_from([-1, 0, 1, 5, 2**62]),
    "min_p": st.floats(0, 1),
    "seed": st.one_of(st.none(), st.integers(-(2**80), 2**80)),
    "stop": st.one_of(
        st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)
    ),
    "stop_token_ids": st.lists(st.integers(0, SMOLLM2_VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1),
}
_prompts = st.one_of(
    st.text(_text, min_size=1, max_size=20),
    st.lists(st.integers(0, SMOLLM2_VOCAB - 1), min_size=1, max_size=8),
)
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=20)}
    ),
    min_size=1,
    max_size=3,
)
_JUNK = {
    **{name: _json for name in _VALID},
    "model": st.one_of(st.none(), st.just(""), st.just("TINY"), _json),
    "prompt": st.one_of(st.lists(st.integers(-2, SMOLLM2_VOCAB + 2), max_size=4), _json),
    "messages": st.one_of(
        st.lists(st.fixed_dictionaries({"role": _json, "content": _json}), max_size=2), _json
    ),
    "logit_bias": _json,
    "presence_penalty": _json,
    "echo": _json,
    "max_completion_tokens": _json,
}
_RAW = st.sampled_from(
    [
        b"",
        b"{",
        b"[" * 5000,
        b'{"prompt": "hi", "temperature": NaN}',
        b'{"prompt": "hi", "top_p": 1e999}',
        b'{"prompt": "\\ud800x", "max_tokens": 2}',
        b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
        b'{"prompt": "hi", "seed": ' + b"1" * 4400 + b"}",
        b"\xff\xfe\x00",
    ]
)


@st.composite
def _fuzzed(draw: st.DrawFn) -> tuple[str, Any]:
    chat = draw(st.booleans())
    first = {"messages": _messages} if chat else {"prompt": _prompts}
    first["model"] = st.just(MODEL)
    body = draw(st.fixed_dictionaries(first, optional=_VALID))
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(sorted(_JUNK)))
        body[key] = draw(_JUNK[key])
    route = "/v1/chat/completions" if chat else "/v1/completions"
    kind = draw(st.integers(0, 19))  # Hypothesis favours 0: the usual case
    if kind == 19:
        return route, draw(_RAW)
    if kind == 18:
        return route, draw(_json)  # not an object, or one without the required field
    return route, body


@contextlib.contextmanager
def _victim(live: Live) -> Iterator[list[str | None]]:
    """Valid streamed requests, one after another on another key, while the block runs."""
    reasons: list[str | None] = []
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(base_url=live.url, timeout=60) as c:
            while not stop.is_set():
                lines = stream_events(c, completion(max_tokens=16, ignore_eos=True), key=KEY_B)
                reasons.append(final_reason(lines) if lines[-1] == "data: [DONE]" else "no [DONE]")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield reasons
    finally:
        stop.set()
        thread.join(60)


def test_fuzzed_bodies_never_5xx_nor_hurt_a_neighbour(live: Live) -> None:
    client = httpx.Client(
        base_url=live.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60
    )

    @settings(
        max_examples=300,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(_fuzzed())
    def check(request: tuple[str, Any]) -> None:
        route, body = request
        if isinstance(body, bytes):
            r = client.post(route, content=body, headers={"Content-Type": "application/json"})
        else:  # ASCII-escaped, so a lone surrogate travels as "\\ud800" (httpx would fail)
            r = client.post(
                route, content=json.dumps(body), headers={"Content-Type": "application/json"}
            )
        text = r.read().decode("utf-8", "replace")
        assert r.status_code < 500, (body, r.status_code, text)
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert text.rstrip().endswith("data: [DONE]"), text[-200:]
            assert '"server_error"' not in text, text[-300:]

    with _victim(live) as reasons:
        check()
    client.close()
    assert reasons and all(r in ("stop", "length") for r in reasons), reasons
    assert not live.state.flights


# ---------------------------------------------------------------------- point 3: drain (last)
def test_drain_ends_every_request_even_when_a_step_hangs(folder: Path) -> None:
    """The engine is stuck in a step: the server still ends every stream and exits in time."""
    srv = Live(folder, drain_timeout_s=0.5, step_grace_s=0.5)
    try:
        outcomes: dict[str, Any] = {}

        def streamer(i: int) -> None:
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                outcomes[f"s{i}"] = stream_events(c, completion(max_tokens=50, ignore_eos=True))

        def waiter() -> None:
            r = httpx.post(
                f"{srv.url}/v1/completions",
                json=completion(max_tokens=50),
                headers={"Authorization": f"Bearer {KEY_B}"},
                timeout=30,
            )
            outcomes["plain"] = r

        with srv.stalled(blocked=False, delay=0.05) as gate:
            threads = [threading.Thread(target=streamer, args=(i,)) for i in range(3)]
            threads.append(threading.Thread(target=waiter))
            for t in threads:
                t.start()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not (
                len(srv.state.flights) == 4
                and all(f.stream is not None and f.last is not None for f in srv.state.flights)
            ):
                time.sleep(0.01)
            assert len(srv.state.flights) == 4, "the requests did not all start"
            gate.clear()  # the engine's next step hangs
            t0 = time.monotonic()
            srv.server.begin_drain()
            time.sleep(0.1)
            h = srv.http.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "draining"
            r = srv.http.post("/v1/completions", json=completion())
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            for t in threads:
                t.join(10)
            srv.thread.join(10)
            took = time.monotonic() - t0
        assert not srv.thread.is_alive()
        assert took < 0.5 + 0.5 + 3.0, f"shutdown took {took:.1f} s"
        for i in range(3):
            lines = outcomes[f"s{i}"]
            assert lines[-1] == "data: [DONE]" and final_reason(lines) == "length", lines
        plain = outcomes["plain"]
        assert plain.status_code == 503 and plain.json()["error"]["code"] == "shutting_down"
    finally:
        srv.stop()
