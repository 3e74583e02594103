"""Why the connection cap is vitscope's own and not uvicorn's `limit_concurrency`.

Starts the same tiny ASGI app twice, side by side: under uvicorn's stock protocol with
`limit_concurrency=CAP`, and under `LimitedHttpToolsProtocol` with `max_connections=CAP`. Opens CAP + EXTRA
idle connections to each (a client that connects and sends nothing, as a connection flood does), then
reports how many of the extra ones were answered within a second, and how many descriptors the server
holds.

    .venv/bin/python -m benchmarks.connection_cap [--cap 100] [--extra 100]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

from benchmarks.common import Result, add_results_option

SERVER = r"""
import sys, uvicorn
from serve.server.http.protocol import LimitedHttpToolsProtocol
from serve.server.settings import ServeSettings

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})

mode, cap = sys.argv[1], int(sys.argv[2])
if mode == "uvicorn":
    config = uvicorn.Config(app, port=0, log_level="error", http="httptools", limit_concurrency=cap)
else:
    config = uvicorn.Config(app, port=0, log_level="error", http=LimitedHttpToolsProtocol)
    config.limits = ServeSettings(max_connections=cap).connection_limits()
server = uvicorn.Server(config)
orig = server.startup
async def startup(sockets=None):
    await orig(sockets)
    print(server.servers[0].sockets[0].getsockname()[1], flush=True)
server.startup = startup
server.run()
"""


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def measure(mode: str, cap: int, extra: int) -> tuple[int, int, str]:
    """The extra connections answered within a second, the descriptors held, and the next request's status line."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER, mode, str(cap)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        base = fds(proc.pid)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(cap + extra)]
        deadline = time.monotonic() + 1.0
        answered = 0
        for s in idle[cap:]:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                answered += bool(s.recv(4096))
            except (TimeoutError, ConnectionResetError):
                pass
        held = fds(proc.pid) - base
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # a real client, now
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(2)
            try:
                status = s.recv(4096).split(b"\r\n", 1)[0].decode()
            except TimeoutError:
                status = "no answer in 2 s"
        for s in idle:
            s.close()
        return answered, held, status
    finally:
        proc.terminate()
        proc.wait(10)


PROTOCOLS = {"uvicorn": "uvicorn, limit_concurrency", "vitscope": "LimitedHttpToolsProtocol, max_connections"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cap", type=int, default=100)
    p.add_argument("--extra", type=int, default=100)
    args = add_results_option(p).parse_args()
    result = Result("connection_cap", {"cap": args.cap, "extra idle connections": args.extra}, ("uvicorn",),
                    results=args.results)  # fmt: skip
    answered = "extra connections answered within 1 s"
    columns = ["protocol", answered, "descriptors held", "next request"]
    table = result.table(columns, formats={answered: f"{{}} of {args.extra}"})
    for mode, name in PROTOCOLS.items():
        table.add(name, *measure(mode, args.cap, args.extra))
    result.finish()


if __name__ == "__main__":
    main()
