"""The access log: one line per request on the `vitscope.access` logger, written by a thread of logging's own.

The event loop only puts the record on a queue (`logging.handlers.QueueHandler`); a `QueueListener`
thread formats it and writes it with the root logger's handlers, so a slow stderr never holds up a
request. Lines are written only while `vitscope.access` logs INFO (not with `--log-level warning`). HTTP
and gRPC share `ACCESS_LOG`: a second instance would add a second handler, and every line would be written twice.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from logging.handlers import QueueHandler, QueueListener

log = logging.getLogger("vitscope.access")


class _DeferredQueueHandler(QueueHandler):
    """A QueueHandler that leaves the formatting to the listener's thread: the stock `prepare` formats the
    message on the caller's thread (the event loop), which is the work the queue is there to move off it."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


class AccessLog:
    """Writes `client "METHOD path" status 1.2ms id=...` lines through a queue and a listener thread (gRPC calls:
    `client "gRPC /inference.GRPCInferenceService/ModelInfer" OK 1.2ms id=...`)."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.listener: QueueListener | None = None
        self.lock = threading.Lock()  # HTTP and gRPC write from two threads: one listener, one handler
        self.handler: QueueHandler | None = None

    def write(self, client: str, method: str, path: str, status: int | str, ms: float, request_id: str) -> None:
        """One request's line; the listener thread starts with the first one (after logging is configured)."""
        if not log.isEnabledFor(logging.INFO):
            return
        if self.listener is None:
            with self.lock:
                if self.listener is None:
                    self._start()
        log.info('%s "%s %s" %s %.1fms id=%s', client, method, path, status, ms, request_id)

    def _start(self) -> None:
        # the listener writes with whatever handlers the root logger has (vit-serve's basicConfig: stderr)
        self.listener = QueueListener(self.queue, *logging.getLogger().handlers, respect_handler_level=True)
        self.listener.start()
        self.handler = _DeferredQueueHandler(self.queue)
        log.addHandler(self.handler)
        log.propagate = False  # written once, by the listener, not a second time on the loop
        atexit.register(self.stop)

    def stop(self) -> None:
        """Write what is still queued and stop the thread."""
        if self.listener is not None:
            self.listener.stop()
            self.listener = None
            log.removeHandler(self.handler)  # a restart in the same process adds its own again


ACCESS_LOG = AccessLog()  # the process's one: HTTP requests and gRPC calls write through the same queue and thread
