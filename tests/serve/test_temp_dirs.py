"""The folders a server owns (`serve.runtime.temp_dirs`): removed at exit, and by the next server after a kill."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serve.runtime.temp_dirs import LOCK, OwnedTempDir
from tests.helpers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
HOLD = (
    "import sys; from pathlib import Path; from serve.runtime.temp_dirs import OwnedTempDir\n"
    "d = OwnedTempDir('vitscope-ui-', Path(sys.argv[1])); print(d.path, flush=True); sys.stdin.read()"
)


def holder(parent: Path) -> tuple[subprocess.Popen, Path]:
    """A process holding a folder of its own under `parent`, until its stdin closes (or it is killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(parent)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    folder = Path(proc.stdout.readline().strip())
    assert folder.parent == parent and folder.is_dir(), f"the holder said {folder}"
    return proc, folder


def test_a_killed_owners_folder_goes_with_the_next_one_and_a_live_owners_stays(tmp_path):
    live, live_folder = holder(tmp_path)
    dead, dead_folder = holder(tmp_path)
    try:
        (dead_folder / "upload.png").write_bytes(b"an upload the killed server held")
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        foreign = tmp_path / "vitscope-ui-not-ours"  # another program's folder: no lock file in it
        foreign.mkdir()
        assert dead_folder.is_dir()  # a SIGKILL removes nothing

        mine = OwnedTempDir("vitscope-ui-", tmp_path)
        assert not dead_folder.exists()
        assert live_folder.is_dir() and (live_folder / LOCK).is_file() and foreign.is_dir()
        view = OwnedTempDir("vitscope-view-", tmp_path)  # another prefix: the live folder stays
        assert view.path.is_dir() and live_folder.is_dir()
        view.remove()
        mine.remove()
        mine.remove()  # twice: nothing more
        assert not mine.path.exists()
    finally:
        live.stdin.close()
        live.wait(10)
    assert live.returncode == 0 and live_folder.is_dir()  # an owner that ended without `remove`: the next one's
    OwnedTempDir("vitscope-ui-", tmp_path).remove()
    assert not live_folder.exists() and sorted(p.name for p in tmp_path.iterdir()) == [foreign.name]


def test_a_planted_link_or_a_lock_that_is_no_file_is_left_alone(tmp_path):
    """In a shared /tmp, another user may name a link or a folder like ours: the sweep neither follows the link
    nor opens a FIFO named `.lock` (an open that would wait for a writer)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / LOCK).touch()  # an unlocked lock, as a dead server leaves it
    (tmp_path / "vitscope-ui-link").symlink_to(elsewhere)
    fifo = tmp_path / "vitscope-ui-fifo"
    fifo.mkdir()
    os.mkfifo(fifo / LOCK)
    OwnedTempDir("vitscope-ui-", tmp_path).remove()
    assert (elsewhere / LOCK).is_file() and (tmp_path / "vitscope-ui-link").is_symlink() and fifo.is_dir()


def test_the_uis_clean_up_of_stale_partial_files_keeps_the_lock(tmp_path):
    """The UI deletes files left in its folder for --ui-cache-s; the lock is as old as the server, and without it
    the folder of a server killed after its first hour was never removed."""
    from serve.server.ui.http import folder_size

    owned = OwnedTempDir("vitscope-ui-", tmp_path)
    partial = owned.path / "partial-upload"
    partial.write_bytes(b"a client left mid-body")
    hour_ago = time.time() - 3600
    for path in (partial, owned.path / LOCK):
        os.utime(path, (hour_ago, hour_ago))
    assert folder_size(str(owned.path), stale_s=60) == 0
    assert not partial.exists() and (owned.path / LOCK).is_file()
    owned.remove()
    assert not owned.path.exists()


def test_a_folder_removed_under_its_server_stops_nothing(tmp_path):
    """A clean-up of /tmp (or an operator) removed the folder first: the server's exit became a traceback."""
    owned = OwnedTempDir("vitscope-ui-", tmp_path)
    shutil.rmtree(owned.path)
    owned.remove()
    OwnedTempDir("vitscope-ui-", tmp_path).remove()  # and its lock is let go


@pytest.mark.slow
def test_the_ui_folder_of_a_killed_server_is_removed_by_the_next_server(tiny_onnx, tmp_path):
    """vit-serve keeps the UI's uploads in a folder of its own: a SIGKILL (an orchestrator's after the grace
    period, the OOM killer) left it behind, uploads and all, once per restart."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    first = ServerProcess(tiny_onnx, "--no-ui", env=env).wait_ready()
    folder = next(tmp_path.glob("vitscope-ui-*"))
    (folder / "upload.png").write_bytes(b"an upload the killed server held")
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert folder.is_dir()
    with ServerProcess(tiny_onnx, "--no-ui", env=env) as second:
        assert not folder.exists()
        (own,) = tmp_path.glob("vitscope-ui-*")
    assert second.proc.returncode == 0 and not own.exists()
