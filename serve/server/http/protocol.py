"""HTTP/1.1 connections with limits: uvicorn's httptools protocol, bounded where it is not.

uvicorn (with httptools) takes request heads of any size, waits for them forever, and accepts every
connection until the process runs out of file descriptors. Here each connection:

- answers 431 and closes once its request head passes `max_header_bytes` or `MAX_HEADER_FIELDS` fields;
- answers 408 and closes when the head is not complete `header_timeout_s` after its first byte (or
  after the connection opened), and closes when the body is not complete `body_timeout_s` after the
  head (the app then sees a client that went away);
- is dropped when its answers stop draining (the client reads none) for `body_timeout_s`, as nginx's
  `send_timeout`; deadlines are checked a few times a second;
- is answered 503 and closed at once when `max_connections` are open already.

The limits are read from `config.limits` (a `ConnectionLimits`), set by `serve.server.cli`.

uvicorn's own `limit_concurrency` is not the connection cap: it answers 503 (in plain text) only once a
request head has arrived, so idle connections that never send one keep their descriptors until a
timeout, and a flood of them exhausts the process's file limit. The cap refuses the connection itself,
at once (tests/serve/test_security.py). The class extends uvicorn's private
`HttpToolsProtocol`: pyproject.toml bounds uvicorn's version, and tests/serve/test_protocol_contract.py
fails when that class changes.
"""

from __future__ import annotations

import logging
import resource
import time
from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from serve.server.errors import ERROR_STATUS, error_body

log = logging.getLogger(__name__)
SPARE_FDS = 64  # descriptors left for the model file, logs, uploads and Gradio's temp files
# Each header field costs about 130 bytes of Python objects: 6,000 tiny ones fit `max_header_bytes` and took 800 kB
MAX_HEADER_FIELDS = 100  # a connection. Apache's LimitRequestFields is 100 too; browsers send about 20.
ANSWERED = "answered_by_connection"  # in scope["state"]: the status written here to a request refused in its body


