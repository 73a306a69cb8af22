"""Connection limits below the app: a read timeout and a cap on open connections.

uvicorn waits for a request's headers and body as long as the client
likes, and accepts every connection, so 200 clients that each send half a
request hold 200 sockets forever (slowloris). :func:`guarded_protocol`
wraps uvicorn's HTTP protocol class:

- **read timeout**: from the moment a connection opens, or its previous
  response ended, the client has ``read_timeout_s`` seconds to deliver a
  whole request (headers and body); past it the server answers 408 (when no
  response has started) and closes the connection. The time the server then
  takes to answer is not limited.
- **connection cap**: a connection opened while ``max_connections`` are
  open is answered 429 with ``Retry-After`` and closed, without reaching
  the app.
- **malformed HTTP**: bytes uvicorn's parser refuses get a 400 in OpenAI's
  error shape (uvicorn answers plain text).

Why not uvicorn's own settings: ``timeout_keep_alive`` is armed only after
a response, so it neither covers a connection that never sends a request
nor one that sends half of it; ``limit_concurrency`` counts only
connections that have sent their headers (a slowloris socket is never
counted) and answers with a plain-text 503 from an app of its own, not a
429 that the client's retry logic understands; ``h11_max_incomplete_event_size``
(its default, 16 KiB of headers, is kept) bounds a request's size, not its
time; ``limit_max_requests`` restarts a worker. So the subclass stays.

It reads uvicorn's protocol internals (``cycle`` and its ``more_body``,
``response_started``, ``response_complete``; ``on_response_complete``),
common to its h11 and httptools implementations. pyproject.toml pins the
uvicorn versions it was checked on, and tests/test_server_guard.py runs it
over every installed implementation.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

_REJECT_LINGER_S = 1.0  # how long a refused connection may finish sending before it is closed


def _canned(
    status: int,
    reason: str,
    message: str,
    code: str,
    extra: str = "",
    kind: str = "server_error",
) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode("latin-1") + body


class ConnectionLimits:
    """The limits, and the open connections they count (shared by every connection)."""

    def __init__(
        self,
        *,
        read_timeout_s: float,
        max_connections: int,
        retry_after_s: int = 1,
        on_reject: Any = None,
    ) -> None:
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.retry_after_s = retry_after_s
        self.on_reject = on_reject  # called with (status, code) for every refusal
        self.open: set[Any] = set()
        self.timed_out = 0
        self.refused = 0

    def reject_bytes(self) -> bytes:
        """The 429 answer of a connection over the cap."""
        return _canned(
            429,
            "Too Many Requests",
            f"the server has {self.max_connections} connections open (--max-connections); "
            f"retry after {self.retry_after_s} s",
            "too_many_connections",
            f"retry-after: {self.retry_after_s}\r\n",
        )

    def timeout_bytes(self) -> bytes:
        """The 408 answer of a connection that did not send its request in time."""
        return _canned(
            408,
            "Request Timeout",
            f"the request was not received within {self.read_timeout_s:g} s (--read-timeout); "
            "send the whole request at once",
            "request_timeout",
        )


def invalid_http_bytes(detail: str) -> bytes:
    """The 400 answer of bytes that are not an HTTP/1.1 request (uvicorn's is plain text)."""
    return _canned(
        400,
        "Bad Request",
        f"the request is not valid HTTP/1.1 ({detail.rstrip('.')}); send a well-formed request",
        "invalid_http",
        kind="invalid_request_error",
    )


class _Guard:
    """The limits' methods, put before uvicorn's protocol class by :func:`guarded_protocol`
    (their ``super()`` calls reach that class)."""

    _guard_limits: ConnectionLimits
    _guard_timer: asyncio.TimerHandle | None = None
    _guard_refused = False
    _guard_bytes = 0  # received since the deadline was armed
    transport: Any

    # -------------------------------------------------- refused connections
    def connection_made(self, transport: Any) -> None:  # noqa: D102
        limits = self._guard_limits
        if len(limits.open) >= limits.max_connections:
            self._guard_refused = True
            limits.refused += 1
            if limits.on_reject is not None:
                limits.on_reject(429, "too_many_connections")
            transport.write(limits.reject_bytes())
            # Not at once: closing with the request unread would reset the connection and
            # the client could lose the answer. Most clients close first, having read it.
            self._guard_timer = asyncio.get_running_loop().call_later(
                _REJECT_LINGER_S, transport.close
            )
            return
        limits.open.add(self)
        super().connection_made(transport)  # type: ignore[misc]
        self._guard_arm()

    def data_received(self, data: bytes) -> None:  # noqa: D102
        if self._guard_refused:
            return  # read and dropped, so that closing later does not reset the connection
        self._guard_bytes += len(data)
        super().data_received(data)  # type: ignore[misc]
        if self._guard_timer is not None and self._guard_request_in():
            self._guard_disarm()

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
        self._guard_disarm()
        if self._guard_refused:
            return
        self._guard_limits.open.discard(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:  # noqa: D102
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._guard_arm()  # the next request must arrive in time too

    def send_400_response(self, msg: str) -> None:  # noqa: D102
        # uvicorn's answer to bytes its parser refuses, in OpenAI's shape
        limits = self._guard_limits
        if limits.on_reject is not None:
            limits.on_reject(400, "invalid_http")
        self.transport.write(invalid_http_bytes(msg))
        self.transport.close()

    # -------------------------------------------------- the read deadline
    def _guard_request_in(self) -> bool:
        """Whether a request is wholly received and not yet answered (the app's turn)."""
        cycle = getattr(self, "cycle", None)
        return (
            cycle is not None
            and not getattr(cycle, "response_complete", False)
            and not getattr(cycle, "more_body", True)
        )

    def _guard_arm(self) -> None:
        self._guard_disarm()
        self._guard_bytes = 0
        self._guard_timer = asyncio.get_running_loop().call_later(
            self._guard_limits.read_timeout_s, self._guard_expired
        )

    def _guard_disarm(self) -> None:
        if self._guard_timer is not None:
            self._guard_timer.cancel()
            self._guard_timer = None

    def _guard_expired(self) -> None:
        self._guard_timer = None
        transport = self.transport
        if transport is None or transport.is_closing() or self._guard_request_in():
            return
        cycle = getattr(self, "cycle", None)
        idle = cycle is None or getattr(cycle, "response_complete", False)
        if idle and not self._guard_bytes:
            transport.close()  # nothing sent: close quietly, as a keep-alive timeout does
            return
        limits = self._guard_limits
        limits.timed_out += 1
        if limits.on_reject is not None:
            limits.on_reject(408, "request_timeout")
        if idle or not getattr(cycle, "response_started", False):
            transport.write(limits.timeout_bytes())
        transport.close()


def guarded_protocol(base: type[asyncio.Protocol], limits: ConnectionLimits) -> type:
    """A subclass of uvicorn's protocol class ``base`` that applies ``limits``."""
    name = f"Guarded{base.__name__}"
    return type(name, (_Guard, base), {"_guard_limits": limits, "__qualname__": name})
