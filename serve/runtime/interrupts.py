"""SIGTERM handled as Ctrl-C: `timeout`, systemd and a pod's stop send it, and a command ends as a person's Ctrl-C
would end it (its clean-up run, its one line said) instead of being killed mid-write.

    with sigterm_as_interrupt():
        run_the_job()          # SIGTERM raises Terminated, a KeyboardInterrupt, here
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_INTERRUPTED = 128 + 2  # what a shell reports for a process ended by SIGINT (Ctrl-C)
EXIT_TERMINATED = 128 + 15  # and by SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be, so that a command stops the same way."""


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """The exit status a shell would report for the signal behind `interrupt`."""
    return EXIT_TERMINATED if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED


def _terminate(signum, frame) -> None:
    raise Terminated("terminated")


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the block runs, SIGTERM raises `Terminated`; the handler before it is put back after."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set a handler
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
