"""The access log: one line per request on the `vitscope.access` logger, written by a thread of logging's own.

The event loop only puts the line's fields on a queue; a `logging.handlers.QueueListener` thread makes the
log record, formats it and writes it with the root logger's handlers, so a slow stderr never holds up a
request, and the listener drains the queue in bursts (`FLUSH_S`) rather than waking once a request. Both
halves of the work count on 2 cores: the stock `Logger.info` + `QueueHandler` on the loop and a wake-up per
line cost the sample model a measurable share of its requests per second (`benchmarks.serve_ab`). Lines are
written only while `vitscope.access` logs INFO (not with `--log-level warning`). HTTP and gRPC share
`ACCESS_LOG`: a second instance would add a second listener, and every line would be written twice.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from logging.handlers import QueueListener

log = logging.getLogger("vitscope.access")
FORMAT = '%s "%s %s" %s %.1fms id=%s'
FLUSH_S = 0.1  # once the queue is empty, the listener sleeps this long: lines reach the log at most this late


class _Listener(QueueListener):
    """Turns the queued (time, fields) into `vitscope.access` records and hands them to the handlers."""

    def prepare(self, item: tuple[float, tuple]) -> logging.LogRecord:
        created, args = item
        record = log.makeRecord(log.name, logging.INFO, __file__, 0, FORMAT, args, None)
        record.created, record.msecs = created, (created % 1) * 1000  # when the request ended, not now
        return record

    def dequeue(self, block: bool):
        try:
            return self.queue.get_nowait()
        except queue.Empty:  # drained: a busy server's lines wait a little and go out as one burst
            time.sleep(FLUSH_S)
            return self.queue.get(block)


class AccessLog:
    """Writes `client "METHOD path" status 1.2ms id=...` lines through a queue and a listener thread (gRPC calls:
    `client "gRPC /inference.GRPCInferenceService/ModelInfer" OK 1.2ms id=...`)."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.listener: QueueListener | None = None
        self.lock = threading.Lock()  # HTTP and gRPC write from two threads: one listener

    def write(self, client: str, method: str, path: str, status: int | str, ms: float, request_id: str) -> None:
        """One request's line; the listener thread starts with the first one (after logging is configured)."""
        if not log.isEnabledFor(logging.INFO):
            return
        if self.listener is None:
            with self.lock:
                if self.listener is None:
                    self._start()
        self.queue.put_nowait((time.time(), (client, method, path, status, ms, request_id)))

    def _start(self) -> None:
        # the listener writes with whatever handlers the root logger has (vit-serve's basicConfig: stderr)
        self.listener = _Listener(self.queue, *logging.getLogger().handlers, respect_handler_level=True)
        self.listener.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """Write what is still queued and stop the thread."""
        if self.listener is not None:
            self.listener.stop()
            self.listener = None  # a restart in the same process starts its own again


ACCESS_LOG = AccessLog()  # the process's one: HTTP requests and gRPC calls write through the same queue and thread
