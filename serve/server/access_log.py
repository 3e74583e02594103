"""The access log: one line per request on the `vitscope.access` logger, written by a thread of logging's own.
While `vit-serve` runs, every other log line goes through the same queue and thread (`logging_off_the_loop`).

The event loop only puts the line's fields on a queue; a `logging.handlers.QueueListener` thread makes the
log record, formats it and writes it with the root logger's handlers (each burst of lines in one write, see
`_BurstHandler`), so a slow stderr never holds up a request, and the listener drains the queue in bursts
(`FLUSH_S`) rather than waking once a request. Both
halves of the work count on 2 cores: the stock `Logger.info` + `QueueHandler` on the loop and a wake-up per
line cost the sample model a measurable share of its requests per second (`benchmarks.serve_ab`). Lines are
written only while `vitscope.access` logs INFO (not with `--log-level warning`). HTTP and gRPC share
`ACCESS_LOG`: a second instance would add a second listener, and every line would be written twice. At most
`MAX_LINES` lines wait: past that (a stderr piped to a reader that stopped) lines are dropped, and the listener
says how many once it writes again, so a stalled log costs bounded memory.

Every field a client chooses (the path, the method, a request ID) has its control characters written as `\\xNN`
(and Unicode's line separators as `\\uNNNN`), so that `%0a` in a URL cannot end the line and forge another,
nor an escape sequence rewrite a terminal. The quote and the backslash are written as `\\x22` and `\\x5c` too:
`%22` would close the quoted request field early, and a literal `\\x0a` in a URL would read as an escaped
newline. So every line parses one way only. The listener thread does it, off the event loop.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from logging.handlers import QueueHandler, QueueListener

from serve.runtime.terminal import CONTROL_ESCAPES

log = logging.getLogger("vitscope.access")
FORMAT = '%s "%s %s" %s %.1fms id=%s'
FLUSH_S = 0.1  # once the queue is empty, the listener sleeps this long: lines reach the log at most this late
MAX_LINES = 10_000  # lines waiting for a log that cannot keep up (a few MB); more are dropped, and counted
ESCAPES = CONTROL_ESCAPES | {c: f"\\x{c:02x}" for c in b'"\\'}  # also the field's quote, and the escape character


def escaped(field: object) -> object:
    """`field` with its control characters, quotes and backslashes written out (`\\x0a`), so that it stays on its
    line and in its field; not a str: as is."""
    if isinstance(field, str) and not (field.isprintable() and '"' not in field and "\\" not in field):
        return field.translate(ESCAPES)  # the common case costs three C scans and no copy
    return field


class _Listener(QueueListener):
    """Turns the queued (time, fields) into `vitscope.access` records and hands them to the handlers, which
    write each burst of lines with one flush (`burst_writer`); says how many lines were dropped, once it can."""

    def __init__(self, access: AccessLog, *handlers: logging.Handler):
        super().__init__(access.queue, *handlers, respect_handler_level=True)
        self.access = access

    def handle(self, record: logging.LogRecord) -> None:
        written = getattr(record, "written", None)
        if written is not None:  # `AccessLog.drain`'s marker: everything before it is written
            self.flush()
            return written.set()
        self.note_drops()
        super().handle(record)

    def note_drops(self) -> None:
        dropped = self.access.take_dropped()
        if dropped:
            message = "%s log lines dropped: the log did not take them as fast as they came"
            record = log.makeRecord(log.name, logging.WARNING, __file__, 0, message, (f"{dropped:,}",), None)
            for handler in self.handlers:  # as they are: `prepare` is for the queued fields
                if record.levelno >= handler.level:
                    handler.handle(record)

    def prepare(self, item: tuple[float, tuple] | logging.LogRecord) -> logging.LogRecord:
        if isinstance(item, logging.LogRecord):  # any other line (`QueuedHandler`): as it came
            return item
        created, args = item
        args = tuple(map(escaped, args))
        record = log.makeRecord(log.name, logging.INFO, __file__, 0, FORMAT, args, None)
        record.created, record.msecs = created, (created % 1) * 1000  # when the request ended, not now
        return record

    def dequeue(self, block: bool):
        try:
            return self.queue.get_nowait()
        except queue.Empty:  # drained: a busy server's lines wait a little and go out as one burst
            self.note_drops()
            self.flush()
            time.sleep(FLUSH_S)
            return self.queue.get(block)

    def flush(self) -> None:
        for handler in self.handlers:
            handler.flush()

    def stop(self) -> None:
        super().stop()
        self.note_drops()
        self.flush()


class _BurstHandler(logging.StreamHandler):
    """A root handler's format and stream, written once per burst rather than once per line.

    `StreamHandler` flushes after every record, and stderr is line-buffered: each access-log line was a write
    of its own, each letting go of the interpreter lock, which the event loop then waited to get back (the
    sample's server answered about a tenth fewer requests per second with the access log on; `benchmarks.serve_ab`
    with and without `--log-level warning`). This one writes into a block buffer over the same file and flushes
    when the listener has drained the queue.
    """

    def __init__(self, like: logging.StreamHandler):
        stream = like.stream
        buffered = open(os.dup(stream.fileno()), "w", buffering=1 << 16, encoding=getattr(stream, "encoding", None))
        super().__init__(buffered)
        self.setFormatter(like.formatter)
        self.setLevel(like.level)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + self.terminator)  # no flush: the listener's, per burst
        except Exception:
            self.handleError(record)


def burst_writer(handler: logging.Handler) -> logging.Handler:
    """`handler` as a `_BurstHandler` when it writes to a file descriptor (stderr, a log file), else as it is."""
    if not isinstance(handler, logging.StreamHandler):
        return handler
    try:
        return _BurstHandler(handler)
    except (AttributeError, OSError, ValueError):  # no file descriptor behind it (a test's capture, a closed file)
        return handler


class AccessLog:
    """Writes `client "METHOD path" status 1.2ms id=...` lines through a queue and a listener thread (gRPC calls:
    `client "gRPC /inference.GRPCInferenceService/ModelInfer" OK 1.2ms id=...`)."""

    def __init__(self, max_lines: int = MAX_LINES):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.max_lines, self.dropped = max_lines, 0
        self.listener: QueueListener | None = None
        self.lock = threading.Lock()  # HTTP and gRPC write from two threads: one listener, one drop count

    def write(self, client: str, method: str, path: str, status: int | str, ms: float, request_id: str) -> None:
        """One request's line; the listener thread starts with the first one (after logging is configured)."""
        if log.isEnabledFor(logging.INFO):
            self.put((time.time(), (client, method, path, status, ms, request_id)))

    def put(self, item: tuple[float, tuple] | logging.LogRecord) -> None:
        """Queue a line's fields, or any other log record (`QueuedHandler`), for the thread to write."""
        if self.listener is None:
            self.start()
        if self.queue.qsize() >= self.max_lines:  # the log does not keep up (a stalled stderr): memory stays bounded
            with self.lock:
                self.dropped += 1
            return
        self.queue.put_nowait(item)

    def drain(self, timeout: float) -> bool:
        """Wait until every line queued so far is written (at most `timeout` seconds: the log may be stalled)."""
        if self.listener is None:
            return True
        marker = logging.makeLogRecord({"written": threading.Event()})
        self.queue.put_nowait(marker)  # past the bound: one small record
        return marker.written.wait(timeout)

    def take_dropped(self) -> int:
        """The lines dropped since the last call."""
        with self.lock:
            dropped, self.dropped = self.dropped, 0
        return dropped

    def start(self) -> None:
        """Start the thread now, with the root logger's handlers as they are (else the first line starts it)."""
        with self.lock:
            if self.listener is None:
                self._start()

    def _start(self) -> None:
        # the listener writes with whatever handlers the root logger has (vit-serve's basicConfig: stderr)
        handlers = [burst_writer(h) for h in logging.getLogger().handlers if not isinstance(h, QueuedHandler)]
        self.listener = _Listener(self, *handlers)
        self.listener.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """Write what is still queued and stop the thread."""
        if self.listener is not None:
            self.listener.stop()
            self.listener = None  # a restart in the same process starts its own again


