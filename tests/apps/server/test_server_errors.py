"""Every 4xx and 5xx of the server is OpenAI's error object, read by the official client and httpx.

One server (the ``Live`` of test_server_safety: uvicorn in a thread, the
same ``build_server`` as ``pitstop serve``) with small limits, so that each
refusal can be provoked in turn: bad values (pydantic's and the engine's),
401, 403 (Host, Origin), 404 and 405 (Starlette's routing), 408 and 429
and a malformed request (the connection guard below the app), 413, 415, 429 (the queue), 500
(a route and the middleware failing) and 503 (shutting down).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers.models import make_tiny_checkpoint
from test_server_safety import BAD_BODIES, KEY_A, MODEL, READ_TIMEOUT, Live, completion

import pitstop.server.routes.health as health_routes
from pitstop.server.security import RequestGuard

MAX_BODY = 8192
MAX_CONNECTIONS = 16


def assert_openai_error(body: Any) -> dict[str, Any]:
    """``body`` is ``{"error": {"message", "type", "param", "code"}}``; the inner object."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and len(err["message"]) > 10, err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    assert "Input should" not in err["message"], err  # pydantic's words never reach a client
    return err


def assert_client_error(
    exc: pytest.ExceptionInfo[openai.APIStatusError], status: int
) -> dict[str, Any]:
    """The official client's typed error: its status, and a body of OpenAI's shape."""
    assert exc.value.status_code == status, exc.value
    err = assert_openai_error(exc.value.response.json())
    assert exc.value.body == err  # the client unwraps "error" into .body
    assert exc.value.code == err["code"] and exc.value.param == err["param"]
    return err


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    folder: Path = make_tiny_checkpoint(tmp_path_factory.mktemp("errors"), "llama")
    srv = Live(
        folder,
        max_body_bytes=MAX_BODY,
        max_connections=MAX_CONNECTIONS,
        max_queued_requests=1,
    )
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(live: Live) -> Iterator[Any]:
    """``client(**kwargs)``: an official client of the live server, closed after the test (its
    keep-alive connections count against the connection cap)."""
    made: list[openai.OpenAI] = []

    def make(**kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", KEY_A)
        made.append(openai.OpenAI(base_url=f"{live.url}/v1", max_retries=0, timeout=30, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()


# ---------------------------------------------------------------------- 400
@pytest.mark.parametrize(("route", "body", "param"), BAD_BODIES)
def test_bad_values_are_400_naming_the_field_in_openai_shape(
    live: Live, route: str, body: bytes | dict[str, Any], param: str | None
) -> None:
    if isinstance(body, dict):
        r = live.http.post(route, json={"model": MODEL, **body})
    else:
        if body.startswith(b'{"'):
            body = b'{"model": "' + MODEL.encode() + b'", ' + body[1:]
        r = live.http.post(route, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = assert_openai_error(r.json())
    assert err["param"] == param, err
    assert len(err["message"]) > 20, err
    if param is not None:
        assert param in err["message"], err  # the message names the field


def test_pydantic_errors_read_like_pitstops_own(live: Live, client: Any) -> None:
    c = client()
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature="hot")  # type: ignore[arg-type]
    err = assert_client_error(exc, 400)
    assert err["param"] == "temperature"
    assert err["message"] == 'temperature must be a number, got a string "hot"'
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=1.5)  # type: ignore[arg-type]
    assert assert_client_error(exc, 400)["message"] == (
        "max_tokens must be an integer, got a number 1.5"
    )
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])  # type: ignore[misc, list-item]
    err = assert_client_error(exc, 400)
    assert err["param"] == "messages" and err["message"].startswith("messages[0].role must be")
    # the engine's own checks, in the same style
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert assert_client_error(exc, 400)["message"].startswith(
        "max_tokens must be null or an integer in [1, "
    )
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL, prompt="hi", extra_body={"colour": "red"})
    assert assert_client_error(exc, 400)["code"] == "unsupported_field"


