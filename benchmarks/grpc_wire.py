"""`grpc_load`: unary gRPC calls of one prebuilt message, written straight onto an HTTP/2 connection.

The HTTP load generator (`benchmarks.servers.http_load`) posts prebuilt bytes and reads no more than the
status line and Content-Length: 31-36 µs of its own CPU per request. grpc.aio's client cost 245-270 µs per
call, this one 56-62 µs (3-second runs of each in turn against vit-serve on the sample's architecture, 16 in
flight, 2-core VM, 2026-12-03; 58-80 µs in serve_peers' rounds once each call also carried the headers below).
On a 2-core machine the client's CPU comes out of the server being measured:
with grpc.aio's client, gRPC read 0.84x HTTP v2 for the client's sake rather than the server's. This one is
the HTTP one's gRPC twin: one HTTP/2 connection (as one grpc channel), `concurrency` streams in flight, each
a HEADERS frame encoded once (HPACK literals, no dynamic table) and the message's DATA frames, with HTTP/2's
flow control, SETTINGS and PING acknowledged as the protocol asks.

A call counts as answered when its stream brought a DATA frame (the response message) and then its trailers
(HEADERS ending the stream); a gRPC error is a trailers-only answer with no message, or a reset stream.
Nothing is decoded beyond frame headers, so the grpc-status of an answer that carried a message is not read:
this assumes what vit-serve does, that a unary call which sent its message has succeeded (gRPC allows a message
then an error; `tests/serve/test_grpc.py` checks the count against the server's own metrics). Each call sends
what grpcio's client sends beside the message: a deadline (`grpc-timeout`, 30 s), user-agent and accepted
encodings.
"""

from __future__ import annotations

import asyncio
import struct
import time

from benchmarks.servers import load_summary, run_loop

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 0x4, 0x5  # SETTINGS parameters
CANCEL = 0x8  # RST_STREAM's error code for a call given up
BIG_WINDOW = 2**31 - 1
DEFAULT_MAX_FRAME = 16_384
CALL_FIELDS = {"grpc-timeout": "30S", "user-agent": "vitscope-bench grpc-wire", "grpc-accept-encoding": "identity"}


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream ID, payload (RFC 9113, 4.1)."""
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def hpack_int(value: int, prefix: int, first: int = 0) -> bytes:
    """An HPACK integer in a `prefix`-bit prefix, the first byte's other bits `first` (RFC 7541, 5.1)."""
    top = (1 << prefix) - 1
    if value < top:
        return bytes([first | value])
    out, value = [first | top], value - top
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes([*out, value])


def header_block(method: str, authority: str, metadata: dict[str, str] | None = None) -> bytes:
    """The request's headers as HPACK literals without indexing (no Huffman, no dynamic table): the same bytes
    for every call. Static-table indices (RFC 7541, appendix A): :method POST 3, :scheme http 6, :path 4,
    :authority 1, content-type 31; `metadata` (an API key, say) follows as new names.

    Raises:
        ValueError: the block does not fit in one frame (no CONTINUATION frames here).
    """

    def string(text: str) -> bytes:
        return hpack_int(len(text.encode()), 7) + text.encode()

    def literal(index: int, value: str) -> bytes:  # the name from the static table
        return hpack_int(index, 4) + string(value)

    fields = {**CALL_FIELDS, **{k.lower(): v for k, v in (metadata or {}).items()}, "te": "trailers"}
    new = b"".join(b"\x00" + string(k) + string(v) for k, v in fields.items())
    block = b"\x83\x86" + literal(4, method) + literal(1, authority) + literal(31, "application/grpc") + new
    if len(block) > DEFAULT_MAX_FRAME:
        raise ValueError(
            f"the request headers take {len(block)} bytes, more than one frame holds ({DEFAULT_MAX_FRAME})"
        )
    return block


