"""The checks every HTTP request passes before any route sees it (an ASGI middleware).

A loopback server is reachable from every web page the machine's browser
opens. Three checks keep such pages out:

- **Host** (DNS rebinding): a page on ``evil.example`` whose name is made to
  resolve to 127.0.0.1 sends ``Host: evil.example``. When ``allowed_hosts``
  is set, a request whose ``Host`` (without the port) is not in it gets 403.
  ``pitstop serve`` sets it to the loopback names when bound to a loopback
  address. Starlette's ``TrustedHostMiddleware`` decides (its parser is
  strict: ``[::1]evil.example`` and ``localhost:80x`` match no name); the
  refusal is answered here, as OpenAI's error object.
- **Origin** (CSRF): browsers send ``Origin`` on cross-origin requests. A
  request carrying an ``Origin`` that is not in ``allowed_origins`` gets
  403; allowed origins get CORS headers (and their preflights a 204), so a
  web app of your own can call the server. Clients that are not browsers
  (curl, the ``openai`` client) send no ``Origin`` and are not affected.
  This check is pitstop's own: Starlette's ``CORSMiddleware`` adds CORS
  headers for allowed origins but lets a request from any other origin
  through, which a loopback server must refuse.
- **Content-Type**: a ``POST`` must declare ``application/json``, or it is
  415. A page can send ``text/plain`` (or no type) cross-origin without a
  CORS preflight; it cannot send ``application/json`` that way.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from starlette.middleware.trustedhost import TrustedHostMiddleware

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_BODY_METHODS = {"POST", "PUT", "PATCH"}


def is_loopback(bind_host: str) -> bool:
    """Whether listening on ``bind_host`` is reachable from this machine only."""
    return bind_host in ("localhost", "::1") or bind_host.startswith("127.")


def default_allowed_hosts(bind_host: str) -> tuple[str, ...] | None:
    """The loopback names (and the bind address) when bound to loopback; else no Host check."""
    if not is_loopback(bind_host):
        return None
    return tuple(dict.fromkeys((*LOOPBACK_HOSTS, bind_host)))


def host_name(header: str) -> str:
    """The name in a ``Host`` header, without the port, lowercased (``[::1]:8000`` -> ``::1``).

    Parsed strictly (RFC 3986's host and port): a bracketed host must hold an
    IPv6 address and be followed by nothing or ``:port``, and a port is
    digits. A header that does not parse (``[::1]evil.example``,
    ``[localhost]``, ``localhost:80x``) gives ``""``, which no allowed name
    matches.
    """
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        rest = header[end + 1 :] if end > 0 else None
        if rest is None or (rest and not (rest[0] == ":" and _is_port(rest[1:]))):
            return ""
        return _ipv6(header[1:end]) or ""
    if header.count(":") == 1:
        header, port = header.split(":")
        if not _is_port(port):
            return ""
    elif ":" in header:  # a bare IPv6 address: no port can follow it (RFC 3986 wants brackets)
        return _ipv6(header) or ""
    return header.rstrip(".")


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 5


def _ipv6(text: str) -> str | None:
    """``text`` as a compressed IPv6 address, or None when it is not one."""
    try:
        return ipaddress.IPv6Address(text).compressed
    except ValueError:
        return None


def bind_host(host: str) -> str:
    """The address of ``--host`` for the socket: ``[::1]`` (bracketed IPv6) becomes ``::1``.

    Raises ``ValueError`` for brackets around anything but an IPv6 address
    (``[::1]x``, ``[localhost]``, ``[::1``), which the listener would misread.
    """
    if host.startswith("[") or host.endswith("]"):
        inner = _ipv6(host[1:-1]) if host.startswith("[") and host.endswith("]") else None
        if inner is None:
            raise ValueError(
                f"--host {host!r}: brackets may only enclose an IPv6 address, as in [::1]"
            )
        return host[1:-1]
    return host


def host_pattern(name: str) -> str:
    """An allowed name as ``TrustedHostMiddleware`` matches it: lowercased, an IPv6 address in
    brackets (``::1`` -> ``[::1]``), ``*`` and ``*.example.com`` as they are.

    Raises ``ValueError`` for a name that matches no Host header (``a*b``, ``[x]``).
    """
    name = name.strip().lower()
    if name.startswith("*"):
        if name != "*" and (not name.startswith("*.") or "*" in name[1:]):
            raise ValueError(
                f"--allowed-hosts {name!r}: a wildcard must be the whole name ('*') or its "
                "first label ('*.example.com')"
            )
        return name
    host = host_name(name)
    if not host or "*" in host:
        raise ValueError(
            f"--allowed-hosts {name!r} is not a host name or IP address (IPv6 as ::1 or [::1])"
        )
    return f"[{host}]" if ":" in host else host


def host_patterns(names: Iterable[str]) -> list[str]:
    """:func:`host_pattern` of each name, and each name spelled with a final dot (``localhost.``,
    the same name as a fully qualified one), sorted."""
    patterns = {host_pattern(n) for n in names}
    dotted = {f"{p}." for p in patterns if p != "*" and not p.startswith("[")}
    return sorted(patterns | dotted)


_HOST_PASSED = "pitstop.host_passed"


async def _mark_passed(scope: Scope, _receive: Receive, _send: Send) -> None:
    scope[_HOST_PASSED] = True


async def _nothing() -> Message:
    return {"type": "http.disconnect"}


async def _discard(_message: Message) -> None:
    return None


def _clip(text: str, limit: int = 64) -> str:
    """``repr(text)`` cut to ``limit`` characters: a refusal never echoes a long header."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


def _normalize_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


class RequestGuard:
    """ASGI middleware applying the Host, Origin and Content-Type checks (module docstring).

    ``allowed_hosts=None`` skips the Host check; ``"*"`` in either list
    allows every value. ``on_reject(status, code)`` is told of every refusal
    (metrics).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        allowed_hosts: Iterable[str] | None = None,
        allowed_origins: Iterable[str] = (),
        on_reject: Callable[[int, str], None] | None = None,
    ) -> None:
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else host_patterns(allowed_hosts)
        self._host_names = ", ".join(h for h in self.allowed_hosts or () if not h.endswith("."))
        self._host_check = (
            None
            if self.allowed_hosts is None or "*" in self.allowed_hosts
            else TrustedHostMiddleware(
                _mark_passed, allowed_hosts=self.allowed_hosts, www_redirect=False
            )
        )
        self.allowed_origins = {_normalize_origin(o) for o in allowed_origins}
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        method = scope["method"]
        if self._host_check is not None and not await self._host_passes(scope):
            await self._refuse(
                send,
                403,
                f"the Host header {_clip(headers.get('host', ''))} is not a name this server "
                f"answers to ({self._host_names}); connect through one of them, or start the "
                "server with --allowed-hosts NAME",
                "host_not_allowed",
            )
            return
        origin = headers.get("origin")
        cors: list[tuple[bytes, bytes]] = []
        if origin is not None:
            if "*" not in self.allowed_origins and _normalize_origin(origin) not in (
                self.allowed_origins
            ):
                await self._refuse(
                    send,
                    403,
                    f"requests from the web origin {_clip(origin)} are not allowed; start the "
                    "server with --allowed-origins ORIGIN to let pages of that origin call it",
                    "origin_not_allowed",
                )
                return
            cors = [
                (b"access-control-allow-origin", origin.encode("latin-1")),
                (b"vary", b"Origin"),
            ]
            if method == "OPTIONS" and "access-control-request-method" in headers:
                await self._preflight(send, cors, headers)
                return
        if method in _BODY_METHODS:
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                got = headers.get("content-type")
                await self._refuse(
                    send,
                    415,
                    "the request body must be JSON sent with 'Content-Type: application/json' "
                    + (f"(got {_clip(got)})" if got else "(the request has no Content-Type)"),
                    "unsupported_media_type",
                )
                return
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *cors]
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _host_passes(self, scope: Scope) -> bool:
        """Whether ``TrustedHostMiddleware`` lets the request through (its answer is dropped)."""
        assert self._host_check is not None
        scope.pop(_HOST_PASSED, None)
        await self._host_check(scope, _nothing, _discard)
        return bool(scope.pop(_HOST_PASSED, False))

    async def _preflight(
        self, send: Send, cors: list[tuple[bytes, bytes]], headers: dict[str, str]
    ) -> None:
        allow_headers = headers.get("access-control-request-headers", "authorization, content-type")
        await send(
            {
                "type": "http.response.start",
                "status": 204,
                "headers": [
                    *cors,
                    (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                    (b"access-control-allow-headers", allow_headers.encode("latin-1")),
                    (b"access-control-max-age", b"600"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})

    async def _refuse(self, send: Send, status: int, message: str, code: str) -> None:
        if self.on_reject is not None:
            self.on_reject(status, code)
        body = json.dumps(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": code,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