def connection_cap(wanted: int) -> int:
    """`wanted`, lowered to stay under this process's file descriptor limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - SPARE_FDS))


def error_bytes(code: str, message: str) -> bytes:
    """A complete HTTP/1.1 error answer with our JSON body, that closes the connection."""
    status, body = ERROR_STATUS[code], error_body(code, message)
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` with a head size limit, head and body deadlines and a connection cap.

    A deadline is a number on the connection, not a timer: setting one costs nothing per request, and one
    sweep per server (`_sweep`, a few times a second) closes the connections whose deadline has passed.
    """

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
        self.deadline = 0.0  # time.monotonic() by which the head or the body must be in; 0: none
        self.too_slow = self._head_too_slow  # what happens then
        self.write_deadline = 0.0  # by which answers that stopped draining must drain again; 0: they drain
        self.cycles = []  # the requests of this connection not answered yet (several, when they are pipelined)
        self.refusal = b""  # a refused request's answer, written once those pipelined before it are answered

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
        if getattr(self.server_state, "deadline_sweep", None) is None:
            every = min(1.0, self.head_timeout / 4, self.body_timeout / 4)
            self.server_state.deadline_sweep = self.loop.call_later(every, _sweep, self.loop, self.server_state, every)

    def connection_lost(self, exc) -> None:
        self.deadline = self.write_deadline = 0.0
        # uvicorn marks only the last request read as gone: a pipelined one still being answered would then
        # write to the closed transport (a RuntimeError and its traceback for every such request)
        for cycle in self.cycles:
            cycle.disconnected = cycle.disconnected or not cycle.response_complete
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:  # a request httptools cannot parse: our JSON body, not text
        self._refuse("malformed_request", f"{msg} Send a well-formed HTTP/1.1 request.")

    def pause_writing(self) -> None:  # the transport's buffer is full: the client is not reading
        super().pause_writing()
        self.write_deadline = time.monotonic() + self.body_timeout

    def resume_writing(self) -> None:
        super().resume_writing()
        self.write_deadline = 0.0

    def _reader_too_slow(self) -> None:
        log.info("dropping a connection whose answers did not drain for %s s", self.body_timeout)
        self.transport.abort()  # close() would wait for the buffer to drain: never

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        super().data_received(data)
        # a head that spans reads: count what came so far (httptools holds a header until its end)
        if self.in_head and not self.refused:
            self._count_head(len(data))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_bytes, self.in_head = 0, True
        if not self.deadline:  # a keep-alive connection's next request: its clock starts now
            self._arm(self.head_timeout, self._head_too_slow)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.refused:
            return
        if len(self.headers) >= MAX_HEADER_FIELDS:
            return self._refuse(
                "headers_too_large", f"the request has over {MAX_HEADER_FIELDS} header fields; send fewer"
            )
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.refused:
            return
        codings = b",".join(value for name, value in self.headers if name == b"transfer-encoding")
        if codings and codings.replace(b" ", b"").lower() != b"chunked":  # RFC 9112: a 501, not a body misread
            message = f"Transfer-Encoding {codings.decode('latin-1')!r} is not understood: send the body as it is"
            return self._refuse("not_implemented", message + " (chunked, or with a Content-Length)")
        # the whole head, exactly, before the app sees it (also when it came in one read)
        head = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        self.head_bytes = max(self.head_bytes, head)
        self._count_head(0)
        if self.refused:
            return
        self.in_head = False
        self._arm(self.body_timeout, self._body_too_slow)  # cleared at once by a request without a body
        super().on_headers_complete()
        self.cycles = [c for c in self.cycles if not c.response_complete] + ([self.cycle] if self.cycle else [])

    def on_body(self, body: bytes) -> None:
        if not self.refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.refused:
            return
        self.deadline = 0.0
        super().on_message_complete()

    def _count_head(self, n: int) -> None:
        self.head_bytes += n
        if self.head_bytes > self.max_head and not self.refused:
            self._refuse("headers_too_large", f"the request head is over {self.max_head:,} bytes; send fewer headers")

    def _head_too_slow(self) -> None:
        self._refuse("request_timeout", f"the request head did not arrive within {self.head_timeout} s")

    def _body_too_slow(self) -> None:
        log.info("closing a connection whose body did not arrive within %s s", self.body_timeout)
        self.transport.close()  # the app sees a disconnect (499); a response may already be on its way

    def _refuse(self, code: str, message: str) -> None:
        """Write the error answer (unless one is under way) and close; the parser reads nothing more.

        Requests read whole before the refused one (pipelined on the connection) are answered first, in order, as
        nginx does: the refusal waits for their answers (`on_response_complete`). A request refused in its own
        body (a malformed chunk) is answered at once: it would wait for the rest of a body that never comes.
        """
        self.deadline = 0.0
        if self.refused:  # the parser's complaint about what follows a refused head: the first answer stands
            return
        self.refused = True
        reading = self.cycle is not None and self.cycle.more_body  # the refused bytes are this request's own body
        if not reading and (self.pipeline or any(not c.response_complete and not c.disconnected for c in self.cycles)):
            self.refusal = error_bytes(code, message)
            return
        cycle = self.cycle  # on a keep-alive connection, the previous request's until this one's head is in
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(error_bytes(code, message))
            if reading:  # the app sees a client that went away: the record counts the status the client got
                cycle.scope["state"][ANSWERED] = ERROR_STATUS[code]
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.refusal and not self.transport.is_closing() and not self.pipeline:
            if all(c.response_complete or c.disconnected for c in self.cycles):
                self.transport.write(self.refusal)
                self.transport.close()

    def _arm(self, seconds: float, too_slow) -> None:
        self.deadline, self.too_slow = time.monotonic() + seconds, too_slow


def _sweep(loop, server_state, every: float) -> None:
    """Close the connections whose deadline passed; run again in `every` s while any connection is open.

    A deadline is kept to within `every`: a quarter of the shorter timeout, 1 s at most.
    """
    now = time.monotonic()
    try:
        for conn in list(server_state.connections):
            deadline, write_deadline = getattr(conn, "deadline", 0.0), getattr(conn, "write_deadline", 0.0)
            try:
                if deadline and deadline <= now:
                    conn.deadline = 0.0
                    conn.too_slow()
                if write_deadline and write_deadline <= now:
                    conn.write_deadline = 0.0
                    conn._reader_too_slow()
            except Exception:  # one connection's failure must not end the deadlines of all the others
                log.exception("closing a connection past its deadline failed")
    finally:
        again = server_state.connections
        server_state.deadline_sweep = loop.call_later(every, _sweep, loop, server_state, every) if again else None