class GrpcLoadConnection(asyncio.Protocol):
    """One HTTP/2 connection keeping `concurrency` calls of the prebuilt `message` in flight until `end`."""

    def __init__(self, headers: bytes, message: bytes, concurrency: int, end: float, stats: dict,
                 done: asyncio.Future):  # fmt: skip
        self.headers = headers
        self.body = b"\x00" + struct.pack(">I", len(message)) + message  # gRPC's length-prefixed message
        self.concurrency, self.end, self.stats, self.done = concurrency, end, stats, done
        self.buf = bytearray()
        self.next_id = 1
        self.started: dict[int, float] = {}  # stream -> when its call was sent
        self.answered: set[int] = set()  # streams that brought a message
        self.pending: list[list[int]] = []  # [stream, how much of its body is sent], in order
        self.send_window, self.stream_windows = 65_535, {}  # what the server lets us send (RFC 9113, 6.9)
        self.initial_window, self.max_frame = 65_535, DEFAULT_MAX_FRAME  # until the server's SETTINGS say otherwise
        self.received = 0  # DATA bytes since the connection window was last topped up
        self.closing = False  # the server sent GOAWAY: no new calls

    def connection_made(self, transport):
        self.transport = transport
        settings = struct.pack(">HI", INITIAL_WINDOW_SIZE, BIG_WINDOW)  # answers never wait on our window
        transport.write(PREFACE + frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", BIG_WINDOW - 65_535)))  # fmt: skip
        for _ in range(self.concurrency):
            self.call()

    def call(self) -> None:
        if self.closing or time.perf_counter() >= self.end:
            if not self.started:
                self.transport.close()
            return
        stream, self.next_id = self.next_id, self.next_id + 2
        self.started[stream] = time.perf_counter()
        self.stream_windows[stream] = self.initial_window
        self.transport.write(frame(HEADERS, END_HEADERS, stream, self.headers))
        self.pending.append([stream, 0])
        self.flush()

    def flush(self) -> None:
        """Send what the windows allow of the pending bodies, in order, each ending its stream."""
        while self.pending and self.send_window > 0:
            entry = self.pending[0]
            stream, sent = entry
            n = min(len(self.body) - sent, self.send_window, self.stream_windows.get(stream, 0), self.max_frame)
            if n <= 0:
                return
            entry[1] += n  # slices of the one body: a large message is not copied again for every frame
            self.send_window -= n
            self.stream_windows[stream] -= n
            last = entry[1] == len(self.body)
            self.transport.write(frame(DATA, END_STREAM if last else 0, stream, self.body[sent : sent + n]))
            if last:
                self.pending.pop(0)

    def finish(self, stream: int, ok: bool, reset: bool = False) -> None:
        """The call on `stream` is over (`ok`: its trailers came; `reset`: the server reset it): count it, start the
        next one."""
        started = self.started.pop(stream, None)
        self.stream_windows.pop(stream, None)
        if started is None:
            return
        unsent = [e for e in self.pending if e[0] == stream]
        if unsent:  # answered before its whole body was sent (a refusal): give the rest up
            self.pending.remove(unsent[0])
            if not reset:
                self.transport.write(frame(RST_STREAM, 0, stream, struct.pack(">I", CANCEL)))
        if ok and stream in self.answered:
            self.stats["latencies"].append(time.perf_counter() - started)
        else:
            self.stats["errors"] += 1
        self.answered.discard(stream)
        self.call()

    def data_received(self, data: bytes):
        self.buf += data
        while len(self.buf) >= 9 and not self.transport.is_closing():
            length = int.from_bytes(self.buf[:3], "big")
            if len(self.buf) < 9 + length:
                return
            kind, flags, stream = self.buf[3], self.buf[4], int.from_bytes(self.buf[5:9], "big") & 0x7FFF_FFFF
            payload = bytes(self.buf[9 : 9 + length])
            del self.buf[: 9 + length]
            self.on_frame(kind, flags, stream, payload)

    def on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == DATA:
            self.received += len(payload)
            if self.received > BIG_WINDOW // 2:
                self.transport.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.received)))
                self.received = 0
            if payload:
                self.answered.add(stream)
            if flags & END_STREAM:  # a gRPC answer ends with its trailers, never with its message
                self.finish(stream, False)
        elif kind == HEADERS and flags & END_STREAM:  # the trailers (or a trailers-only error)
            self.finish(stream, True)
        elif kind == RST_STREAM:
            self.finish(stream, False, reset=True)
        elif kind == SETTINGS and not flags & ACK:
            for at in range(0, len(payload) - 5, 6):
                key, value = struct.unpack_from(">HI", payload, at)
                if key == INITIAL_WINDOW_SIZE:
                    for s in self.stream_windows:
                        self.stream_windows[s] += value - self.initial_window
                    self.initial_window = value
                elif key == MAX_FRAME_SIZE:
                    self.max_frame = value
            self.transport.write(frame(SETTINGS, ACK, 0))
            self.flush()
        elif kind == PING and not flags & ACK:
            self.transport.write(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            increment = int.from_bytes(payload[:4], "big") & 0x7FFF_FFFF
            if stream == 0:
                self.send_window += increment
            elif stream in self.stream_windows:
                self.stream_windows[stream] += increment
            self.flush()
        elif kind == GOAWAY:  # calls up to its last stream ID are still answered; later ones never will be
            last, self.closing = int.from_bytes(payload[:4], "big") & 0x7FFF_FFFF, True
            for s in [s for s in self.started if s > last]:
                self.finish(s, False)
            if not self.started:
                self.transport.close()

    def connection_lost(self, exc):
        self.stats["errors"] += len(self.started)  # calls the connection took with it
        self.started.clear()
        if not self.done.done():
            self.done.set_result(None)


async def _grpc_load(port: int, method: str, message: bytes, concurrency: int, seconds: float, metadata) -> dict:
    loop = asyncio.get_running_loop()
    stats: dict = {"latencies": [], "errors": 0}
    end = time.perf_counter() + seconds
    cpu0, t0 = time.process_time(), time.perf_counter()
    done = loop.create_future()
    headers = header_block(method, f"127.0.0.1:{port}", metadata)
    protocol = lambda: GrpcLoadConnection(headers, message, concurrency, end, stats, done)  # noqa: E731
    transport, connection = await loop.create_connection(protocol, "127.0.0.1", port)
    try:  # a server that stops answering must not hang the benchmark
        await asyncio.wait_for(done, seconds + 60)
    except asyncio.TimeoutError:
        stats["errors"] += len(connection.started)  # each stalled call counts as an error
        connection.started.clear()
        transport.abort()
    return load_summary(stats, time.perf_counter() - t0, time.process_time() - cpu0)


def grpc_load(
    port: int, method: str, message: bytes, concurrency: int, seconds: float, metadata: dict[str, str] | None = None
) -> dict:
    """`concurrency` unary calls of the serialized `message` in flight on one connection for `seconds`, with
    `metadata`, reported as `benchmarks.servers.http_load` reports its requests (calls answered with a message,
    errors, rps, the client's CPU µs per call, latencies)."""
    return run_loop(_grpc_load(port, method, message, concurrency, seconds, metadata))
