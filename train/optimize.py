"""`optimizing`: LitData's `optimize` run as one step of `vit-train prepare`, stopped and cleaned up as a command is.

LitData's `optimize` is written for a notebook: it sets a SIGINT handler of its own for good (which ends the
process with exit 0), switches the whole process to spawn, leaves its workers running when its caller stops, and
keeps its temporaries where every other `optimize` on the machine keeps them (`/tmp/chunks`, `/tmp/data`, which
each run empties first, and a pickle of the item list in `/tmp`, left there by a run that was stopped: about 70 kB
per thousand images). The system's temporary folder itself is left as it is: a process-wide setting that other
code (multiprocessing's own folder) caches.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from serve.runtime.temp_dirs import OwnedTempDir

CACHE_FOLDERS = {"DATA_OPTIMIZER_CACHE_FOLDER": "chunks", "DATA_OPTIMIZER_DATA_CACHE_FOLDER": "data"}  # LitData's


@contextmanager
def optimizing() -> Iterator[None]:
    """Around calls of `litdata.optimize`: Ctrl-C left as it was, the start method and LitData's `DATA_OPTIMIZER_*`
    variables put back, the workers it started stopped if the block stops early, and its temporaries in a folder
    of this run's own (`vitscope-prepare-*` in the system's temporary folder, unless `DATA_OPTIMIZER_CACHE_FOLDER`
    or `DATA_OPTIMIZER_DATA_CACHE_FOLDER` name others) or, for its list of the items, removed by name; a run killed
    outright leaves its folder to the next one's sweep."""
    scratch = OwnedTempDir("vitscope-prepare-")  # before anything changes: an unwritable TMPDIR is said as it is
    environ = {k: v for k, v in os.environ.items() if k.startswith("DATA_OPTIMIZER_")}
    method, set_handler = multiprocessing.get_start_method(allow_none=True), signal.signal
    before = set(multiprocessing.active_children())
    try:
        os.environ.update({k: str(scratch.path / f) for k, f in CACHE_FOLDERS.items() if k not in os.environ})
        signal.signal = lambda sig, handler: (
            signal.getsignal(sig) if sig == signal.SIGINT else set_handler(sig, handler)
        )
        yield
    except BaseException:
        stop_workers([c for c in multiprocessing.active_children() if c not in before])
        raise
    finally:
        signal.signal = set_handler
        multiprocessing.set_start_method(method, force=True)  # a fit after it started each loader worker afresh
        for name in [k for k in os.environ if k.startswith("DATA_OPTIMIZER_") and k not in environ]:
            del os.environ[name]
        os.environ.update(environ)
        for items in Path(tempfile.gettempdir()).glob(f"litdata-node-*-items-{os.getpid()}-*.pkl"):
            items.unlink(missing_ok=True)  # a stopped optimize's (a finished one removes its own)
        scratch.remove()


def stop_workers(children: list, grace_s: float = 5.0) -> None:
    """End `children`, the processes LitData's `optimize` started: they outlive a stopped prepare otherwise,
    writing chunks."""
    for child in children:
        child.terminate()
    for child in children:
        child.join(grace_s)
        if child.is_alive():
            child.kill()
            child.join(grace_s)
