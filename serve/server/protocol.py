"""HTTP/1.1 connections with limits: uvicorn's httptools protocol, bounded where it is not.

uvicorn (with httptools) takes request heads of any size, waits for them forever, and accepts every
connection until the process runs out of file descriptors. Here each connection:

- answers 431 and closes once its request head passes `max_header_bytes`;
- answers 408 and closes when the head is not complete `header_timeout_s` after its first byte (or
  after the connection opened), and closes when the body is not complete `body_timeout_s` after the
  head (the app then sees a client that went away);
- is answered 503 and closed at once when `max_connections` are open already.

The limits are read from `config.limits` (a `ServeSettings`), set by `serve.server.cli`.
"""

from __future__ import annotations

import json
import logging
import resource
import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from serve.server.errors import ERROR_STATUS

log = logging.getLogger(__name__)
SPARE_FDS = 64  # descriptors left for the model file, logs, uploads and Gradio's temp files


def connection_cap(wanted: int) -> int:
    """`wanted`, lowered to stay under this process's file descriptor limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - SPARE_FDS))


def error_bytes(code: str, message: str) -> bytes:
    """A complete HTTP/1.1 error answer with our JSON body, that closes the connection."""
    status = ERROR_STATUS[code]
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    reason = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` with a head size limit, head and body deadlines and a connection cap."""

    _last_refusal_log = 0.0  # class-wide: one warning per second at most while the cap is hit

    def __init__(self, config, server_state, app_state, _loop=None):
        super().__init__(config, server_state, app_state, _loop)
        limits = config.limits
        self.max_head = limits.max_header_bytes
        self.head_timeout, self.body_timeout = limits.header_timeout_s, limits.body_timeout_s
        self.max_connections = connection_cap(limits.max_connections)
        self.head_bytes = 0  # bytes of the current request head so far
        self.in_head = True  # between a request's first byte and the end of its head
        self.refused = False
        self.deadline = None  # the TimerHandle of the head or body deadline

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            now = time.monotonic()
            if now - LimitedHttpToolsProtocol._last_refusal_log > 1.0:
                LimitedHttpToolsProtocol._last_refusal_log = now
                log.warning("%d connections open, the cap (max_connections): refusing new ones", self.max_connections)
            self._refuse("too_many_connections", "the server has too many open connections; retry shortly")
            return
        self._arm(self.head_timeout, self._head_too_slow)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        super().data_received(data)
        # httptools gathers a header value until its end before calling on_header: count what it holds
        if self.in_head and not self.refused:
            self._count_head(len(data))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_bytes, self.in_head = 0, True
        if self.deadline is None:  # a keep-alive connection's next request: its clock starts now
            self._arm(self.head_timeout, self._head_too_slow)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        if not self.refused:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        if not self.refused:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.refused:
            return
        self._disarm()
        self.in_head = False
        super().on_headers_complete()
        if self.transport.is_closing() or self.cycle is None:
            return
        headers = dict(self.headers)
        if headers.get(b"content-length", b"0") not in (b"0", b"") or b"transfer-encoding" in headers:
            self._arm(self.body_timeout, self._body_too_slow)

    def on_body(self, body: bytes) -> None:
        if not self.refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.refused:
            return
        self._disarm()
        super().on_message_complete()

    def _count_head(self, n: int) -> None:
        self.head_bytes += n
        if self.head_bytes > self.max_head and not self.refused:
            self._refuse("headers_too_large", f"the request head is over {self.max_head:,} bytes; send fewer headers")

    def _head_too_slow(self) -> None:
        self.deadline = None
        self._refuse("request_timeout", f"the request head did not arrive within {self.head_timeout} s")

    def _body_too_slow(self) -> None:
        self.deadline = None
        log.info("closing a connection whose body did not arrive within %s s", self.body_timeout)
        self.transport.close()  # the app sees a disconnect (499); a response may already be on its way

    def _refuse(self, code: str, message: str) -> None:
        """Write the error answer (unless one is under way) and close; the parser reads nothing more."""
        self._disarm()
        self.refused = True
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(error_bytes(code, message))
        self.transport.close()

    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
