"""The UI folder's disk check against a real server and real files: how often it walks, what it counts, and what
it removes (emptied hash folders, the partial files of failed and dropped uploads)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from serve.server.ui.http import WALK_EVERY_S
from tests.helpers import ServerProcess, wait_until

BUDGET = 3_000_000  # --ui-cache-bytes
HOURS_AGO = time.time() - 2 * 3600


@pytest.fixture(scope="module")
def server(tiny_onnx):
    args = ["--examples-dir", "", "--graceful-timeout-s", "3", "--max-bytes", "1000000", "--body-timeout-s", "2"]
    with ServerProcess(tiny_onnx, *args, "--ui-cache-bytes", str(BUDGET)) as s:
        yield s


def upload(server, data: bytes = b"tiny", name: str = "a.bin") -> httpx.Response:
    return httpx.post(server.url + "/gradio_api/upload", files={"files": (name, data)}, timeout=30)


@pytest.fixture
def folder(server) -> Path:
    r = upload(server)
    assert r.status_code == 200, r.text
    return next(p for p in Path(r.json()[0]).parents if p.name.startswith("vitscope-ui-"))


def partials(folder: Path) -> set[Path]:
    return {p for p in folder.iterdir() if p.is_file() and p.name.startswith("tmp")}


def stale_partial(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_bytes(b"left by a client that went away")
    os.utime(path, (HOURS_AGO, HOURS_AGO))
    return path


@pytest.mark.slow
def test_the_disk_check_walks_the_folder_now_and_then_not_for_every_request(server, folder):
    """Each UI request walked the whole folder on the event loop: 0.1 s a request with 11,000 entries, and the
    API's requests waited behind it. A walk removes a stale partial file: one planted right after a walk outlives
    a burst of uploads sent sooner than the next walk is due."""

    def walked(first: Path) -> float | None:  # when the upload whose check walked the folder was sent
        sent = time.monotonic()
        assert upload(server).status_code == 200
        return None if first.exists() else sent

    for _ in range(5):  # a busy host may take longer than a walk's interval for the burst: then once more
        first = stale_partial(folder, "tmp-first")
        started = wait_until(lambda: walked(first), 10, "a walk removing the stale partial file")  # noqa: B023
        second = stale_partial(folder, "tmp-second")
        codes = [upload(server).status_code for _ in range(5)]
        if time.monotonic() - started < WALK_EVERY_S:
            break
    else:
        pytest.skip(f"five bursts of uploads each took over {WALK_EVERY_S} s: the host is too busy to time the walks")
    assert codes == [200] * 5 and second.exists(), "the folder was walked again within its interval"
    big = folder / ("0" * 64) / "big.bin"  # the folder over its budget, as files the UI wrote would take it
    big.parent.mkdir()
    big.write_bytes(os.urandom(BUDGET))
    try:
        wait_until(lambda: upload(server).status_code == 507, 10, "a 507 once the next walk counts the big file")
        r = upload(server)
        assert r.status_code == 507 and "--ui-cache-bytes" in r.json()["error"]["message"], r.text
    finally:
        big.unlink()
    wait_until(lambda: upload(server).status_code == 200, 10, "uploads taken again once the file is gone")


@pytest.mark.slow
def test_the_check_counts_the_blocks_files_take_and_emptied_hash_folders_go(server, folder):
    """An 8-byte upload was counted as 8 bytes while it took a block and its hash folder another (5,000 uploads:
    40 kB counted, 41.5 MB on disk), and the hash folders that Gradio's clean-up emptied stayed for good."""
    made = [folder / f"{i:064x}" for i in range(1, 401)]
    for sub in made:  # 400 uploads of 8 bytes: 3.2 kB of data, 3.3 MB of blocks, past the 3 MB budget
        sub.mkdir()
        (sub / "a.bin").write_bytes(b"8 bytes!")
    try:
        wait_until(lambda: upload(server).status_code == 507, 10, "a 507 once a walk counts the blocks")
    finally:
        for sub in made:
            (sub / "a.bin").unlink()
            os.utime(sub, (HOURS_AGO, HOURS_AGO))  # as Gradio's clean-up leaves them, an hour on
    wait_until(lambda: upload(server).status_code == 200 and not any(p.exists() for p in made), 10, "them gone")


def drop_midway(server, declared: int, sent: int) -> None:
    """An upload that declares `declared` bytes, sends `sent` and closes its connection."""
    head = "POST /gradio_api/upload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=b\r\n"
    part = b'--b\r\nContent-Disposition: form-data; name="files"; filename="a.bin"\r\n\r\n'
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(f"{head}Content-Length: {declared}\r\n\r\n".encode() + part + bytes(sent))
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(30)
        conn.recv(1)  # the server closes it once it sees the body end short


@pytest.mark.slow
def test_failed_and_dropped_uploads_give_their_room_back_in_seconds(server, folder):
    """Partial files counted until --ui-cache-s (an hour) went by: clients that declared 10 MB, sent 5 and left
    filled the budget in seconds and every upload got 507 for the hour; an upload named `..` got 400, and its
    file stayed as long. They now go once unchanged for twice --body-timeout-s (here 2 s), past which no upload is
    still being written."""
    before = partials(folder)
    for _ in range(3):
        drop_midway(server, 1_000_000, 900_000)
    r = upload(server, bytes(100), name="..")
    assert r.status_code == 400, r.text
    assert partials(folder) - before, "the dropped uploads left no partial file to test with"
    big = bytes(900_000)  # with 2.7 MB of partials in the folder, it does not fit
    wait_until(lambda: upload(server, big).status_code == 200, 15, "room for an upload once the partials go")
    wait_until(lambda: upload(server).status_code == 200 and not partials(folder), 15, "the partial files removed")