# ---------------------------------------------------------------------- 401, 403, 404, 405
def test_auth_host_origin_route_and_method_errors(live: Live, client: Any) -> None:
    with pytest.raises(openai.AuthenticationError) as exc:
        client(api_key="sk-wrong").models.list()
    assert assert_client_error(exc, 401)["code"] == "invalid_api_key"

    for host in ("evil.example", "[::1]evil.example", "localhost:80x"):
        with pytest.raises(openai.PermissionDeniedError) as exc:
            client(default_headers={"Host": host}).models.list()
        assert assert_client_error(exc, 403)["code"] == "host_not_allowed", host
        r = live.http.get("/v1/models", headers={"Host": host})
        assert r.status_code == 403 and assert_openai_error(r.json())["code"] == "host_not_allowed"
    for host in (f"[::1]:{live.port}", "localhost.", f"LOCALHOST:{live.port}"):
        assert client(default_headers={"Host": host}).models.list().data, host

    with pytest.raises(openai.PermissionDeniedError) as exc:
        client(default_headers={"Origin": "https://evil.example"}).models.list()
    assert assert_client_error(exc, 403)["code"] == "origin_not_allowed"

    c = client()
    with pytest.raises(openai.NotFoundError) as exc:
        c.post("/nothing-here", cast_to=object, body={})
    assert "no endpoint POST /v1/nothing-here" in assert_client_error(exc, 404)["message"]
    with pytest.raises(openai.NotFoundError) as exc:
        c.models.retrieve("gpt-4")
    assert assert_client_error(exc, 404)["code"] == "model_not_found"
    with pytest.raises(openai.APIStatusError) as exc:
        c.get("/completions", cast_to=object)
    assert "GET is not allowed on /v1/completions" in assert_client_error(exc, 405)["message"]
    r = live.http.delete("/health")
    assert r.status_code == 405 and "allow" in r.headers
    assert_openai_error(r.json())


def test_allowed_host_names_are_checked_at_start() -> None:
    from pitstop.server.security import host_patterns

    assert host_patterns(["::1", "LocalHost", "*.lan"]) == [
        "*.lan",
        "*.lan.",
        "[::1]",
        "localhost",
        "localhost.",
    ]
    for bad in ("a*b", "*x.lan", "[x]", "localhost:80x"):
        with pytest.raises(ValueError, match="--allowed-hosts"):
            host_patterns([bad])


def test_serve_refuses_a_malformed_allowed_host() -> None:
    import argparse

    from pitstop.errors import ConfigError
    from pitstop.server.cli import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match=r"a\*b"):
        settings_from_args(parser.parse_args(["m", "--allowed-hosts", "box.lan,a*b"]))


# ---------------------------------------------------------------------- 413, 415
def test_too_large_and_not_json(live: Live, client: Any) -> None:
    with pytest.raises(openai.APIStatusError) as exc:
        client().completions.create(model=MODEL, prompt="x" * (2 * MAX_BODY), max_tokens=2)
    assert assert_client_error(exc, 413)["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as exc:
        client().completions.create(
            model=MODEL, prompt="hi", extra_headers={"Content-Type": "text/plain"}
        )
    assert assert_client_error(exc, 415)["code"] == "unsupported_media_type"
    r = live.http.post("/v1/completions", content=b"{}")  # no Content-Type at all
    assert (
        r.status_code == 415 and assert_openai_error(r.json())["code"] == "unsupported_media_type"
    )


# ---------------------------------------------------------------------- 408, 429 below the app
def _raw_answer(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), httpx.Response(200, content=body).json()


def test_read_timeout_is_408_in_openai_shape(live: Live) -> None:
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and then nothing
        time.sleep(READ_TIMEOUT + 0.5)
        status, body = _raw_answer(s)
    assert status == 408 and assert_openai_error(body)["code"] == "request_timeout"


def test_malformed_http_is_400_in_openai_shape(live: Live) -> None:
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n")
        status, body = _raw_answer(s)
    assert status == 400 and assert_openai_error(body)["code"] == "invalid_http"


def test_connection_cap_is_429_in_openai_shape(live: Live, client: Any) -> None:
    held = [socket.create_connection(("127.0.0.1", live.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)
        with pytest.raises(openai.RateLimitError) as exc:
            client().models.list()
        assert assert_client_error(exc, 429)["code"] == "too_many_connections"
        assert exc.value.response.headers["retry-after"] == "1"
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert client().models.list().data


# ---------------------------------------------------------------------- 429, 503 of admission
def test_full_queue_is_429_and_shutdown_503(live: Live, client: Any) -> None:
    with live.stalled() as release:
        waiting = threading.Thread(
            target=lambda: live.http.post("/v1/completions", json=completion()), daemon=True
        )
        waiting.start()
        deadline = time.monotonic() + 10
        while live.state.num_queued < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError) as exc:
            client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert assert_client_error(exc, 429)["code"] == "too_many_requests"
        release.set()
        waiting.join(30)
    live.state.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as exc:
            client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert assert_client_error(exc, 503)["code"] == "shutting_down"
    finally:
        live.state.draining = False


# ---------------------------------------------------------------------- 500
def test_a_failing_route_and_a_failing_middleware_are_500_json(
    live: Live, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(health_routes, "generate_latest", broken)
    with pytest.raises(openai.InternalServerError) as exc:
        client().get(f"{live.url}/metrics", cast_to=object)
    err = assert_client_error(exc, 500)
    assert err["type"] == "server_error" and "injected failure" in err["message"]

    monkeypatch.setattr(RequestGuard, "_preflight", broken)
    r = live.http.options(
        "/v1/completions",
        headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 500
    assert "injected failure" in assert_openai_error(r.json())["message"]
