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
- **framing and head limits** (:class:`HeadCheck`): a request with both
  ``Content-Length`` and ``Transfer-Encoding`` is answered 400 and the
  connection closed (RFC 9112 section 6.1: such a message may be an attempt at
  request smuggling, and whatever follows its body cannot be trusted); a
  request line longer than :data:`MAX_REQUEST_LINE_BYTES` is answered 414 and
  headers over :data:`MAX_HEADER_BYTES` in all 431, both closed. The answers
  never repeat the request's bytes. The checks run in the parser's own
  callbacks (httptools) or on its request event (h11), so no head is
  buffered past its limit on httptools, and on h11 no further than h11's own
  16 KiB bound on an incomplete head.

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
uvicorn versions it was checked on, and tests/apps/server/test_server_guard.py runs it
over every installed implementation.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

_REJECT_LINGER_S = 1.0  # how long a refused connection may finish sending before it is closed

MAX_REQUEST_LINE_BYTES = 8 << 10
"""The longest request target (path and query) a request may send; longer is 414."""
MAX_HEADER_BYTES = 16 << 10
"""The most bytes of header lines (names, values, ``: `` and CRLF) a request may send; more is 431."""


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


class HeadCheck:
    """The framing and size checks of one request head, fed as the parser reads it.

    :meth:`url` and :meth:`header` return the refusal (the canned answer's
    bytes) as soon as a limit is passed, :meth:`complete` the framing
    conflict; None while the head is acceptable.
    """

    def __init__(self) -> None:
        self.url_bytes = 0
        self.header_bytes = 0
        self.content_length = False
        self.transfer_encoding = False

    def url(self, fragment: bytes) -> bytes | None:
        """Count a fragment of the request target; past the limit, the 414."""
        self.url_bytes += len(fragment)
        if self.url_bytes > MAX_REQUEST_LINE_BYTES:
            return _canned(
                414,
                "URI Too Long",
                f"the request target is over {MAX_REQUEST_LINE_BYTES} bytes; send long "
                "input in a JSON body (POST), not in the path or query",
                "uri_too_long",
                kind="invalid_request_error",
            )
        return None

    def header(self, name: bytes, value: bytes) -> bytes | None:
        """Count one header line; past the limit, the 431."""
        self.header_bytes += len(name) + len(value) + 4  # "name: value\r\n"
        lowered = name.lower()
        self.content_length |= lowered == b"content-length"
        self.transfer_encoding |= lowered == b"transfer-encoding"
        if self.header_bytes > MAX_HEADER_BYTES:
            return _canned(
                431,
                "Request Header Fields Too Large",
                f"the request's headers are over {MAX_HEADER_BYTES} bytes in all; send fewer "
                "or shorter headers (long input belongs in the JSON body)",
                "headers_too_large",
                kind="invalid_request_error",
            )
        return None

    def complete(self) -> bytes | None:
        """At the end of the head: the 400 of a request framed two ways."""
        if self.content_length and self.transfer_encoding:
            return _canned(
                400,
                "Bad Request",
                "the request has both Content-Length and Transfer-Encoding, which frame its "
                "body two ways (RFC 9112 section 6.1); send one of them. The connection is "
                "closed",
                "conflicting_framing",
                kind="invalid_request_error",
            )
        return None

    def of_request(self, target: bytes, headers: Any) -> bytes | None:
        """Every check of a whole head at once (h11 hands the head over whole)."""
        refusal = self.url(target)
        for name, value in headers:
            refusal = refusal or self.header(name, value)
        return refusal or self.complete()


class _HeadRefused(Exception):
    """Raised inside the parser to stop it; the refusal is answered by ``send_400_response``."""


class _Guard:
    """The limits' methods, put before uvicorn's protocol class by :func:`guarded_protocol`
    (their ``super()`` calls reach that class)."""

    _guard_limits: ConnectionLimits
    _guard_timer: asyncio.TimerHandle | None = None
    _guard_refused = False
    _guard_bytes = 0  # received since the deadline was armed
    _guard_head: HeadCheck | None = None  # the head being parsed (httptools)
    _guard_refusal: bytes | None = None  # the answer of a head refused by HeadCheck
    _guard_closing = False  # answered and closing: what still arrives is read and dropped
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
        self._guard_wrap_h11()
        self._guard_arm()

    def data_received(self, data: bytes) -> None:  # noqa: D102
        if self._guard_refused or self._guard_closing:
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
        # uvicorn's answer to bytes its parser refuses, in OpenAI's shape; or a head refused
        # by HeadCheck (its callbacks stopped the parser, which uvicorn reads as malformed)
        limits = self._guard_limits
        answer = self._guard_refusal or invalid_http_bytes(msg)
        if limits.on_reject is not None:
            limits.on_reject(int(answer[9:12]), "invalid_http")
        self._guard_close_after(answer)

    def _guard_close_after(self, answer: bytes) -> None:
        """Send ``answer``, end the sending side, and close once the client had time to read
        it (closing with its bytes unread would reset the connection and lose the answer)."""
        self._guard_closing = True
        self._guard_disarm()
        transport = self.transport
        transport.write(answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._guard_timer = asyncio.get_running_loop().call_later(_REJECT_LINGER_S, transport.close)

    # -------------------------------------------------- the request head (HeadCheck)
    def _guard_refuse(self, refusal: bytes | None) -> None:
        if refusal is not None:
            self._guard_refusal = refusal
            raise _HeadRefused

    def on_message_begin(self) -> None:  # noqa: D102  (httptools)
        self._guard_head = HeadCheck()
        super().on_message_begin()  # type: ignore[misc]

    def on_url(self, url: bytes) -> None:  # noqa: D102  (httptools)
        self._guard_refuse(self._guard_head_check().url(url))
        super().on_url(url)  # type: ignore[misc]

    def on_header(self, name: bytes, value: bytes) -> None:  # noqa: D102  (httptools)
        self._guard_refuse(self._guard_head_check().header(name, value))
        super().on_header(name, value)  # type: ignore[misc]

    def on_headers_complete(self) -> None:  # noqa: D102  (httptools)
        self._guard_refuse(self._guard_head_check().complete())
        super().on_headers_complete()  # type: ignore[misc]

    def _guard_head_check(self) -> HeadCheck:
        if self._guard_head is None:
            self._guard_head = HeadCheck()
        return self._guard_head

    def _guard_wrap_h11(self) -> None:
        """On h11, check each request event's head before uvicorn reads it."""
        conn = getattr(self, "conn", None)
        if conn is None or not hasattr(conn, "next_event"):
            return  # httptools: the callbacks above check the head
        import h11

        next_event = conn.next_event

        def checked_next_event() -> Any:
            try:
                event = next_event()
            except h11.RemoteProtocolError as exc:
                if exc.error_status_hint == 431:  # h11's own bound on an incomplete head
                    self._guard_refusal = HeadCheck().header(b"", b"x" * MAX_HEADER_BYTES)
                raise
            if isinstance(event, h11.Request):
                refusal = HeadCheck().of_request(event.target, event.headers)
                if refusal is not None:
                    self._guard_refusal = refusal
                    raise h11.RemoteProtocolError("refused head", error_status_hint=400)
            return event

        conn.next_event = checked_next_event

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