ACCESS_LOG = AccessLog()  # the process's one: HTTP requests and gRPC calls write through the same queue and thread


class QueuedHandler(QueueHandler):
    """logging's `QueueHandler` (the message and any traceback formatted here, the arguments dropped) onto
    `access`'s queue, within its bound, for its thread to write in the root handler's format."""

    def __init__(self, access: AccessLog):
        super().__init__(access.queue)
        self.access = access

    def enqueue(self, record: logging.LogRecord) -> None:
        self.access.put(record)


@contextmanager
def logging_off_the_loop(access: AccessLog = ACCESS_LOG) -> Iterator[None]:
    """While the server runs, every log line (ours, uvicorn's, gRPC's) is written by `access`'s thread, within its
    bound: a line written on the event loop to a stderr piped to a reader that stopped (a full pipe) blocked the loop,
    and with it every request and /healthz (about 1,500 malformed requests, each a uvicorn warning, were enough).
    uvicorn's lines take the root handler's format, with the time. On leaving, what is queued is written.
    """
    root, uvicorn_log = logging.getLogger(), logging.getLogger("uvicorn")
    saved = root.handlers[:], uvicorn_log.handlers[:], uvicorn_log.propagate
    access.start()  # with the root handlers as they are
    root.handlers[:], uvicorn_log.handlers[:], uvicorn_log.propagate = [QueuedHandler(access)], [], True
    try:
        yield
    finally:
        root.handlers[:], uvicorn_log.handlers[:], uvicorn_log.propagate = saved
        access.stop()
