"""Health probes under overload: `/healthz` on the API port and on `--probe-port`, while `--crowd` keep-alive
clients classify as fast as they are answered.

The crowd runs in a process of its own. Each probe is a new connection with a 1 s timeout, as Kubernetes'
default probe is, every 50 ms from a thread of its own. Reported per port: probes, p50/p99 latency, probes
that got no 200 within 1 s; and what the crowd got (200, 503 with Retry-After, other, broken connections).

    .venv/bin/python -m benchmarks.probes artifacts/sample.onnx --crowd 1000 --seconds 20
"""

from __future__ import annotations

import argparse
import multiprocessing
from pathlib import Path

from benchmarks.common import Result, add_results_option
from benchmarks.servers import Prober, crowd, http_request, percentiles
from serve.server.testing import ServerProcess, free_port, noise_png

PROBE_TIMEOUT_S = 1.0  # Kubernetes' default probe timeout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--crowd", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--server-args", default="")
    args = add_results_option(p).parse_args()
    probe_port = free_port()
    server_args = ["--no-ui", "--probe-port", str(probe_port), *args.server_args.split()]
    request = http_request("/v1/classify", noise_png(0, (64, 64)))
    with ServerProcess(args.model, *server_args) as server:
        api, own = (Prober(port, "GET", "/healthz", timeout=PROBE_TIMEOUT_S) for port in (server.port, probe_port))
        with api, own:
            # the crowd in a process of its own: in this one it would hold the interpreter the probers time with
            with multiprocessing.Pool(1) as pool:
                got = pool.apply(crowd, (server.port, request, args.crowd, args.seconds))
    probers = {"API port": api, "--probe-port": own}
    result = Result("probes", {"crowd": args.crowd, "seconds": args.seconds}, ("uvicorn",), results=args.results)
    columns = ["/healthz on", "probes", "p50 ms", "p99 ms", "no 200 within 1 s", "crowd got"]
    table = result.table(columns, formats={"p50 ms": "{:.2f}", "p99 ms": "{:.2f}"})
    for name, prober in probers.items():
        ms = percentiles(prober.latencies)
        table.add(name, len(prober.latencies), ms["p50"], ms["p99"], prober.failed, got)
    result.finish()


if __name__ == "__main__":
    main()
