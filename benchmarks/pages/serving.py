"""The sections of the serving, peers, model server, batch scoring, browser and calibration pages."""

from __future__ import annotations

from benchmarks.pages.outline import Part, Section

SECTIONS = (
    Section(
        "Serving (`vit-serve`)",
        "serving",
        """\
Targets: throughput at concurrency 16 >= 0.8x the in-process ORT throughput at its best batch size; p99 latency at
concurrency 1 <= 1.2x in-process single-image latency + 5 ms; a 5-minute soak at concurrency 8 with 0 errors and
resident memory growth <= 5 %.

Server and in-process rounds alternate (best of each), because this machine's speed drifts by tens of percent
over minutes. The load generator runs on the same 2 cores, so it is a bare asyncio protocol on uvloop and prints
its own CPU per request. A version of the server against another is measured side by side by `serve_ab` (the
model server page).""",
        (
            Part("serve_bench", "The sample model"),
            Part(
                "serve_bench_vit_tiny_patch16_224",
                "ViT-Ti/16 at 224 px",
                "The same server on a production-size model (random weights: serving cost does not depend on "
                "training), with onnxruntime on both cores and uploads decoded on the model's thread.",
            ),
        ),
    ),
    Section(
        "The layers of a request on the event loop",
        "serving",
        """\
What each layer of a `/v1/classify` request costs the event loop, in-process and side by side (no sockets, no
model), in CPU time per call over interleaved rounds: the routing (a plain Starlette route checking its parameters
by hand, as `/v1/classify` did before `serve.server.http.lane` took it past the router, a FastAPI route that
validates `ClassifyParams` itself, and one that declares them as its query parameters) and the multipart body
(Starlette's form parser, python-multipart over the bytes, and `serve.server.http.uploads.parse_multipart`, which
cuts a one-file upload out directly).""",
        (Part("serve_overhead"),),
    ),
    Section(
        "Serving on Ray (`vit-serve --ray`)",
        "serving",
        """\
What Ray Serve costs and buys on one machine: plain `vit-serve` against `vit-serve --ray` with 1 and 2 model
replicas, side by side in one run (a throwaway two-node Ray cluster, one CPU per node, on the same machine), with
serve_bench's load generator at concurrency 16 posting one PNG to `/v1/classify`. Plain `vit-serve` is measured
first and again last, so the machine's drift over the run shows. Each request through Ray crosses its HTTP proxy,
the ingress replica and a model replica, three processes with a Ray call between each: `vit-serve --ray` is for
spreading a model over several machines and for replicas that survive crashes (`tests/serve/test_ray_serve.py`),
not for more speed on one machine.""",
        (Part("ray_bench"),),
    ),
    Section(
        "Hostile clients (`vit-serve` under attack)",
        "serving",
        """\
Goals: at most +1 GB peak resident memory over the idle server, and `/healthz` p99 under 100 ms, during each
attack of the security audit. Each run starts one `vit-serve` (with its UI) on 127.0.0.1 and, while the attack
goes on, probes `GET /healthz` every 50 ms and an ordinary `POST /v1/classify` every 100 ms. The model is the
tests' tiny one (4 classes, 32 x 32 input: `.venv/bin/python -m tests.helpers --tiny-onnx tiny.onnx`), since the
attacks are on decoding and HTTP, not on the model.

Large images decode at reduced size and within a pixel budget (`--decode-pixel-budget`), glibc hands large freed
blocks back at once (`serve.server.cli._return_freed_memory`), and request heads stop at 64 KiB (431) and must
arrive within 10 s (408).""",
        (Part("hostile_bench"),),
    ),
    Section(
        "The connection cap against uvicorn's `limit_concurrency`",
        "serving",
        """\
Why `serve/server/http/protocol.py` keeps its own cap: uvicorn's `limit_concurrency` answers 503 only once a
request head arrives, so connections that send nothing keep their descriptors until a timeout, while the cap
refuses the connection itself. The same tiny app under each, with idle connections beyond a cap.""",
        (Part("connection_cap"),),
    ),
    Section(
        "Peers: vit-serve, LitServe, Ray Serve",
        "peers",
        """\
The same ONNX file (the sample's architecture, `vit_micro_patch4_32`, random weights) behind each server, 16
keep-alive clients, batches of up to 8 on every server. vit-serve is paired with each peer in turn: the two up at
once, rounds alternating, and no other server up (an idle Ray cluster keeps its GCS, raylet and dashboard busy, and
that CPU would come out of whichever server is measured). **Server CPU per request**
(every process of the server, from /proc) is the figure that holds whatever else runs on the machine; "beyond
model" is that CPU less what the model and decoding cost in-process (the gRPC and v2 tensor rows send pixels, so
only the model is subtracted there). Ray Serve's CPU counts every process of its local cluster (GCS, raylet,
dashboard agent, proxy and replica). LitServe and Ray Serve install with `pip install 'vitscope[bench]'`.""",
        (
            Part("serve_peers", "The load generators beside the servers, on both cores"),
            Part(
                "serve_peers_pinned",
                "Pinned: the servers on one core, the load generators on the other (`--pin`)",
                "The two servers of a pair share the first core and neither pays for its clients' CPU, so "
                "throughput follows the server's own CPU per request. A server's CPU per request is higher here "
                "than unpinned: all its threads (and LitServe's processes) take turns on one core.",
            ),
        ),
    ),
    Section(
        "gRPC against HTTP v2 binary tensors",
        "peers",
        """\
Target: gRPC at least as fast as HTTP v2. The `vit-serve HTTP v2 binary tensor` and `vit-serve gRPC raw tensor`
rows of the peers tables above: the same pixels of the same image (batch 1), the same server, alternating rounds.
Each protocol's load generator writes prebuilt requests straight onto its sockets (`benchmarks.grpc_wire`
for gRPC: HTTP/2 frames with their flow control), so that neither client's CPU, taken from the cores the
server shares, decides the comparison; grpc.aio's client cost several times as much per call and made gRPC
read level with HTTP v2 or behind it. The pinned table puts the server on a core of its own.""",
    ),
    Section(
        "Payload logs",
        "peers",
        """\
Three `vit-serve` processes up at once, alternating rounds of 16 clients uploading a PNG to `/v1/classify`: no
payload log, a JSON-lines file, and a CloudEvents sink that accepts connections and never answers (a queue of 64,
so it is full within the first round). A request must never wait for the log: the stalled sink's records are
dropped and counted.""",
        (Part("payload_log_bench"),),
    ),
    Section(
        "A version swapped 10 times under load",
        "model-server",
        """\
A model repository served with `--repository-poll-s`, keep-alive clients classifying back to back, and a new
version dropped in again and again (copied beside the repository, then renamed into it, as a deployment writes
one). The time to the first answer covers the poll, loading, the batch-size measurement and the warm-up checks.
The model is the test suite's tiny exported file (`.venv/bin/python -m tests.helpers --tiny-onnx
/tmp/repo_bench/tiny.onnx`).""",
        (Part("rollout"),),
    ),
    Section(
        "/healthz under 1,000 busy clients",
        "model-server",
        """\
Each probe is a new connection with a 1 s timeout, as Kubernetes' default probe is, every 50 ms, on the API port
and on `--probe-port` (answered by a process of its own, `serve.server.http.probes`), while the crowd classifies
from a process of its own.""",
        (Part("probes"),),
    ),
    Section(
        "The repository server against the server of main at 480eaec",
        "model-server",
        """\
```bash
mkdir -p /tmp/vitscope-480eaec && git archive 480eaec | tar -x -C /tmp/vitscope-480eaec
```

Two source trees, each running its own `vit-serve`, in alternating rounds of serve_bench's load generator; the
server's CPU time per request moves less with a busy machine than its throughput. Target: at least 0.95x the
requests per second of the older server.""",
        (
            Part("serve_ab", "The digits sample"),
            Part("serve_ab_vit_tiny_patch16_224", "ViT-Ti/16 with random weights"),
        ),
    ),
    Section(
        "Batch scoring (`vit-predict --out`, `vit-predict --ray`)",
        "batch",
        "Random weights: speed does not depend on training. Generated 64 x 64 PNGs; compare the ratios, which are "
        "taken side by side in one run.",
        (
            Part(
                "batch_bench",
                "vit-predict --out against in-process OnnxClassifier, ViT-Ti/16",
                "Target: `vit-predict --out` within 15 % of the model alone. Its time includes starting Python, "
                "loading the model, committing the parts and merging them.",
            ),
            Part(
                "batch_bench_resume",
                "100,000 images, killed halfway and resumed",
                "`vit-predict DIR --out preds.parquet` killed with SIGKILL once half of its parts were committed, "
                "then the same command plus `--resume`: every image must be in the output exactly once.",
            ),
            Part("ray_batch", "vit-predict --ray: one actor, two actors, and what Ray costs"),
        ),
    ),
    Section(
        "In the browser (`vit-export --web`)",
        "web",
        """\
The page `vit-export --web` writes, in Debian's Chromium (headless, through Playwright), served by
`python -m http.server` on 127.0.0.1, plain and with the cross-origin isolation headers that turn on WASM threads,
against onnxruntime in Python doing the same work on the same number of threads; random weights (speed does not
depend on training, and parity does not either).

- **Page load** is a fresh browser context (no cache) from the navigation until `window.vitscope.ready`: fetching
  onnxruntime-web's WASM and the model, compiling the WASM, creating the session.
- **Per image**, the browser does everything the page does (decode, Pillow-exact resize and crop, the graph with
  its attention maps, rollout) and Python does the same work (`prepare`, then `rollout`).
- **Parity**: on noise images of random sizes (so the page and Pillow both resize and crop); the test asks for
  logits within 1e-4 and a rollout correlation of at least 0.999, and `tests/serve/test_web.py` checks the same on
  the test model in every `make test`.""",
        (Part("web"),),
    ),
    Section(
        "Calibration, prediction sets and unknown inputs (`vit-export`'s calibration)",
        "trust",
        """\
What the exported file's calibrated scores, prediction sets and unknown verdicts are worth, on images the
calibration never saw: Fashion-MNIST's official test set, the sample's validation split. Each run holds back 10 % of
its training images as the calibration split. The models:

```bash
vit-fashion-mnist --out data/fmnist
vit-train fit --config configs/small_images.yaml --data.root data/fmnist --data.img_size 28 \\
  --trainer.default_root_dir runs/fmnist --trainer.enable_progress_bar false --overwrite true
# open set: data/fmnist8/{train,val}/<class> are links to 8 of the 10 class folders (all but ankle_boot and bag),
# and a 12-minute budget (a config holding trainer.callbacks: [TimeBudget(minutes: 12.0)])
vit-train fit --config configs/small_images.yaml --config runs/openset_budget.yaml --data.root data/fmnist8 \\
  --data.img_size 28 --trainer.default_root_dir runs/fmnist8 --trainer.enable_progress_bar false --overwrite true
vit-sample-data --out data/digits
vit-train fit --config configs/sample.yaml --trainer.default_root_dir runs/sample \
  --trainer.enable_progress_bar false --overwrite true
.venv/bin/python -m benchmarks.trust --fmnist runs/fmnist --openset runs/fmnist8 --sample runs/sample
```

"ECE, temperature alone" is softmax(logits / T); "ECE after" adds the confidence map, as the file answers (a file
calibrated on fewer than 1,000 images has the temperature alone). The "re-split" rows pool calibration and test
images and re-draw a calibration set of the same size 100 times: the coverage guarantee is an average over
calibration sets, and these rows measure it. LAC gives the smallest sets, so it is the export's default
(`--conformal aps` for adaptive sets). Unknown inputs: AUROC of each score (higher: better separated) between a
model's test images and 600 images of each kind (scikit-learn's digits scaled to 28 px, uniform noise, random
48-200 px crops of scikit-learn's two sample photos), and for the 8-class model the test images of its 2 held-out
classes; Mahalanobis is the file's own score (its `features` output, class means and shrunk shared covariance).
"Called unknown by the file" is the share its threshold (95 % of calibration images accepted, cross-fitted) flags.
Class-conditional sets need at least 1/(1 - coverage) - 1 images per class; the file refuses them otherwise.""",
        (Part("trust"),),
    ),
)
