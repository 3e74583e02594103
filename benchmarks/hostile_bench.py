"""Hostile clients against a live `vit-serve` on 127.0.0.1: does it stay small and answer its health checks?

Three attacks from the security audit, one after another, each while two probes run: GET /healthz every
50 ms and a normal POST /v1/classify every 100 ms. For each, the server's peak resident memory over its
baseline, and the probes' latencies. Goals: +1 GB peak RSS at most, /healthz p99 under 100 ms.

  1. `--images` (32) concurrent uploads of a 35-byte GIF that declares 65535 x 610 pixels (just under
     the 40 MP limit), repeated for `--rounds` rounds;
  2. one connection sending `--header-mb` (300) MB of request headers;
  3. `--slow` (500) connections that send their request head one byte a second (slowloris), for 15 s;
  4. `--crowd` (1000) keep-alive clients sending ordinary classify requests for 10 s (not an attack: how
     long health checks wait under a full load).

    .venv/bin/python -m benchmarks.hostile_bench artifacts/sample.onnx

All traffic goes to 127.0.0.1, bounded in count and time.
"""

from __future__ import annotations

import argparse
import http.client
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import Result, add_results_option
from benchmarks.servers import PeakRss, Prober, crowd, http_request, percentiles
from serve.server.testing import ServerProcess, noise_png, rss_mib, tiny_gif


def small_png() -> bytes:
    return noise_png(0, (48, 48))


def attack_images(port: int, n: int, rounds: int) -> str:
    gif = tiny_gif()

    def send(_):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/classify", body=gif, headers={"content-type": "image/gif"})
        status = conn.getresponse().status
        conn.close()
        return status

    statuses = []
    with ThreadPoolExecutor(n) as pool:
        for _ in range(rounds):
            statuses += list(pool.map(send, range(n)))
    return f"{len(statuses)} uploads, statuses {sorted(set(statuses))}"


def attack_headers(port: int, megabytes: int) -> str:
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        line = b"X-Filler: " + b"a" * (1024 * 1024 - 12) + b"\r\n"
        try:
            while sent < megabytes * 1024 * 1024:
                s.sendall(line)
                sent += len(line)
        except OSError:
            pass
        try:
            answer = s.recv(200).split(b"\r\n")[0].decode()
        except OSError as e:
            answer = type(e).__name__
    return f"{sent / 2**20:.1f} MB sent before the server closed; answer {answer!r}"


def attack_slow(port: int, n: int, seconds: float = 15.0) -> str:
    conns = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setblocking(False)
        s.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        conns.append(s)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for s in conns:
            try:
                s.send(b"X")  # one byte of a header that never ends
            except OSError:
                pass
        time.sleep(1.0)
    still_open = 0
    for s in conns:
        try:
            s.recv(1, socket.MSG_PEEK)  # b"" or the 408: the server let go of it
        except BlockingIOError:
            still_open += 1  # nothing to read, not closed: the server still holds it
        except OSError:
            pass
        s.close()
    return f"{n} connections, {still_open} still open after {seconds:.0f} s"


def attack_crowd(port: int, n: int, seconds: float = 10.0) -> str:
    """`n` keep-alive clients sending ordinary classify requests as fast as they are answered."""
    return crowd(port, http_request("/v1/classify", small_png()), n, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--header-mb", type=int, default=300)
    parser.add_argument("--slow", type=int, default=500)
    parser.add_argument("--crowd", type=int, default=1000)
    parser.add_argument("--only", default="images,headers,slow,crowd", help="which attacks, comma-separated")
    args = add_results_option(parser).parse_args()
    attacks = {
        "images": (
            f"{args.images} concurrent 40 MP GIFs of 35 bytes, x{args.rounds}",
            attack_images,
            args.images,
            args.rounds,
        ),
        "headers": (f"{args.header_mb} MB of headers", attack_headers, args.header_mb),
        "slow": (f"{args.slow} slowloris connections", attack_slow, args.slow),
        "crowd": (f"{args.crowd} clients classifying for 10 s", attack_crowd, args.crowd),
    }
    setting = {k: v for k, v in vars(args).items() if k not in ("model", "results")}
    result = Result("hostile_bench", {"model": str(args.model), **setting}, ("uvicorn",), results=args.results)
    columns = ["attack", "outcome", "RSS base (MiB)", "RSS peak (MiB)", "/healthz p50 ms", "/healthz p99 ms"]
    columns += ["classify p99 ms", "probe fails"]
    table = result.table(columns, formats={c: "{:.0f}" for c in columns[2:4]} | {c: "{:.1f}" for c in columns[4:7]})
    with ServerProcess(args.model, "--examples-dir", "") as server:
        pid = server.proc.pid
        for name, attack, *params in (attacks[a] for a in args.only.split(",")):
            time.sleep(2)  # let the server settle after the last attack: part of the measurement's setting
            base = rss_mib(pid)
            health = Prober(server.port, "GET", "/healthz", every=0.05)
            normal = Prober(server.port, "POST", "/v1/classify", small_png(), every=0.1)
            with PeakRss(pid) as rss, health, normal:
                time.sleep(0.5)  # the probes' baseline before the attack
                outcome = attack(server.port, *params)
                time.sleep(0.5)  # and after it
            ms, classify = percentiles(health.latencies), percentiles(normal.latencies)
            fails = health.failed + normal.failed
            table.add(name, outcome, base, rss.peak, ms["p50"], ms["p99"], classify["p99"], fails)
            print(f"{name}: {outcome}", file=sys.stderr, flush=True)
    result.finish()


if __name__ == "__main__":
    main()
