"""The connection guard on each of uvicorn's HTTP protocols, and the uvicorn versions it supports.

:mod:`pitstop.server.guard` subclasses uvicorn's protocol class and reads
its request cycle (``cycle.more_body``, ``response_started``,
``response_complete``), which uvicorn does not promise to keep: pyproject
pins the uvicorn versions this was checked on, and these tests run the
guard over a bare ASGI app on every protocol implementation installed.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import tomllib
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from helpers.server_process import free_port
from packaging.requirements import Requirement

from pitstop.server.guard import ConnectionLimits, guarded_protocol

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 0.5
CAP = 4


def _uvicorn_requirements() -> list[Requirement]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    reqs = [Requirement(r) for group in ("serve", "test") for r in extras[group]]
    return [r for r in reqs if r.name == "uvicorn"]


def test_installed_uvicorn_is_one_the_guard_supports() -> None:
    reqs = _uvicorn_requirements()
    assert len(reqs) == 2 and len({str(r.specifier) for r in reqs}) == 1, reqs
    spec = reqs[0].specifier
    assert any(s.operator == "<" for s in spec), f"uvicorn needs an upper bound: {spec}"
    assert spec.contains(version("uvicorn")), (version("uvicorn"), str(spec))


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


def _protocols() -> list[Any]:
    out = []
    from uvicorn.protocols.http.h11_impl import H11Protocol

    out.append(pytest.param(H11Protocol, id="h11"))
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        out.append(pytest.param(None, id="httptools", marks=pytest.mark.skip("not installed")))
    else:
        out.append(pytest.param(HttpToolsProtocol, id="httptools"))
    return out


@pytest.fixture(params=_protocols())
def server(request: pytest.FixtureRequest) -> Iterator[tuple[int, ConnectionLimits]]:
    limits = ConnectionLimits(read_timeout_s=TIMEOUT, max_connections=CAP)
    port = free_port()
    config = uvicorn.Config(
        _app,
        host="127.0.0.1",
        port=port,
        http=guarded_protocol(request.param, limits),
        log_level="warning",
        lifespan="off",
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield port, limits
    finally:
        srv.should_exit = True
        thread.join(10)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    sock.settimeout(5)
    while chunk := sock.recv(65536):
        data += chunk
    return data


GET = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"


def _answer(sock: socket.socket) -> bytes:
    """One whole answer of the app (its body is ``ok``)."""
    data = b""
    while not data.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    return data


def test_whole_requests_pass_and_keep_alive_rearms(server: tuple[int, ConnectionLimits]) -> None:
    port, limits = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(3):  # each request within the timeout of the previous answer
            s.sendall(GET)
            assert _answer(s).startswith(b"HTTP/1.1 200")
            time.sleep(TIMEOUT * 0.6)
    assert limits.timed_out == 0


@pytest.mark.parametrize(
    "partial",
    [b"GET / HTTP/1.1\r\nHost: loc", b"POST / HTTP/1.1\r\nHost: l\r\nContent-Length: 9\r\n\r\nabc"],
    ids=["headers", "body"],
)
def test_a_slow_request_is_408_in_openai_shape(
    server: tuple[int, ConnectionLimits], partial: bytes
) -> None:
    port, limits = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(partial)
        data = _read_all(s)  # the guard answers and closes
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "request_timeout"
    assert limits.timed_out == 1


def test_a_silent_connection_is_closed_quietly(server: tuple[int, ConnectionLimits]) -> None:
    port, limits = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        assert _read_all(s) == b""  # closed after the timeout, no answer
    assert limits.timed_out == 0


def test_connections_over_the_cap_are_429(server: tuple[int, ConnectionLimits]) -> None:
    port, limits = server
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(CAP)]
    try:
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(GET)
            head, _, body = _read_all(s).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in head.lower()
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert limits.refused == 1
    finally:
        for s in held:
            s.close()
    time.sleep(0.1)
    with socket.create_connection(("127.0.0.1", port)) as s:  # room again
        s.sendall(GET)
        assert _answer(s).startswith(b"HTTP/1.1 200")


def test_malformed_http_is_400_in_openai_shape(server: tuple[int, ConnectionLimits]) -> None:
    port, _limits = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        head, _, body = _read_all(s).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_http"


SMUGGLED = (
    b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 4\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    b"GET /second HTTP/1.1\r\nHost: localhost\r\n\r\n"
)


def _refusal(port: int, raw: bytes) -> tuple[bytes, dict[str, Any], bytes]:
    """Send ``raw``; the status line, the error object and the whole answer (the server must
    close the connection after it: the read ends)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        try:
            s.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused and closed before reading everything
        data = _read_all(s)
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0], json.loads(body)["error"], data


def test_content_length_with_transfer_encoding_is_400_and_closed(
    server: tuple[int, ConnectionLimits],
) -> None:
    port, _limits = server
    status, err, data = _refusal(port, SMUGGLED)
    assert status.startswith(b"HTTP/1.1 400"), data
    assert err["code"] == "conflicting_framing" and "Transfer-Encoding" in err["message"]
    assert data.count(b"HTTP/1.1") == 1  # the bytes after the chunked body were not served


def test_headers_over_16_kib_are_431_without_echo(server: tuple[int, ConnectionLimits]) -> None:
    port, _limits = server
    marker = b"Z" * 1000
    # in one piece (h11 bounds only an incomplete head) and in pieces
    for pieces in (1, 8):
        raw = b"GET / HTTP/1.1\r\nHost: localhost\r\n" + b"".join(
            b"X-Pad-%d: %s\r\n" % (i, marker) for i in range(64)
        )
        raw += b"\r\n"
        step = len(raw) // pieces + 1
        with socket.create_connection(("127.0.0.1", port)) as s:
            for i in range(0, len(raw), step):
                try:
                    s.sendall(raw[i : i + step])
                except (BrokenPipeError, ConnectionResetError):
                    break
            data = _read_all(s)
        assert data.startswith(b"HTTP/1.1 431"), data[:200]
        assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "headers_too_large"
        assert marker not in data


def test_headers_just_under_the_limit_pass(server: tuple[int, ConnectionLimits]) -> None:
    port, _limits = server
    pad = b"X-Pad: " + b"a" * (15 << 10) + b"\r\n"
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n" + pad + b"\r\n")
        assert _answer(s).startswith(b"HTTP/1.1 200")


def test_a_long_request_line_is_414_without_echo(server: tuple[int, ConnectionLimits]) -> None:
    port, _limits = server
    path = b"/" + b"p" * (9 << 10)
    status, err, data = _refusal(port, b"GET " + path + b" HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 414"), data[:200]
    assert err["code"] == "uri_too_long" and path not in data and b"p" * 64 not in data
    with socket.create_connection(("127.0.0.1", port)) as s:  # 8 KiB of path still pass
        s.sendall(b"GET /" + b"p" * 8000 + b" HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert _answer(s).startswith(b"HTTP/1.1 200")
