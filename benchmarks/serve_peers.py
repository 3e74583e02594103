"""How does vit-serve compare with its peers? vit-serve beside LitServe, then beside a plain Ray Serve deployment
of the same ONNX file: two servers up at once, the same requests in alternating rounds.

Each peer is paired with vit-serve alone (an idle peer still takes CPU). All three get the same multipart PNG
upload, batch up to 8 images and answer the top 5 of `OnnxClassifier`; vit-serve also gets the pixels as a KServe
v2 binary tensor over HTTP and as a gRPC ModelInfer, which compare the protocols. Per target: the median req/s,
p50 and p99, the server's CPU per request (its process tree) and that less what the model and decoding cost
in-process (`beyond model`). `--pin` gives the load generators a core of their own.

    .venv/bin/python -m benchmarks.serve_peers [--variant vit_micro_patch4_32] [--peers litserve,ray] [--pin]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Result, add_results_option
from benchmarks.servers import (
    Child,
    grpc_load,
    http_load,
    http_request,
    measured,
    multipart_request,
    pin_apart,
    random_model_file,
    sample_image,
)
from serve.runtime.classifier import OnnxClassifier
from serve.server.testing import ServerProcess, free_port

INFER = "/inference.GRPCInferenceService/ModelInfer"
READY = {"litserve": "/health", "ray": "/-/healthz"}
PATHS = {"litserve": "/predict", "ray": "/classify"}
PEER_NAMES = {"litserve": "LitServe", "ray": "Ray Serve"}


def in_process_cost(clf: OnnxClassifier, png: bytes, batch: int = 8, seconds: float = 2.0) -> tuple[float, float]:
    """CPU µs per image of the model alone and of decoding plus the model, at `batch` images per call."""
    pixels = np.repeat(clf.prepare(png)[None], batch, axis=0)
    decoded = lambda: np.stack([clf.prepare(png) for _ in range(batch)])  # noqa: E731
    out = []
    for work in (lambda: clf.predict_pixels(pixels), lambda: clf.predict_pixels(decoded())):
        n, cpu0, t0 = 0, time.process_time(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            work()
            n += batch
        out.append((time.process_time() - cpu0) / n * 1e6)
    return out[0], out[1]


def tensor_requests(clf: OnnxClassifier, png: bytes, name: str) -> tuple[bytes, bytes]:
    """One image as a KServe v2 binary-tensor HTTP request and as a serialized gRPC ModelInferRequest."""
    from serve.server.grpc import grpc_predict_v2_pb2 as pb

    raw = clf.prepare(png)[None].tobytes()  # (1, H, W, 3) uint8
    H, W = clf.input_size
    head = json.dumps({
        "inputs": [{"name": "pixels", "datatype": "UINT8", "shape": [1, H, W, 3],
                    "parameters": {"binary_data_size": len(raw)}}],
        "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
    }).encode()  # fmt: skip
    v2 = http_request(
        f"/v2/models/{name}/infer",
        head + raw,
        "application/octet-stream",
        f"Inference-Header-Content-Length: {len(head)}\r\n",
    )
    message = pb.ModelInferRequest(
        model_name=name, outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="logits")]
    )
    message.inputs.add(name="pixels", datatype="UINT8", shape=[1, H, W, 3])
    message.raw_input_contents.append(raw)
    return v2, message.SerializeToString()


def start_vit(model: Path, batch: int, logs: Path) -> tuple[ServerProcess, int, int]:
    """vit-serve with gRPC, batching up to `batch` images: (the server, its HTTP port, its gRPC port)."""
    gport = free_port()
    sizes = ["--max-batch-size", str(batch), "--preferred-batch-size", str(batch)]
    vit = ServerProcess(model, "--no-ui", "--grpc-port", str(gport), *sizes, "--log-level", "warning",
                        log_file=logs / "vit-serve.log")  # fmt: skip
    try:
        vit.wait_ready()
    except BaseException:
        vit.stop()
        raise
    return vit, vit.port, gport


def start_peer(peer: str, model: Path, batch: int, logs: Path) -> tuple[Child, int]:
    """LitServe or Ray Serve (`benchmarks.peer_servers`) batching up to `batch` images: (the server, its port)."""
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.peer_servers", peer, str(model), "--port", str(port),
           "--max-batch-size", str(batch)]  # fmt: skip
    child = Child(cmd, logs / f"{peer}.log")
    try:
        child.wait_ready(f"http://127.0.0.1:{port}{READY[peer]}")
    except BaseException:
        child.stop()
        raise
    return child, port


def targets(vit: tuple, peer: tuple | None, png: bytes, v2: bytes, message: bytes, concurrency: int, seconds: float):
    """Name -> (a load of `seconds`, the server's pid, whether it decodes the image), for vit-serve's three ways in
    and, given `peer` as (its name, the server, its port), the peer's multipart upload."""
    server, port, gport = vit
    upload = multipart_request("/v1/classify", png)
    out = {
        "vit-serve HTTP multipart": (lambda: http_load(port, upload, concurrency, seconds), server, True),
        "vit-serve HTTP v2 binary tensor": (lambda: http_load(port, v2, concurrency, seconds), server, False),
        "vit-serve gRPC raw tensor": (
            lambda: grpc_load(gport, INFER, message, concurrency, seconds), server, False),
    }  # fmt: skip
    if peer is not None:
        name, child, p = peer
        request = multipart_request(PATHS[name], png)
        out[f"{name} HTTP multipart"] = (lambda: http_load(p, request, concurrency, seconds), child, True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="an exported .onnx (default: --variant with random weights)")
    p.add_argument("--variant", default="vit_micro_patch4_32", help="vit.create_model variant to export")
    p.add_argument("--data", type=Path, default=Path("data/digits"), help="sample images: classes and the posted PNG")
    p.add_argument(
        "--peers", default="litserve,ray", help="comma-separated, each paired with vit-serve in turn: litserve, ray "
        "(empty: vit-serve alone)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--duration", type=float, default=4.0, help="seconds per target per round")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="most images per model call, on every server")
    p.add_argument(
        "--pin", action="store_true",
        help="both servers of a pair (all their processes and threads) on the first CPU, the load generators on the "
        "others: each server gets the same core, and no server's throughput pays for its clients' CPU",
    )  # fmt: skip
    args = add_results_option(p).parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="serve_peers-"))
    try:
        model = args.model.resolve() if args.model else random_model_file(args.variant, args.data, tmp)
        compare(args, model, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compare(args: argparse.Namespace, model: Path, tmp: Path) -> None:
    clf = OnnxClassifier(model)
    png = sample_image(args.data, clf.input_size)
    model_us, decode_model_us = in_process_cost(clf, png, args.batch)
    v2, message = tensor_requests(clf, png, clf.name)
    peers = [x for x in args.peers.split(",") if x]
    vit = start_vit(model, args.batch, tmp)
    pairs: dict[str, dict[str, list[dict]]] = {}  # the peer (or "vit-serve" alone) -> target -> its rounds
    try:
        for peer in peers or [None]:
            child, port = start_peer(peer, model, args.batch, tmp) if peer else (None, None)
            try:
                if args.pin:
                    pin_apart([vit[0].proc.pid] + ([child.proc.pid] if child else []))
                loads = targets(vit, peer and (peer, child, port), png, v2, message, args.concurrency, args.duration)
                pairs[peer or "vit-serve"] = rounds_of(loads, args.rounds)
            finally:
                if child is not None:
                    child.stop()
    finally:
        vit[0].stop()
    described = str(model) if args.model else f"{model.name} ({args.variant} random weights)"
    setting = {"model": described, "concurrency": args.concurrency, "rounds": args.rounds}
    setting |= {"duration s": args.duration, "batch": args.batch, "pinned": args.pin}
    name = "serve_peers_pinned" if args.pin else "serve_peers"  # one result per setting
    result = Result(name, setting, ("onnxruntime", "uvicorn", "litserve", "ray"), results=args.results)
    for peer, runs in pairs.items():
        add_table(result, peer, runs, model_us, decode_model_us)
    result.notes.append(
        f"in-process, batch {args.batch}: model {model_us:.0f} µs/image, decode + model {decode_model_us:.0f} µs/image"
    )
    result.data = {"model_us_per_image": model_us, "decode_and_model_us_per_image": decode_model_us, "pairs": pairs}
    result.finish()


def add_table(result: Result, peer: str, runs: dict[str, list[dict]], model_us: float, decode_model_us: float):
    """The table of one pair: each target's medians over its rounds, against the peer's req/s."""
    shown = PEER_NAMES.get(peer)  # None: vit-serve alone, against its own multipart row
    vs = f"vs {shown or 'vit-serve multipart'}"
    columns = ["target", "req/s (median)", vs, "p50 ms", "p99 ms", "server CPU µs/req", "beyond model µs/req",
               "errors", "req/s each round"]  # fmt: skip
    formats = {"req/s (median)": "{:,.0f}", vs: "{:.2f}x", "p50 ms": "{:.1f}", "p99 ms": "{:.1f}"}
    title = f"vit-serve beside {shown}" if shown else "vit-serve alone"
    table = result.table(columns, title=title, formats=formats | {c: "{:,.0f}" for c in columns[5:7]})
    medians = {name: {k: statistics.median(r[k] for r in rounds) for k in ("rps", "p50", "p99", "cpu_us")}
               for name, rounds in runs.items()}  # fmt: skip
    base = medians[f"{peer} HTTP multipart"]["rps"]  # the peer's row, or vit-serve's own
    for name, rounds in runs.items():
        med = medians[name]
        beyond = med["cpu_us"] - (decode_model_us if "multipart" in name else model_us)  # tensors: no decoding
        each = ", ".join(f"{r['rps']:.0f}" for r in rounds)
        errors = sum(r["errors"] for r in rounds)
        table.add(name, med["rps"], med["rps"] / base, med["p50"], med["p99"], med["cpu_us"], beyond, errors, each)


def rounds_of(loads: dict, rounds: int) -> dict[str, list[dict]]:
    """Each load once unmeasured (connections, first batches, the peers' routing), then `rounds` alternating rounds
    of all of them: target -> its rounds."""
    for load, _, _ in loads.values():
        load()
    runs: dict[str, list[dict]] = {name: [] for name in loads}
    for _ in range(rounds):
        for name, (load, child, _) in loads.items():
            runs[name].append(measured(load, child.proc.pid))
    return runs


if __name__ == "__main__":
    main()
