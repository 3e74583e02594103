"""`GrpcServer`: the gRPC service on a port of its own, on an event loop in a thread of its own.

The HTTP server's event loop is uvicorn's; gRPC's asyncio server runs on a second loop (uvloop's, as
uvicorn's, where it is installed) in its own thread, so neither protocol's work waits in the other's queue,
and both hand their images to the same `Engine` (its futures are settled on whichever loop made them).

Its limits (`GrpcLimits`, each described in `serve.server.settings`) are gRPC core's own channel arguments, so
a call or a connection past one is refused before any Python runs for it: messages up to `max_bytes` (a larger
one gets RESOURCE_EXHAUSTED before it is decoded), `max_connections` connections (a new one past it is closed at
once), `max_streams` calls per connection, `max_calls` calls in all (RESOURCE_EXHAUSTED at once), idle
connections closed after `idle_timeout_s`, a handshake within `handshake_timeout_s`, and pings without calls
refused (`KEEPALIVE`). Each image's result waits `request_timeout_s` at most, and the client's own deadline is
enforced by gRPC, which cancels the call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass

import grpc

from serve.server.grpc.service import Service

log = logging.getLogger(__name__)
KEEPALIVE = [  # gRPC's own defaults, stated: a client may not keep an idle connection open by pinging it
    ("grpc.keepalive_permit_without_calls", 0),  # a ping on a connection without calls is a strike
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # and so is one sooner than 10 s after the last
    ("grpc.http2.max_ping_strikes", 2),  # the third strike closes the connection (GOAWAY too_many_pings)
]


@dataclass(frozen=True)
class GrpcLimits:
    """What gRPC clients may open, send and hold (each described in `serve.server.settings`)."""

    max_bytes: int
    max_connections: int
    max_streams: int
    max_calls: int
    idle_timeout_s: float
    handshake_timeout_s: float


class GrpcServer:
    """Serves `service` on `host:port` once `start` is called, until `stop`.

    Args:
        service: the RPC handlers.
        host: the interface to bind (the HTTP server's).
        port: the TCP port (0: any free one; `port` holds the bound one after `start`).
        limits: what clients may open, send and hold.
    """

    def __init__(self, service: Service, host: str, port: int, limits: GrpcLimits):
        self.service, self.host, self.port, self.limits = service, host, port, limits
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: grpc.aio.Server | None = None
        self.thread: threading.Thread | None = None
        self.stopped = asyncio.Event()  # set by `stop` once the server has stopped: the loop then ends

    def start(self, timeout: float = 30.0) -> int:
        """Bind and start serving; returns the port. Raises `OSError` when the port cannot be bound."""
        started, failure = threading.Event(), []

        def run() -> None:
            self.loop = new_event_loop()
            try:
                self.loop.run_until_complete(self._serve(started, failure))
            finally:
                self.loop.close()

        self.thread = threading.Thread(target=run, name="vitscope-grpc", daemon=True)
        self.thread.start()
        if not started.wait(timeout):
            raise OSError(f"the gRPC server did not start within {timeout} s")
        if failure:
            where, e = f"{self.host}:{self.port}", failure[0]
            raise OSError(f"cannot serve gRPC on {where}: {e}; free the port or pick another --grpc-port") from e
        log.info("gRPC (inference.GRPCInferenceService) listening on %s:%d", self.host, self.port)
        return self.port

    async def _serve(self, started: threading.Event, failure: list) -> None:
        """Start the server, then wait until `stop` has stopped it. The loop runs this one task to its end, not
        for ever: anyio (`serve.server.threads`) keeps its worker threads for the life of the loop's root task,
        and without one it stopped each thread when its call ended (a new thread for every typed call)."""
        try:
            await self._start()
        except Exception as e:  # e.g. the port is taken: reported to start()'s caller
            failure.append(e)
            # let go of what was made, before `started`: `stop` then finds nothing to stop, and the server,
            # once collected, ends gRPC's asyncio poller thread
            self.server = None
            started.set()
            return
        started.set()
        await self.stopped.wait()

    async def _start(self) -> None:
        self.server = grpc.aio.server(
            options=self.options(),
            maximum_concurrent_rpcs=self.limits.max_calls,
            interceptors=[self.service.key_check()],
        )
        self.server.add_generic_rpc_handlers((self.service.handler(),))
        bound = self.server.add_insecure_port(f"{_bracketed(self.host)}:{self.port}")
        if bound == 0:
            raise OSError(f"port {self.port} is taken or the address is not local")
        self.port = bound
        await self.server.start()

    def options(self) -> list[tuple[str, int]]:
        """gRPC core's channel arguments for `limits`."""
        limits = self.limits
        return [
            ("grpc.max_receive_message_length", limits.max_bytes),
            ("grpc.max_send_message_length", -1),  # answers are small, and never refused by their size
            ("grpc.so_reuseport", 0),  # a port taken by another process fails here rather than sharing it
            # HTTP/2's 64 KiB window, fixed: with probing on, gRPC widens it to several MiB per call, and a client
            # may send that much before the handler (or the key check) reads anything
            ("grpc.http2.bdp_probe", 0),
            ("grpc.max_allowed_incoming_connections", limits.max_connections),
            ("grpc.max_concurrent_streams", limits.max_streams),
            ("grpc.max_connection_idle_ms", round(limits.idle_timeout_s * 1000)),
            ("grpc.server_handshake_timeout_ms", round(limits.handshake_timeout_s * 1000)),
            *KEEPALIVE,
        ]

    def stop(self, grace: float) -> None:
        """Refuse new calls, let those in flight finish for up to `grace` seconds, then stop the thread."""
        if self.loop is None or self.server is None or self.loop.is_closed():
            return
        # The loop runs until the server has stopped: had it ended with the server's termination, it would close
        # under this very call, whose result then never came (each stop waited out grace + 5 s).
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop).result(grace + 5)
        except Exception:  # the loop ended meanwhile: nothing left to stop
            log.debug("gRPC server already stopped", exc_info=True)
        try:
            self.loop.call_soon_threadsafe(self.stopped.set)  # ends `_serve`, and so the loop
        except RuntimeError:  # closed already
            pass
        if self.thread is not None:
            self.thread.join(5)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (uvicorn runs HTTP on it too): gRPC's asyncio server spends less
    CPU a call on it than on the standard library's loop; else the standard one."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
