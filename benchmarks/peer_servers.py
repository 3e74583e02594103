"""The peers of `vit-serve` in `benchmarks/serve_peers.py`: the same ONNX file behind LitServe and behind a plain
Ray Serve deployment, each batching up to `--max-batch-size` uploads, as each project's docs show it.

    .venv/bin/python -m benchmarks.peer_servers litserve MODEL --port 8001   # POST /predict, multipart 'file'
    .venv/bin/python -m benchmarks.peer_servers ray MODEL --port 8002        # POST /classify, multipart 'file'

Both answer what /v1/classify answers: the top 5 labels and scores of `OnnxClassifier` (decode, preprocess,
softmax). They install from the `[bench]` extra (`pip install 'vitscope[bench]'`), never the runtime's.
No `from __future__ import annotations` here: Ray pickles the deployment class by value, and FastAPI must
find `UploadFile` in the route's annotation itself, not as a name to look up in the replica.
"""

import argparse
import time

import numpy as np
from fastapi import FastAPI, UploadFile

from serve.runtime.classifier import OnnxClassifier


def top5(clf: OnnxClassifier, probs: np.ndarray) -> dict:
    return {"predictions": [{"label": label, "score": score} for label, score in clf.top_k(probs[None], 5)[0]]}


try:  # at module level: LitServe pickles the API into its worker processes
    import litserve as ls
except ImportError:  # the [bench] extra is not installed: only the Ray peer can run
    ls = None

if ls is not None:

    class ClassifierAPI(ls.LitAPI):
        """The file behind LitServe: decode in its worker, batch, top 5."""

        def __init__(self, model: str, **kwargs):
            super().__init__(**kwargs)
            self.model = model

        def setup(self, device):
            self.clf = OnnxClassifier(self.model)

        def decode_request(self, request):
            return self.clf.prepare(request["file"].file.read())  # (H, W, 3) uint8

        def predict(self, images):
            return self.clf.predict_pixels(np.stack(images))  # (B, K)

        def unbatch(self, output):
            return list(output)

        def encode_response(self, probs):
            return top5(self.clf, probs)


def litserve_main(model: str, port: int, max_batch_size: int, batch_timeout: float) -> None:
    if ls is None:
        raise SystemExit("the LitServe peer needs LitServe: pip install 'vitscope[bench]'")
    api = ClassifierAPI(model, max_batch_size=max_batch_size, batch_timeout=batch_timeout)
    ls.LitServer(api, accelerator="cpu", workers_per_device=1).run(
        host="127.0.0.1", port=port, log_level="warning", generate_client_file=False
    )


def ray_main(model: str, port: int, max_batch_size: int, batch_timeout: float) -> None:
    import ray
    from ray import serve

    app = FastAPI()

    @serve.deployment(max_ongoing_requests=64)
    @serve.ingress(app)
    class Classifier:
        def __init__(self):
            self.clf = OnnxClassifier(model)

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=batch_timeout)
        async def predict(self, images: list[np.ndarray]) -> list[np.ndarray]:
            return list(self.clf.predict_pixels(np.stack(images)))  # (B, K) -> B rows

        @app.post("/classify")
        async def classify(self, file: UploadFile):
            return top5(self.clf, await self.predict(self.clf.prepare(await file.read())))

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Classifier.bind(), route_prefix="/")
    while True:  # serve until SIGTERM
        time.sleep(3600)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("peer", choices=["litserve", "ray"])
    p.add_argument("model")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--batch-timeout", type=float, default=0.001, help="seconds a batch waits to fill up")
    args = p.parse_args()
    run = litserve_main if args.peer == "litserve" else ray_main
    run(args.model, args.port, args.max_batch_size, args.batch_timeout)


if __name__ == "__main__":
    main()
