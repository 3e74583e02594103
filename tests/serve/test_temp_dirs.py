"""The folders a server owns (`serve.server.temp_dirs`): removed at exit, and by the next server after a kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from serve.server.temp_dirs import LOCK, OwnedTempDir
from tests.helpers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
HOLD = (
    "import sys; from pathlib import Path; from serve.server.temp_dirs import OwnedTempDir\n"
    "d = OwnedTempDir('vitscope-ui-', Path(sys.argv[1])); print(d.path, flush=True); sys.stdin.read()"
)


def holder(parent: Path) -> tuple[subprocess.Popen, Path]:
    """A process holding a folder of its own under `parent`, until its stdin closes (or it is killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(parent)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    return proc, Path(proc.stdout.readline().strip())


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
        assert OwnedTempDir("vitscope-view-", tmp_path).path.is_dir() and live_folder.is_dir()  # another prefix
        mine.remove()
        mine.remove()  # twice: nothing more
        assert not mine.path.exists()
    finally:
        live.stdin.close()
        live.wait(10)
    assert live.returncode == 0 and live_folder.is_dir()  # an owner that ended without `remove`: the next one's
    OwnedTempDir("vitscope-ui-", tmp_path)
    assert not live_folder.exists()


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
