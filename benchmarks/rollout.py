"""Zero-downtime rollout: a model version swapped N times under load, and the failed requests it costs.

A repository with one model (`MODEL` as version 1) is served with `--repository-poll-s`; `--concurrency`
keep-alive clients classify the sample image back to back. After a steady phase, a new version is dropped
in (`--swaps` times: copied beside the repository, then renamed into it, as a deployment writes one) and
the benchmark waits for the first answer from it before the next. Reported: requests that failed (any
status but 200, or a broken connection) during the swaps, p50/p99 latency steady and during the swaps, and
the time from the version's folder appearing to the first answer from it.

    .venv/bin/python -m benchmarks.rollout artifacts/sample.onnx --swaps 10 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Result, add_results_option
from benchmarks.servers import http_request, percentiles
from serve.server.testing import ServerProcess, noise_png

MODEL_NAME = "sample"


class Load:
    """`clients` keep-alive connections posting `body`; each answer is kept as (time, latency, status, version)."""

    def __init__(self, port: int, path: str, body: bytes, clients: int):
        self.port, self.clients = port, clients
        self.request = http_request(path, body)
        self.answers: list[tuple[float, float, int, str | None]] = []
        self.running = True

    async def client(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        while self.running:
            t0 = time.perf_counter()
            try:
                writer.write(self.request)
                status = int((await reader.readline()).split(b" ")[1])
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                version = json.loads(body).get("version") if status == 200 else None
            except (OSError, asyncio.IncompleteReadError, IndexError, ValueError):
                self.answers.append((time.perf_counter(), time.perf_counter() - t0, 0, None))
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                continue
            self.answers.append((time.perf_counter(), time.perf_counter() - t0, status, version))
        writer.close()

    async def first_answer_from(self, version: str, since: int, timeout: float = 60.0) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            for t, _, _, v in self.answers[since:]:
                if v == version:
                    return t
            await asyncio.sleep(0.005)
        raise TimeoutError(f"no answer from version {version} within {timeout} s")


def drop_version(folder: Path, version: int, model: Path) -> None:
    tmp = folder / f".{version}.incoming"
    tmp.mkdir()
    shutil.copy(model, tmp / "model.onnx")
    tmp.rename(folder / str(version))


async def measure(port: int, folder: Path, model: Path, args) -> dict:
    load = Load(port, f"/v1/models/{MODEL_NAME}/classify", noise_png(0, (64, 64)), args.concurrency)
    tasks = [asyncio.create_task(load.client()) for _ in range(args.concurrency)]
    await asyncio.sleep(args.steady)
    steady_end = len(load.answers)
    delays = []
    for version in range(2, args.swaps + 2):
        since = len(load.answers)
        drop_version(folder, version, model)
        dropped = time.perf_counter()
        delays.append(await load.first_answer_from(str(version), since) - dropped)
        await asyncio.sleep(args.between)
    load.running = False
    await asyncio.gather(*tasks)
    steady, swaps = load.answers[:steady_end], load.answers[steady_end:]
    return {
        "steady": steady,
        "swaps": swaps,
        "delays": delays,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--swaps", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--steady", type=float, default=10.0, help="seconds of load before the first swap")
    p.add_argument("--between", type=float, default=1.0, help="seconds between a version's first answer and the next")
    p.add_argument("--poll-s", type=float, default=0.2, help="the server's --repository-poll-s")
    p.add_argument("--server-args", default="--preferred-batch-size 8")
    args = add_results_option(p).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "models" / MODEL_NAME
        folder.mkdir(parents=True)
        (folder / "config.pbtxt").write_text(f'name: "{MODEL_NAME}"\nplatform: "onnxruntime_onnx"\n')
        drop_version(folder, 1, args.model)
        server_args = ["--no-ui", "--repository-poll-s", str(args.poll_s), *args.server_args.split()]
        with ServerProcess(folder.parent, *server_args, log_file=Path(tmp) / "server.log") as server:
            got = asyncio.run(measure(server.port, folder, args.model, args))
    setting = {"concurrency": args.concurrency, "poll s": args.poll_s, "swaps": args.swaps, "steady s": args.steady}
    result = Result("rollout", setting, ("uvicorn",), results=args.results)
    columns = ["phase", "requests", "failed", "req/s", "p50 ms", "p99 ms", "file to first answer, median / max (s)"]
    table = result.table(columns, formats={"req/s": "{:,.0f}", "p50 ms": "{:.2f}", "p99 ms": "{:.2f}"})
    delays = got["delays"]
    for phase in ("steady", "swaps"):
        answers = got[phase]
        seconds = answers[-1][0] - answers[0][0] if answers else 0
        ms = percentiles([a[1] for a in answers])
        first = "-" if phase == "steady" else f"{np.median(delays):.2f} / {max(delays):.2f}"
        name = phase if phase == "steady" else f"{args.swaps} swaps"
        failed = sum(a[2] != 200 for a in answers)
        table.add(name, len(answers), failed, len(answers) / max(seconds, 1e-9), ms["p50"], ms["p99"], first)
    result.finish()


if __name__ == "__main__":
    main()
