"""The model repository over a server's life: versions loaded and retired again and again give their memory and
threads back, one bad model never keeps the others from serving, an uncalibrated file serves, a file rewritten
in place is reloaded without a failed request, and the default model stays where start-up put it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.helpers import ServerProcess, rss_mib, wait_until
from tests.serve.test_repository import add_model, drop_version, exported  # noqa: F401 (a fixture)

FAST = ("--no-ui", "--preferred-batch-size", "1", "--graceful-timeout-s", "1")


def threads_of(pid: int) -> int:
    """The number of threads of process `pid` now (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise ProcessLookupError(f"no Threads line for process {pid}")


def draining(pid: int) -> int:
    """How many of process `pid`'s threads are draining a retired version now."""
    return sum((task / "comm").read_text().strip() == "vitscope-drain" for task in Path(f"/proc/{pid}/task").iterdir())


def versions_of(url: str, name: str) -> list[str]:
    """The versions of `name` the server takes requests for now ([] when none)."""
    models = httpx.get(url + "/v2/models", timeout=10).json()["models"]
    return next((m["versions"] for m in models if m["name"] == name), [])


def cycle(url: str, name: str) -> None:
    """Unload `name`, then load it again, through the v2 repository extension."""
    assert httpx.post(f"{url}/v2/repository/models/{name}/unload", timeout=30).status_code == 200
    loaded = httpx.post(f"{url}/v2/repository/models/{name}/load", timeout=60)
    assert loaded.status_code == 200, loaded.text


@pytest.mark.slow
def test_retired_versions_give_their_memory_and_threads_back(exported, tmp_path):  # noqa: F811
    """50 unload/load cycles and 50 rollouts picked up by polling: RSS and threads come back to where they were."""
    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1])
    add_model(repo, exported, "beta", [1])
    model = exported / "alpha" / "1" / "model.onnx"
    with ServerProcess(repo, *FAST, "--repository-poll-s", "0.05") as server:
        pid, url = server.proc.pid, server.url
        for _ in range(5):  # the allocator's and onnxruntime's first growth is not a leak
            cycle(url, "beta")
        wait_until(lambda: not draining(pid), 10, "the retired versions drained")
        threads, rss = threads_of(pid), rss_mib(pid)
        for _ in range(50):
            cycle(url, "beta")
        for version in range(2, 52):
            drop_version(repo / "beta", version, model)
            wait_until(lambda v=str(version): versions_of(url, "beta") == [v], 30, f"beta version {version} serving")
        settled = lambda: not draining(pid) and threads_of(pid) <= threads  # noqa: E731
        wait_until(settled, 10, f"the threads back to {threads} (now {threads_of(pid)})")
        assert rss_mib(pid) < rss + 30, f"RSS grew from {rss:.0f} to {rss_mib(pid):.0f} MiB over 100 retired versions"
