"""Issue 32 at the server: fair cost accounting (admission counts tokens, prompt x n +
max_tokens x n) and the load checks (strict Host and --host, UTF-8 bodies, one order
for the end of a stream).

The unit tests drive :class:`ServerState` with a stand-in engine; the live
ones run the real server (``test_server_safety.Live``) on a tiny checkpoint
and stall its steps so that requests stay queued.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from helpers.models import make_tiny_checkpoint
from test_server_safety import KEY_A, KEY_B, MODEL, Live, _post_async, completion

from pitstop.server.limits import ServerState, request_cost
from pitstop.server.protocol import APIError


@attrs.define
class _Snapshot:
    num_running: int = 0


@attrs.define
class _Awake:
    def is_sleeping(self) -> bool:
        return False


@attrs.define
class _FakeLLM:
    accepting: bool = True
    snapshot: _Snapshot = attrs.Factory(_Snapshot)
    rollout: _Awake = attrs.Factory(_Awake)  # AsyncLLM.rollout: admission asks if it sleeps


def _state(**kw: Any) -> ServerState:
    values: dict[str, Any] = dict(
        max_queued_requests=1000, max_requests_per_client=None, retry_after_s=1
    )
    values.update(kw)
    return ServerState(_FakeLLM(), **values)  # type: ignore[arg-type]


def test_request_cost_counts_prompt_and_budget_per_sample() -> None:
    assert request_cost(10, 1, 1, 64) == 11
    assert request_cost(10, 1, 32, 64) == 32 * 11  # n=32 x max_tokens=1 is not one request
    assert request_cost(10, 100, 2, 64) == 2 * 64  # a sample never holds more than max_model_len


def test_queue_budget_counts_waiting_cost_only() -> None:
    state = _state(max_queued_tokens=100)
    a = state.admit("x", 60)
    with pytest.raises(APIError) as err:
        state.admit("y", 50)
    assert err.value.status == 429 and err.value.code == "too_many_queued_tokens"
    assert (
        "60" in str(err.value)
        and "50" in str(err.value)
        and "--max-queued-tokens" in str(err.value)
    )
    a.started = True  # running now: no longer in the queue's budget
    b = state.admit("y", 50)
    assert state.queued_cost == 50
    a.release()
    b.release()
    assert not state.flights and not state.client_cost and not state.per_client


def test_per_client_budget_leaves_room_for_others() -> None:
    state = _state(max_tokens_per_client=100)
    a = state.admit("x", 80)
    a.started = True  # running requests count too: the budget is of open requests
    with pytest.raises(APIError) as err:
        state.admit("x", 30)
    assert err.value.status == 429 and err.value.code == "too_many_tokens_per_client"
    state.admit("y", 90).release()
    a.release()
    state.admit("x", 100).release()


def test_a_request_over_a_budget_alone_is_400_naming_the_numbers() -> None:
    for kw, flag in (
        ({"max_queued_tokens": 1000}, "--max-queued-tokens"),
        ({"max_tokens_per_client": 1000}, "--max-tokens-per-client"),
    ):
        state = _state(**kw)
        with pytest.raises(APIError) as err:
            state.admit_many("x", [600, 600])  # one request's prompts are counted together
        assert err.value.status == 400 and err.value.code == "request_too_costly"
        message = str(err.value)
        assert "1200" in message and "1000" in message and flag in message
        assert not state.flights and not state.client_cost


def test_one_request_s_prompts_are_admitted_together() -> None:
    state = _state(max_queued_requests=3)
    state.admit("x", 1)
    with pytest.raises(APIError):
        state.admit_many("x", [1, 1, 1])  # 1 + 3 > 3: none of the three is admitted
    assert len(state.flights) == 1
    state.admit_many("x", [1, 1])
    assert len(state.flights) == 3


# ---------------------------------------------------------------------- the real server
@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    folder: Path = make_tiny_checkpoint(tmp_path_factory.mktemp("cost"), "llama")
    srv = Live(folder, max_n=128, max_queued_tokens=400)
    try:
        yield srv
    finally:
        srv.stop()


def test_costly_request_is_400_with_the_numbers_and_the_fix(live: Live) -> None:
    # max_model_len 64: n=8 x max_tokens 63 costs 8 x 64 = 512 > 400
    r = live.http.post("/v1/completions", json=completion(n=8, max_tokens=63))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "request_too_costly"
    assert "512" in error["message"] and "400" in error["message"]
    assert "--max-queued-tokens" in error["message"] and "lower n" in error["message"]
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 60,
        "n": 8,
    }
    r = live.http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_costly", r.text
    assert not live.state.flights


def test_n_counts_in_the_queue_budget(live: Live) -> None:
    """Three n=4 requests of cost 4 x (prompt + 20) fit 400 once; n=1 ones fit more."""
    body = completion(prompt=[1, 2, 3, 4], n=4, max_tokens=20)  # cost 4 x 24 = 96
    with live.stalled() as release:
        threading.Timer(1.5, release.set).start()
        results = _post_async(live, [(KEY_A, body)] * 5 + [(KEY_B, completion(prompt=[1, 2]))])
    codes = [r.status_code for r in results]
    assert codes == [200, 200, 200, 200, 429, 200], [r.text for r in results]
    refused = results[4].json()["error"]
    assert refused["code"] == "too_many_queued_tokens" and "384" in refused["message"]
    assert results[4].headers["retry-after"] == "1"
    assert not live.state.flights and not live.state.client_cost


# ---------------------------------------------------------------------- load checks
def test_host_header_is_parsed_strictly() -> None:
    from pitstop.server.security import bind_host, host_name

    assert host_name("[::1]:8000") == "::1" and host_name("[0:0::1]") == "::1"
    assert host_name("localhost:8000") == "localhost" and host_name("::1") == "::1"
    for bad in ("[::1]evil.example", "[::1]:80x", "[localhost]", "[::1", "localhost:80x", "[]"):
        assert host_name(bad) == "", bad
    assert bind_host("[::1]") == "::1" and bind_host("127.0.0.1") == "127.0.0.1"
    for bad in ("[::1]x", "[localhost]", "[::1", "::1]"):
        with pytest.raises(ValueError, match="IPv6"):
            bind_host(bad)


def test_serve_refuses_a_malformed_bracketed_host() -> None:
    import argparse

    from pitstop.errors import ConfigError
    from pitstop.server.cli import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match="IPv6"):
        settings_from_args(parser.parse_args(["m", "--host", "[::1]evil"]))
    args = parser.parse_args(["m", "--host", "[::1]"])
    assert settings_from_args(args).allowed_hosts is not None and args.host == "::1"


def test_bodies_must_be_utf8(live: Live) -> None:
    raw = json.dumps(completion())
    for body in (
        raw.encode("utf-16"),
        raw.encode("utf-16-le"),
        raw.encode("utf-32"),
        b"\xef\xbb\xbf" + raw.encode(),
        raw.replace("Hello", "H\xe9llo").encode("latin-1"),
    ):
        r = live.http.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_encoding" and "UTF-8" in error["message"], error
    ok = live.http.post(
        "/v1/completions",
        content=raw.replace("Hello", "H\xe9llo").encode(),
        headers={"Content-Type": "application/json"},
    )
    assert ok.status_code == 200, ok.text


def test_stream_order_is_choices_usage_error_done(live: Live) -> None:
    """A step fails after the stream began: usage chunk, then the error event, then [DONE]."""
    engine = live.llm.engine
    step = engine.step
    calls = {"n": 0}

    def failing_step(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("boom")
        return step(*args, **kwargs)

    body = {
        **completion(max_tokens=30, ignore_eos=True),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    engine.step = failing_step  # type: ignore[method-assign]
    try:
        with live.http.stream("POST", "/v1/completions", json=body) as r:
            lines = [x for x in r.iter_lines() if x]
    finally:
        engine.step = step  # type: ignore[method-assign]
    assert lines[-1] == "data: [DONE]", lines
    events = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
    assert events[-1]["error"]["code"] == "engine_error", events
    usage = events[-2]
    assert usage["choices"] == [], events
    sent = sum(
        1 for e in events[:-2] if e["choices"][0]["text"] or e["choices"][0]["finish_reason"]
    )
    assert 1 <= usage["usage"]["completion_tokens"] < 30 and sent >= 1
    assert all(e.get("choices") for e in events[:-2])


@attrs.define
class _Failures:
    """The two counters a stream reports failures to (ServerMetrics' names)."""

    seen: list[str] = attrs.Factory(list)

    def observe_stream_error(self, exc: BaseException) -> None:
        self.seen.append(f"stream:{type(exc).__name__}")

    def observe_request_failure(self, kind: str) -> None:
        self.seen.append(kind)


def test_outputs_queued_before_a_step_error_are_sent_before_it() -> None:
    """The engine's outputs and then its step error already queued together (one burst):
    the burst's text goes out first, then usage, the error and [DONE]."""
    import asyncio

    from pitstop.entrypoints.async_engine import EngineStepError
    from pitstop.requests.outputs import CompletionOutput, RequestOutput
    from pitstop.server.streaming import _events

    def output(n: int) -> RequestOutput:
        sample = CompletionOutput(
            0, "ab"[:n], list(range(n)), text_delta="ab"[n - 1], new_token_ids=[n - 1]
        )
        return RequestOutput("r", None, [7], [sample], False)

    def chunk(k: int, text: str, reason: str | None, count: int, out: Any) -> dict[str, Any]:
        return {"choices": [{"index": k, "text": text, "finish_reason": reason}]}

    def usage(out: RequestOutput) -> dict[str, Any]:
        return {"choices": [], "usage": {"completion_tokens": len(out.outputs[0].token_ids)}}

    metrics = _Failures()

    async def collect() -> list[str]:
        flight = _state().admit("x", 1)
        for item in (output(1), output(2), EngineStepError("boom")):
            flight._queue.put_nowait(item)
        events = _events(flight, metrics, chunk, None, usage, 1, None)  # type: ignore[arg-type]
        return [e async for e in events]

    lines = [e.strip().removeprefix("data: ") for e in asyncio.run(collect())]
    assert lines[-1] == "[DONE]"
    text, usage_event, error = (json.loads(x) for x in lines[:-1])
    assert text["choices"][0]["text"] == "ab" and text["choices"][0]["finish_reason"] is None
    assert usage_event["usage"]["completion_tokens"] == 2
    assert error["error"]["code"] == "engine_error"
    assert metrics.seen == ["stream:EngineStepError"]
