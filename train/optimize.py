"""`optimizing`: LitData's `optimize` run as one step of `vit-train prepare`, stopped and cleaned up as a command is.

LitData's `optimize` is written for a notebook: it sets a SIGINT handler of its own for good (which ends the
process with exit 0), switches the whole process to spawn, leaves its workers running when its caller stops, and
keeps its temporaries where every other `optimize` on the machine keeps them (`/tmp/chunks`, `/tmp/data`, which
each run empties first, and a pickle of the item list in `/tmp`, left there by a run that was stopped: about 70 kB
per thousand images).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from serve.runtime.temp_dirs import OwnedTempDir

CACHE_FOLDERS = {"DATA_OPTIMIZER_CACHE_FOLDER": "chunks", "DATA_OPTIMIZER_DATA_CACHE_FOLDER": "data"}  # LitData's


@contextmanager
def optimizing() -> Iterator[None]:
    """Around calls of `litdata.optimize`: Ctrl-C left as it was, the start method put back, the workers stopped
    if the block stops early, and LitData's temporaries in a folder of this run's own (`vitscope-prepare-*` in
    the system's temporary folder, unless `DATA_OPTIMIZER_CACHE_FOLDER` or `DATA_OPTIMIZER_DATA_CACHE_FOLDER` name
    others), removed at the end; a run killed outright leaves it to the next one's sweep."""
    scratch = OwnedTempDir("vitscope-prepare-")
    saved, saved_tempdir = {name: os.environ.get(name) for name in CACHE_FOLDERS}, tempfile.tempdir
    mine = {name: str(scratch.path / folder) for name, folder in CACHE_FOLDERS.items() if name not in os.environ}
    os.environ.update(mine)  # read by LitData's workers too; a folder the user chose is kept
    tempfile.tempdir = str(scratch.path)  # the item list's pickle
    method = multiprocessing.get_start_method(allow_none=True)
    set_handler = signal.signal
    signal.signal = lambda sig, handler: signal.getsignal(sig) if sig == signal.SIGINT else set_handler(sig, handler)
    try:
        yield
    except BaseException:
        stop_workers()
        raise
    finally:
        signal.signal = set_handler
        multiprocessing.set_start_method(method, force=True)  # a fit after it started each loader worker afresh
        tempfile.tempdir = saved_tempdir
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        scratch.remove()


def stop_workers(grace_s: float = 5.0) -> None:
    """End the processes LitData's `optimize` started (they outlive a stopped prepare otherwise, writing chunks)."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(grace_s)
        if child.is_alive():
            child.kill()
