"""What do the layers of a /v1/classify request cost on the event loop? Each layer in-process, side by side.

Three questions, each timed as interleaved rounds in this one process (no sockets, no model), CPU time per call
but for the last:
- routing: a request with two query parameters through a plain Starlette route that checks them by hand (what
  /v1/classify was before `serve.server.http.lane` took it past the router), a FastAPI route that takes the
  `Request` and validates them with `ClassifyParams` itself (what FastAPI's routes of /v1/classify are: they
  document it), and a FastAPI route that declares `ClassifyParams` as its query parameters (FastAPI validates
  them), each answering the same small JSON; the plain route twice is the noise.
- the multipart body: Starlette's form parser (a spooled temporary file per upload, read back through awaitables)
  against python-multipart's parser over the bytes already read (`serve.server.http.uploads.parse_parts`) and
  against `parse_multipart`, which cuts a one-file body out directly (`only_file`), on the sample's PNG upload.
- ranking one image's classes for its top-k, while a second thread runs Python: numpy's sort against
  `serve.runtime.calibration.ranked`, in wall time (a call that lets go of the interpreter lock waits for it).

    .venv/bin/python -m benchmarks.serve_overhead [--rounds 7] [--calls 2000]

The whole server's figures with these layers in it are `benchmarks.serve_ab` and `benchmarks.serve_peers`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from pathlib import Path
from typing import Annotated

import numpy as np
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from starlette.requests import Request as StarletteRequest

from benchmarks.common import Result, add_results_option, interleaved
from benchmarks.servers import sample_image
from serve.runtime.calibration import ranked
from serve.server.api.v1 import ClassifyParams, classify_params
from serve.server.http.uploads import parse_multipart, parse_parts

BOUNDARY = "vitscope-benchmark-boundary"
QUERY = b"top_k=3&coverage=0.9"


def routes_app() -> FastAPI:
    """One app, the same answer behind each kind of route."""
    app = FastAPI()

    @app.post("/declared")
    async def declared(request: Request, params: Annotated[ClassifyParams, Query()]):  # FastAPI validates them
        return JSONResponse({"top_k": params.top_k, "coverage": params.coverage})

    @app.post("/request")
    async def takes_the_request(request: Request):  # what /v1/classify is: it validates them itself
        params = classify_params(request.query_params, {})
        return JSONResponse({"top_k": params.top_k, "coverage": params.coverage})

    async def plain(request: StarletteRequest):  # what /v1/classify was: a Starlette route, checks by hand
        query = request.query_params
        return JSONResponse({"top_k": int(query["top_k"]), "coverage": float(query["coverage"])})

    app.add_route("/plain", plain, methods=["POST"])
    return app


def asgi_calls(app, path: str, calls: int) -> float:
    """CPU µs per request of `calls` requests to `path`, straight through the ASGI app."""
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": QUERY,
             "headers": [(b"host", b"127.0.0.1")], "http_version": "1.1", "scheme": "http",
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "root_path": ""}  # fmt: skip

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start" and message["status"] != 200:
            raise RuntimeError(f"{path} answered {message['status']}")

    async def run() -> float:
        await app(dict(scope), receive, send)  # first call: routes compiled, caches filled
        start = time.process_time()
        for _ in range(calls):
            await app(dict(scope), receive, send)
        return (time.process_time() - start) / calls * 1e6

    return asyncio.run(run())


def multipart_body(png: bytes) -> tuple[bytes, str]:
    head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="digit.png"\r\n'
    body = (head + "Content-Type: image/png\r\n\r\n").encode() + png + f"\r\n--{BOUNDARY}--\r\n".encode()
    return body, f"multipart/form-data; boundary={BOUNDARY}"


def starlette_form(body: bytes, ctype: str, calls: int) -> float:
    """CPU µs per upload read through Starlette's form parser, as the route read it before."""
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-type", ctype.encode())]}

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def one() -> bytes:
        async with StarletteRequest(scope, receive).form(max_files=1) as form:
            return await form["file"].read()

    async def run() -> float:
        await one()
        start = time.process_time()
        for _ in range(calls):
            await one()
        return (time.process_time() - start) / calls * 1e6

    return asyncio.run(run())


def ours(parse, body: bytes, ctype: str, calls: int) -> float:
    """CPU µs per `parse(body, ctype)`."""
    parse(body, ctype)
    start = time.process_time()
    for _ in range(calls):
        parse(body, ctype)
    return (time.process_time() - start) / calls * 1e6


def ranking(rank, calls: int) -> float:
    """Wall µs per ranking of one image's 10 probabilities while a second thread runs Python (as the batcher's
    thread does between its model calls): a call that lets go of the interpreter lock waits to get it back."""
    probs = np.random.default_rng(0).random((1, 10)).astype(np.float32)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(200))

    other = threading.Thread(target=busy, daemon=True)
    other.start()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            rank(probs)
        return (time.perf_counter() - start) / calls * 1e6
    finally:
        stop.set()
        other.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000, help="requests or uploads per side per round")
    p.add_argument("--data", type=Path, default=Path("data/digits"), help="sample images (one is uploaded)")
    args = add_results_option(p).parse_args()
    app, n = routes_app(), args.calls
    routing = interleaved(args.rounds, {
        "Starlette route, parameters checked by hand": lambda _: asgi_calls(app, "/plain", n),
        "the same, again (noise)": lambda _: asgi_calls(app, "/plain", n),
        "FastAPI route taking the Request, ClassifyParams validated by the route": lambda _: asgi_calls(
            app, "/request", n),
        "FastAPI route, ClassifyParams declared as its query parameters": lambda _: asgi_calls(app, "/declared", n),
    })  # fmt: skip
    png = sample_image(args.data, (32, 32))
    body, ctype = multipart_body(png)
    python_multipart = lambda body, ctype: parse_parts(body, BOUNDARY.encode())  # noqa: E731
    parsing = interleaved(args.rounds, {
        "Starlette's form parser": lambda _: starlette_form(body, ctype, n),
        "parse_parts (python-multipart over the bytes)": lambda _: ours(python_multipart, body, ctype, n),
        "parse_multipart (a one-file body cut out directly)": lambda _: ours(parse_multipart, body, ctype, n),
    })  # fmt: skip
    numpy_sort = lambda p: np.argsort(-p, axis=-1, kind="stable")[:, :5].tolist()  # noqa: E731
    ranks = interleaved(args.rounds, {
        "np.argsort (lets go of the lock)": lambda _: ranking(numpy_sort, n // 10),
        "calibration.ranked (sorts in Python)": lambda _: ranking(lambda p: ranked(p, 5), n // 10),
    })  # fmt: skip
    setting = {"rounds": args.rounds, "calls": n, "upload bytes": len(body)}
    result = Result(
        "serve_overhead", setting, packages=("fastapi", "starlette", "python-multipart"), results=args.results
    )
    tables = (
        ("routing, CPU time", routing),
        ("the multipart body, CPU time", parsing),
        ("ranking 10 classes, wall time", ranks),
    )
    for title, figures in tables:
        table = result.table(["layer", "µs per call (median)", "range over rounds", "ratio"], title)
        table.formats.update({"µs per call (median)": "{:.1f}", "ratio": "{:.2f}x"})
        base = statistics.median(next(iter(figures.values())))
        for name, values in figures.items():
            med = statistics.median(values)
            table.add(name, med, f"{min(values):.1f}-{max(values):.1f}", med / base)
    result.data = {"routing": routing, "parsing": parsing, "ranking": ranks}
    result.finish()


if __name__ == "__main__":
    main()
