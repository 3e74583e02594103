"""A throwaway local Ray cluster for tests and benchmarks: a head and worker nodes on this machine.

    with LocalRayCluster(nodes=2, cpus_per_node=1) as cluster:
        ServerProcess(model, "--ray", "--ray-address", cluster.address, ...)

Each `ray start --block` runs in a session of its own, and stopping sends SIGKILL to exactly those
sessions' process groups: `ray stop` would stop every Ray process on the machine, other users' too.
Every node gets a loopback address of its own (127.0.0.2, 127.0.0.3, ...): Ray replaces 127.0.0.1 with
the machine's network address, and a test's traffic stays on loopback. The dashboard is off and the object
store small, as befits a shared 2-core machine. Token authentication
is off (RAY_AUTH_MODE=disabled, also for the processes started while the cluster runs): once any local
`ray.init()` has written ~/.ray/auth_token, `ray start` would turn it on, and a driver joining by address
would then be refused.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
ADDRESS = re.compile(r"ray start --address='([0-9.]+:[0-9]+)'")


def node_ip(i: int) -> str:
    """The loopback address of node `i` (127.0.0.1 itself is the one address Ray will not keep)."""
    return f"127.0.0.{i + 2}"


class LocalRayCluster:
    """`nodes` Ray nodes on this machine (the first is the head, on a free port), each with `cpus_per_node` CPUs."""

    def __init__(self, nodes: int = 2, cpus_per_node: float = 1):
        self.nodes, self.cpus = nodes, cpus_per_node
        self.tmp = tempfile.mkdtemp(prefix="vray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.procs: list[subprocess.Popen] = []
        self.address: str | None = None
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
        self._auth_mode = os.environ.get("RAY_AUTH_MODE")

    def _start(self, *args: str, log: str) -> subprocess.Popen:
        common = ["--num-cpus", str(self.cpus), "--disable-usage-stats", "--block"]
        with open(os.path.join(self.tmp, log), "w") as out:
            proc = subprocess.Popen(
                [RAY, "start", *args, *common],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        self.procs.append(proc)
        return proc

    def start(self, timeout: float = 120.0) -> LocalRayCluster:
        os.environ["RAY_AUTH_MODE"] = "disabled"  # drivers started from here join without a token
        head_args = ["--head", "--port=0", f"--node-ip-address={node_ip(0)}", "--include-dashboard=false"]
        head_args += ["--temp-dir", self.tmp]
        self._start(*head_args, "--object-store-memory", str(100 * 2**20), log="head.log")
        deadline = time.monotonic() + timeout
        while self.address is None:
            found = ADDRESS.search(Path(self.tmp, "head.log").read_text())
            if found:
                self.address = found.group(1)
            elif self.procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray head did not start:\n{self.log('head.log')}")
            else:
                time.sleep(0.5)
        for i in range(1, self.nodes):
            node = ["--address", self.address, f"--node-ip-address={node_ip(i)}"]
            self._start(*node, "--object-store-memory", str(80 * 2**20), log=f"node{i}.log")
        return self

    def log(self, name: str) -> str:
        return Path(self.tmp, name).read_text(errors="replace")

    def stop(self) -> None:
        """SIGKILL the process groups of the nodes started here (workers first), then remove the temp dir."""
        for proc in reversed(self.procs):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self._auth_mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = self._auth_mode

    def __enter__(self) -> LocalRayCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
